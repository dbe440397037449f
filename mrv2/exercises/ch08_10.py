"""Exercise checkers of chapters 08, 09 and 10: the learner's version against the package's.

Each checker builds its cases (random ones plus the edge cases a first attempt gets wrong),
runs the learner's code on each, computes the answer with the package's own functions (the
ones its tests pin down: ``CudaGraphManager``, ``prepare_inputs_ref``,
``exact_accept_rows_ref``, ``decode_roofline``, ``shard_spec``, ``summarize``) and stops at
the first difference with a message naming the case and the output. See the "Build it
yourself" sections of notebooks/08_* to 12_*.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch

from mrv2.cuda_graphs import CudaGraphManager, capture_sizes
from mrv2.exercises.checks import (
    ExerciseFailed,
    _first_diff,
    _raised,
    _require_callable,
    _require_kernel,
)
from mrv2.kernels.block_table import compute_slot_mappings_ref
from mrv2.kernels.input_prep import prepare_inputs_ref


def _close_diff(name: str, got, want, case: str, inputs: str, rtol: float = 1e-9) -> str | None:
    """Like ``_first_diff`` for floats (and ``None``, which must match exactly)."""
    if want is None or got is None:
        if got is None and want is None:
            return None
        return f"case {case!r}: {name} is {got!r}, expected {want!r}\n  inputs: {inputs}"
    try:
        ok = math.isclose(float(got), float(want), rel_tol=rtol, abs_tol=1e-12)
    except (TypeError, ValueError):
        ok = False
    if ok:
        return None
    return f"case {case!r}: {name} is {got!r}, expected {want!r}\n  inputs: {inputs}"


# --- chapter 08: the CUDA-graph size of a step, and its padding ----------------------------

def _graph_cases(rng: np.random.Generator) -> list[tuple[str, list[int], list[int]]]:
    """(name, capture sizes, num_scheduled_tokens per request) of check_graph_padding."""
    small = [1, 2, 4, 8]
    cases = [
        ("one decode", small, [1]),
        ("a captured size exactly", small, [1] * 4),
        ("between two sizes: pad 5 up to 8", small, [1] * 5),
        ("above the largest size: eager", small, [1] * 9),
        ("a prefill chunk in the batch: eager", small, [1, 5, 1]),
        ("max_num_reqs=20 is captured too", capture_sizes(20), [1] * 17),
    ]
    for k in range(3):
        sizes = capture_sizes(int(rng.integers(3, 80)))
        n = int(rng.integers(1, sizes[-1] + 1))
        cases.append((f"random decode batch {k}", sizes, [1] * n))
    return cases


def check_graph_padding(fn: Callable, seed: int = 0) -> None:
    """Check a graph-size chooser and padder against ``CudaGraphManager`` and the prep refs.

    Args:
        fn: ``fn(sizes, num_scheduled_tokens, seq_lens, slot_mapping)`` with ``sizes`` the
            captured decode batch sizes (sorted ints), numpy int32 ``[B]``, ``[B]`` and int64
            ``[T]`` (``T = sum(num_scheduled_tokens)``) of a step's real requests. Returns
            ``None`` when the step runs eagerly (not one token per request, or more requests
            than the largest size), else ``(size, query_start_loc [size + 1], seq_lens [size],
            slot_mapping [size])``: the smallest captured size that holds the batch, and the
            inputs padded as a replay needs them (padding slots: an empty query, ``seq_len``
            0, slot -1).
        seed: the random cases' seed.

    Prints how many cases passed and returns None. (An empty step never gets here: the
    runner returns before it picks a graph.)

    Raises:
        TypeError: ``fn`` is not callable.
        ExerciseFailed: on the first case where the size or an array differs (or ``fn``
            raises).
    """
    _require_callable(fn, "fn")
    rng = np.random.default_rng(seed)
    cases = _graph_cases(rng)
    R, block_size, num_blocks = 256, 4, 8                              # rows, KV block shape
    block_table = torch.from_numpy(rng.permutation(R * num_blocks).reshape(R, num_blocks)
                                   .astype(np.int32) + 1)               # [R, NB] block ids
    token_ids = torch.from_numpy(rng.integers(1, 900, (R, num_blocks * block_size))
                                 .astype(np.int32))                     # [R, L]
    for name, sizes, counts in cases:
        b = len(counts)
        rows = rng.permutation(R)[:b].astype(np.int32)
        n_sched = np.asarray(counts, dtype=np.int32)
        computed = np.zeros(R, dtype=np.int32)
        computed[rows] = [int(rng.integers(0, num_blocks * block_size - c)) for c in counts]
        seq_lens = computed[rows] + n_sched                             # [B]
        t = int(n_sched.sum())
        # The step's real (unpadded) slot mapping, from the package's prep references.
        qsl, _, _, pos, _ = prepare_inputs_ref(torch.from_numpy(rows), torch.from_numpy(n_sched),
                                               b, t, token_ids, torch.from_numpy(computed))
        slots = compute_slot_mappings_ref(torch.from_numpy(rows), qsl, pos, b, t, block_table,
                                          block_size).numpy()           # [T]
        mgr = CudaGraphManager(sizes)
        mgr.graphs = dict.fromkeys(sizes)                               # as if captured
        size = mgr.padded_size(b, t)
        shown = (f"sizes={sizes if len(sizes) < 12 else sizes[:6] + ['...'] + sizes[-2:]}, "
                 f"num_scheduled_tokens={n_sched.tolist()}, seq_lens={seq_lens.tolist()}")
        try:
            got = fn(list(sizes), n_sched.copy(), seq_lens.copy(), slots.copy())
        except Exception as e:  # the learner's bug, reported with its case
            raise _raised(name, e) from e
        if size is None:
            if got is not None:
                raise ExerciseFailed(f"case {name!r}: this step runs eagerly (return None), got "
                                     f"{got!r:.200}\n  inputs: {shown}")
            continue
        if not isinstance(got, tuple | list) or len(got) != 4:
            raise ExerciseFailed(f"case {name!r}: return (size, query_start_loc, seq_lens, "
                                 f"slot_mapping), got {got!r:.200}\n  inputs: {shown}")
        if got[0] != size:
            raise ExerciseFailed(f"case {name!r}: size is {got[0]!r}, expected {size} (the "
                                 f"smallest captured size >= {b} requests)\n  inputs: {shown}")
        pad_rows = np.zeros(size, dtype=np.int32)
        pad_rows[:b] = rows
        pad_n = np.zeros(size, dtype=np.int32)
        pad_n[:b] = n_sched
        qsl_p, seq_p, _, pos_p, _ = prepare_inputs_ref(
            torch.from_numpy(pad_rows), torch.from_numpy(pad_n), b, size, token_ids,
            torch.from_numpy(computed))
        slot_p = compute_slot_mappings_ref(torch.from_numpy(pad_rows), qsl_p, pos_p, b, size,
                                           block_table, block_size)
        for field, g, w in zip(("query_start_loc", "seq_lens", "slot_mapping"), got[1:],
                               (qsl_p, seq_p, slot_p)):
            msg = _first_diff(field, g, w.numpy(), name, shown)
            if msg:
                raise ExerciseFailed(msg)
    print(f"check_graph_padding: all {len(cases)} cases pass")


# --- chapter 09: the exact acceptance kernel ------------------------------------------------

def _accept_cases(gen: torch.Generator):
    """(name, drafts [R, K], idx_mapping [B], target [B, K + 1], num_spec [B])."""
    def case(k, rows, num_spec, hits, vocab=50, r=6):
        b = len(rows)
        target = torch.randint(0, vocab, (b, k + 1), generator=gen, dtype=torch.int32)
        drafts = torch.randint(0, vocab, (r, k), generator=gen, dtype=torch.int32)
        for i, (row, h) in enumerate(zip(rows, hits)):   # the first h drafts are right
            drafts[row, :h] = target[i, :h]
            if h < k:
                drafts[row, h] = (target[i, h] + 1) % vocab
        return (drafts, torch.tensor(rows, dtype=torch.int32), target,
                torch.tensor(num_spec, dtype=torch.int32))

    cases = [
        ("one request, every draft accepted (the bonus token)", case(3, [0], [3], [3])),
        ("first draft rejected", case(3, [0], [3], [0])),
        ("K_b = 0: a request that did not speculate", case(3, [1], [0], [3])),
        ("drafts read through idx_mapping", case(3, [4, 1, 2], [3, 3, 3], [1, 2, 3])),
    ]
    d, idx, t, ns = case(3, [2], [2], [3])                 # right past K_b: not accepted
    cases.append(("a right draft past K_b is not accepted", (d, idx, t, ns)))
    d, idx, t, ns = case(3, [3], [3], [3])
    d[3, 1], t[0, 1] = -1, -1                              # no proposal: never accepted
    cases.append(("a -1 draft (no proposal) stops acceptance", (d, idx, t, ns)))
    cases.append(("K + 1 not a power of two (masking)", case(4, [0, 5], [4, 2], [4, 1])))
    for k in range(2):
        b = int(torch.randint(1, 7, (1,), generator=gen))
        rows = torch.randperm(6, generator=gen)[:b].tolist()
        ns = torch.randint(0, 4, (b,), generator=gen).tolist()
        hits = torch.randint(0, 4, (b,), generator=gen).tolist()
        cases.append((f"random batch {k}", case(3, rows, ns, hits)))
    return cases


def check_accept_kernel(kernel, seed: int = 0) -> None:
    """Check a Triton ``exact`` acceptance kernel against ``exact_accept_rows_ref``.

    The kernel is launched as ``kernel[(B,)](draft_token_ids, idx_mapping, target,
    num_spec_tokens, out, num_accepted, K, draft_token_ids.stride(0),
    BLOCK_K1=next_power_of_2(K + 1))``: one program per request ``b``, whose drafts are
    ``draft_token_ids[idx_mapping[b], :num_spec_tokens[b]]`` (int32, the state table's ``[R,
    K]`` draft slots, -1: no proposal) and whose target samples are ``target[b, :K + 1]``
    (int32, contiguous). It accepts drafts while each equals the target's sample at its
    position, and writes ``out[b]`` (int32 ``[B, K + 1]``): the accepted drafts, then the
    target's sample at the first position not accepted, then -1; and ``num_accepted[b]``.

    Args:
        kernel: a ``@triton.jit`` function with that signature.
        seed: the random cases' seed.

    Prints how many cases passed and returns None.

    Raises:
        TypeError: ``kernel`` is not a Triton kernel.
        ExerciseFailed: on the first case where ``out`` or ``num_accepted`` differs (or the
            launch raises).
    """
    import triton  # after mrv2: on a CPU the interpreter is already switched on

    from mrv2.spec_decode.accept_rows import exact_accept_rows_ref

    _require_kernel(kernel)
    cases = _accept_cases(torch.Generator().manual_seed(seed))
    for name, (drafts, idx, target, num_spec) in cases:
        b, k = idx.shape[0], drafts.shape[1]
        gather = torch.arange(b * (k + 1), dtype=torch.int64).view(b, k + 1)
        want = exact_accept_rows_ref(drafts, idx, target.reshape(-1), gather, num_spec)
        out = torch.full((b, k + 1), -7, dtype=torch.int32)          # -7: never written
        num_acc = torch.full((b,), -7, dtype=torch.int32)
        try:
            kernel[(b,)](drafts, idx, target, num_spec, out, num_acc, k, drafts.stride(0),
                         BLOCK_K1=triton.next_power_of_2(k + 1))
        except Exception as e:  # the learner's bug, reported with its case
            raise _raised(name, e, "the launch") from e
        shown = (f"drafts of the rows={drafts[idx.long()].tolist()}, target={target.tolist()}, "
                 f"num_spec_tokens={num_spec.tolist()}, idx_mapping={idx.tolist()}")
        for field, g, w in (("out", out, want.output_token_ids),
                            ("num_accepted", num_acc, want.num_accepted)):
            msg = _first_diff(field, g.numpy(), w.numpy(), name, shown)
            if msg:
                raise ExerciseFailed(msg)
    print(f"check_accept_kernel: all {len(cases)} cases pass")


# --- chapter 10: the roofline of a decode step ----------------------------------------------

_QWEN3_06B = {"vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072,
              "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
              "head_dim": 128, "tie_word_embeddings": True}


def _roofline_cases(rng: np.random.Generator) -> list[tuple[str, dict, int, int, float, float]]:
    """(name, config, dtype bytes, batch, context, bandwidth GB/s) of check_decode_roofline."""
    small = {"vocab_size": 1000, "hidden_size": 64, "intermediate_size": 192,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "head_dim": 16, "tie_word_embeddings": True}
    cases = [
        ("Qwen3-0.6B's shape, bf16, batch 1", _QWEN3_06B, 2, 1, 160.0, 4200.0),
        ("empty batch: the weights alone", small, 2, 0, 100.0, 1000.0),
        ("untied embeddings: the lm_head is read too", {**small, "tie_word_embeddings": False},
         2, 8, 64.0, 1000.0),
        ("head_dim != hidden / heads, one KV head", {**small, "head_dim": 32,
                                                     "num_key_value_heads": 1}, 4, 3, 10.0, 50.0),
        ("large batch: the KV read dominates", _QWEN3_06B, 2, 256, 850.0, 4200.0),
    ]
    for k in range(2):
        heads = int(rng.choice([2, 4, 8]))
        kv_heads = [h for h in (1, 2, heads) if heads % h == 0]
        cfg = {"vocab_size": int(rng.integers(100, 5000)),
               "hidden_size": int(rng.choice([32, 64])),
               "intermediate_size": int(rng.integers(16, 200)),
               "num_hidden_layers": int(rng.integers(1, 5)), "num_attention_heads": heads,
               "num_key_value_heads": int(rng.choice(kv_heads)),
               "head_dim": int(rng.choice([8, 16])),
               "tie_word_embeddings": bool(rng.integers(2))}
        cases.append((f"random config {k}", cfg, int(rng.choice([2, 4])),
                      int(rng.integers(1, 64)), float(rng.integers(1, 2000)),
                      float(rng.uniform(100, 5000))))
    return cases


def check_decode_roofline(fn: Callable, seed: int = 0) -> None:
    """Check a decode-step roofline against ``mrv2.bench.roofline`` on Qwen3 configs.

    Args:
        fn: ``fn(cfg, dtype_bytes, batch, context, bandwidth_gbs)`` with ``cfg`` a dict of a
            Qwen3 config (``vocab_size``, ``hidden_size``, ``intermediate_size``,
            ``num_hidden_layers``, ``num_attention_heads``, ``num_key_value_heads``,
            ``head_dim``, ``tie_word_embeddings``; no biases, q/k-norm on), the bytes of one
            weight / KV element, the requests in the step, their mean cached tokens and the
            copy bandwidth in GB/s (1e9 bytes/s). Returns ``(weight_bytes, kv_bytes,
            step_ms)``: the bytes of every parameter (a tied lm_head counts once), the K and V
            bytes of every request's cached context, and their sum read at the bandwidth.
        seed: the random cases' seed.

    Prints how many cases passed and returns None.

    Raises:
        TypeError: ``fn`` is not callable.
        ExerciseFailed: on the first case where a figure differs (or ``fn`` raises).
    """
    from transformers import Qwen3Config

    from mrv2.bench.roofline import decode_roofline, kv_bytes_per_token, weight_bytes
    from mrv2.models.qwen3 import Qwen3ForCausalLM

    _require_callable(fn, "fn")
    cases = _roofline_cases(np.random.default_rng(seed))
    for name, cfg, nbytes, batch, context, bw in cases:
        dtype = {2: torch.bfloat16, 4: torch.float32}[nbytes]
        hf = Qwen3Config(**cfg, max_position_embeddings=64)
        with torch.device("meta"):                                  # shapes only, no memory
            model = Qwen3ForCausalLM(hf).to(dtype)
        want = decode_roofline(weight_bytes(model), kv_bytes_per_token(hf, dtype), batch,
                               context, bw)
        shown = f"cfg={cfg}, dtype_bytes={nbytes}, batch={batch}, context={context}, bw={bw}"
        try:
            got = fn(dict(cfg), nbytes, batch, context, bw)
        except Exception as e:  # the learner's bug, reported with its case
            raise _raised(name, e) from e
        if not isinstance(got, tuple | list) or len(got) != 3:
            raise ExerciseFailed(f"case {name!r}: return (weight_bytes, kv_bytes, step_ms), got "
                                 f"{got!r:.200}")
        for field, g, w in zip(("weight_bytes", "kv_bytes", "step_ms"), got,
                               (want["weight_bytes"], want["kv_bytes"], want["step_ms"])):
            msg = _close_diff(field, g, w, name, shown)
            if msg:
                raise ExerciseFailed(msg)
    print(f"check_decode_roofline: all {len(cases)} cases pass")
