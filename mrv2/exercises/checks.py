"""The exercise checkers: the learner's version against the package's reference.

A checker builds its cases (random batches plus the edge cases a first attempt gets wrong:
an empty batch, one token, padding slots, a vocabulary that is not a power of two, greedy
rows, ``-inf`` logits), runs the learner's code on each, compares with the reference that
the package itself is tested against, and stops at the first difference with a message a
learner can act on. See notebooks/04_triton_input_prep.ipynb and 05_gumbel_sampling.ipynb.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from mrv2.kernels.block_table import compute_slot_mappings_ref
from mrv2.kernels.gumbel import GREEDY_TEMPERATURE, gumbel_noise_ref, gumbel_sample_ref
from mrv2.kernels.input_prep import prepare_inputs_ref


class ExerciseFailed(AssertionError):
    """The learner's code gave a wrong answer (or raised) on one case; the message says which."""


def _raised(case: str, e: Exception, what: str = "your function") -> ExerciseFailed:
    """The failure of a case whose learner code raised ``e`` (message cut at 400 chars)."""
    return ExerciseFailed(f"case {case!r}: {what} raised {type(e).__name__}: {str(e)[:400]}")


def _require_kernel(kernel) -> None:
    """``TypeError`` unless ``kernel`` is a Triton kernel (something ``kernel[grid]`` launches)."""
    if not hasattr(kernel, "__getitem__"):
        raise TypeError(f"kernel must be a @triton.jit function, got {type(kernel).__name__}")


def _require_callable(fn, name: str) -> None:
    if not callable(fn):
        raise TypeError(f"{name} must be a function, got {type(fn).__name__}")


def _first_diff(name: str, got, want, case: str, inputs: str) -> str | None:
    got = np.asarray(got)
    want = np.asarray(want)
    if got.shape != want.shape:
        return (f"case {case!r}: {name} has shape {got.shape}, expected {want.shape}"
                f"\n  inputs: {inputs}")
    bad = np.flatnonzero(got.reshape(-1) != want.reshape(-1))
    if bad.size == 0:
        return None
    i = int(bad[0])
    return (f"case {case!r}: {name}[{i}] is {got.reshape(-1)[i]}, expected "
            f"{want.reshape(-1)[i]} ({bad.size} entries differ)\n  got:      {got.tolist()}"
            f"\n  expected: {want.tolist()}\n  inputs: {inputs}")


# --- chapter 03: the slot-mapping kernel -----------------------------------------------------

def _slot_cases(rng: np.random.Generator, block_size: int) -> list[tuple[str, dict]]:
    """(name, inputs) of check_slot_mapping_kernel: edge cases first, then random batches."""
    R, NB = 5, 6                                              # rows, blocks per row
    table = rng.permutation(R * NB).reshape(R, NB).astype(np.int32) + 1   # [R, NB] block ids

    def case(rows, counts, computed, pad):
        counts = np.asarray(counts, dtype=np.int32)
        qsl = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)   # [B + 1]
        pos = np.concatenate([np.arange(c, c + n) for c, n in zip(computed, counts)] + [
            np.zeros(pad, dtype=np.int64)]).astype(np.int32)              # [T + pad]
        return {"idx_mapping": np.asarray(rows, dtype=np.int32), "query_start_loc": qsl,
                "positions": pos, "block_table": table}

    bs = block_size
    cases = [
        ("one decode token", case([2], [1], [5], 0)),
        ("a token on each side of a block boundary", case([1], [2], [bs - 1], 0)),
        ("a prefill over several blocks (more tokens than BLOCK)", case([0], [3 * bs + 1], [0],
                                                                       0)),
        ("padding tokens stay -1", case([3, 4], [2, 1], [0, 2 * bs], 3)),
    ]
    for k in range(3):
        n = int(rng.integers(1, R + 1))
        counts = rng.integers(1, 2 * bs, size=n)
        computed = [int(rng.integers(0, NB * bs - c)) for c in counts]
        cases.append((f"random batch {k}", case(rng.permutation(R)[:n], counts, computed,
                                                int(rng.integers(0, 4)))))
    return cases


def check_slot_mapping_kernel(kernel, seed: int = 0) -> None:
    """Check a Triton slot-mapping kernel against ``compute_slot_mappings_ref``.

    The kernel is launched as ``kernel[(num_reqs,)](idx_mapping, query_start_loc,
    positions, block_table, out, block_table.stride(0), block_size, BLOCK=8)``: one
    program per request ``b``, for its tokens ``query_start_loc[b] : query_start_loc[b+1]``
    (more of them than ``BLOCK``: loop), writing ``out[t] = block_table[row, pos //
    block_size] * block_size + pos % block_size`` with ``row = idx_mapping[b]``, ``pos =
    positions[t]``. ``out`` (int64) starts at -1, which padding tokens must keep.

    Args:
        kernel: a ``@triton.jit`` function with that signature.
        seed: the random cases' seed.

    Prints how many cases passed (all of them) and returns None, so that a notebook cell
    ending in the check shows only that line.

    Raises:
        TypeError: ``kernel`` is not a Triton kernel.
        ExerciseFailed: on the first case with a wrong slot (or when the launch raises).
    """
    _require_kernel(kernel)
    block_size = 4
    cases = _slot_cases(np.random.default_rng(seed), block_size)
    for name, inp in cases:
        t = {k: torch.from_numpy(v) for k, v in inp.items()}
        num_reqs, num_tokens = t["idx_mapping"].shape[0], t["positions"].shape[0]
        want = compute_slot_mappings_ref(t["idx_mapping"], t["query_start_loc"], t["positions"],
                                         num_reqs, num_tokens, t["block_table"], block_size)
        out = torch.full((num_tokens,), -1, dtype=torch.int64)
        try:
            kernel[(num_reqs,)](t["idx_mapping"], t["query_start_loc"], t["positions"],
                                t["block_table"], out, t["block_table"].stride(0), block_size,
                                BLOCK=8)
        except Exception as e:  # the learner's bug, reported with its case
            raise _raised(name, e, "the launch") from e
        shown = {k: v.tolist() for k, v in inp.items() if k != "block_table"}
        msg = _first_diff("slot_mapping", out.numpy(), want.numpy(), name,
                          f"{shown}, block_size={block_size}")
        if msg:
            raise ExerciseFailed(msg)
    print(f"check_slot_mapping_kernel: all {len(cases)} cases pass")


# --- chapter 04: prepare_inputs in numpy --------------------------------------------------

def _prep_cases(rng: np.random.Generator) -> list[tuple[str, dict]]:
    """(name, inputs) of check_prepare_inputs: edge cases first, then random batches."""
    R, L = 6, 24                                                    # rows, max_model_len
    token_ids = rng.integers(1, 500, size=(R, L)).astype(np.int32)  # [R, L]

    def case(rows, counts, computed, b_pad, t_pad):
        num_computed = np.zeros(R, dtype=np.int32)
        num_computed[rows] = computed
        idx = np.zeros(b_pad, dtype=np.int32)
        idx[:len(rows)] = rows
        n = np.zeros(b_pad, dtype=np.int32)
        n[:len(rows)] = counts
        return {"idx_mapping": idx, "num_scheduled_tokens": n, "num_reqs": len(rows),
                "num_tokens_padded": t_pad, "token_ids": token_ids,
                "num_computed_tokens": num_computed}

    cases = [
        ("one decode token", case([3], [1], [5], 1, 1)),
        ("one prefill, no padding", case([0], [4], [0], 1, 4)),
        ("padding slots and tokens", case([2, 0], [3, 1], [0, 7], 4, 8)),
        ("empty batch (all padding)", case([], [], [], 2, 4)),
        ("chunk, decodes and a new prefill", case([0, 1, 3, 2], [3, 1, 1, 5], [4, 3, 4, 0],
                                                  6, 16)),
    ]
    for k in range(4):
        n = int(rng.integers(1, R + 1))
        rows = rng.permutation(R)[:n]
        counts = rng.integers(1, 6, size=n)
        computed = np.array([rng.integers(0, L - c) for c in counts])
        cases.append((f"random batch {k}", case(rows, counts, computed, n + int(
            rng.integers(0, 3)), int(counts.sum() + rng.integers(0, 4)))))
    return cases


def check_prepare_inputs(fn: Callable, seed: int = 0) -> None:
    """Check a numpy ``prepare_inputs`` against ``mrv2.kernels.input_prep.prepare_inputs_ref``.

    Args:
        fn: ``fn(idx_mapping, num_scheduled_tokens, num_reqs, num_tokens_padded, token_ids,
            num_computed_tokens)`` with numpy int32 arrays ``[B_pad]``, ``[B_pad]``, ints,
            ``[R, max_model_len]`` and ``[R]``; returns ``(query_start_loc [B_pad + 1],
            seq_lens [B_pad], input_ids [T_pad], positions [T_pad], logits_indices
            [B_pad])``. Padding slots and tokens are 0 (``query_start_loc`` stays flat).
        seed: the random cases' seed.

    Prints how many cases passed (all of them) and returns None, so that a notebook cell
    ending in the check shows only that line.

    Raises:
        TypeError: ``fn`` is not callable.
        ExerciseFailed: on the first case where an output differs (or ``fn`` raises).
    """
    _require_callable(fn, "fn")
    names = ("query_start_loc", "seq_lens", "input_ids", "positions", "logits_indices")
    cases = _prep_cases(np.random.default_rng(seed))
    for name, inp in cases:
        shown = {k: ("[R, L] random" if k == "token_ids" else np.asarray(v).tolist())
                 for k, v in inp.items()}
        want = prepare_inputs_ref(
            torch.from_numpy(inp["idx_mapping"]), torch.from_numpy(inp["num_scheduled_tokens"]),
            inp["num_reqs"], inp["num_tokens_padded"], torch.from_numpy(inp["token_ids"]),
            torch.from_numpy(inp["num_computed_tokens"]))
        try:
            got = fn(*(v.copy() if isinstance(v, np.ndarray) else v for v in inp.values()))
        except Exception as e:  # the learner's bug, reported with its case
            raise ExerciseFailed(f"case {name!r}: your function raised "
                                 f"{type(e).__name__}: {e}\n  inputs: {shown}") from e
        if not isinstance(got, tuple | list) or len(got) != 5:
            raise ExerciseFailed(f"case {name!r}: return the 5 arrays {names}, got {got!r:.200}")
        for field, g, w in zip(names, got, want):
            msg = _first_diff(field, g, w.numpy(), name, str(shown))
            if msg:
                raise ExerciseFailed(msg)
    print(f"check_prepare_inputs: all {len(cases)} cases pass")


# --- chapter 05: the Gumbel-max kernel ------------------------------------------------------

def _gumbel_cases(rng: torch.Generator) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(name, logits [B, V], temperature [B]) of check_gumbel_argmax_kernel."""
    def logits(b, v):
        return torch.randn(b, v, generator=rng) * 3

    ninf = logits(3, 40)
    ninf[:, ::2] = float("-inf")           # half the vocabulary banned
    ties = torch.zeros(2, 16)               # greedy ties go to the lowest id
    negative = logits(2, 20) - 100.0        # a padding lane read as 0 would win
    return [
        ("one row, V a power of two", logits(1, 64), torch.tensor([1.0])),
        ("V not a power of two (masking)", logits(4, 50), torch.tensor([0.7, 1.0, 1.5, 0.3])),
        ("greedy rows (temperature 0)", logits(3, 33), torch.tensor([0.0, 1.0, 0.0])),
        ("greedy ties", ties, torch.tensor([0.0, 0.0])),
        ("-inf logits", ninf, torch.tensor([1.0, 0.0, 2.0])),
        ("all logits negative, V not a power of two", negative, torch.tensor([0.0, 1.0])),
        ("random batch", logits(8, 97), torch.rand(8, generator=rng) * 2),
    ]


def check_gumbel_argmax_kernel(kernel, seed: int = 0) -> None:
    """Check a Triton Gumbel-max kernel against ``mrv2.kernels.gumbel.gumbel_sample_ref``.

    The kernel is launched as ``kernel[(B,)](logits, noise, temperature, out, V,
    logits.stride(0), BLOCK_V=next_power_of_2(V))``: one program per row; ``noise`` is
    the package's stateless Gumbel noise ``[B, V]`` (``gumbel_noise_ref``), ``out`` int64
    ``[B]``. Row ``b`` must store ``argmax(logits[b])`` when ``temperature[b] < 1e-5``,
    else ``argmax(logits[b] / temperature[b] + noise[b])``.

    Args:
        kernel: a ``@triton.jit`` function with that signature.
        seed: the random cases' seed.

    Prints how many cases passed (all of them) and returns None, so that a notebook cell
    ending in the check shows only that line.

    Raises:
        TypeError: ``kernel`` is not a Triton kernel (not subscriptable with a grid).
        ExerciseFailed: on the first case with a wrong id (or when the launch raises).
    """
    import triton  # after mrv2: on a CPU the interpreter is already switched on

    _require_kernel(kernel)
    gen = torch.Generator().manual_seed(seed)
    cases = _gumbel_cases(gen)
    for name, logits, temp in cases:
        b, v = logits.shape
        seeds = torch.arange(b, dtype=torch.int64) + 1000 * seed
        pos = torch.randint(0, 4096, (b,), generator=gen, dtype=torch.int64)
        noise = gumbel_noise_ref(seeds, pos, v)                                   # [B, V]
        want = gumbel_sample_ref(logits, torch.arange(b, dtype=torch.int32), temp, seeds, pos)
        out = torch.full((b,), -1, dtype=torch.int64)
        try:
            kernel[(b,)](logits, noise, temp, out, v, logits.stride(0),
                         BLOCK_V=triton.next_power_of_2(v))
        except Exception as e:  # the learner's bug, reported with its case
            raise _raised(name, e, "the launch") from e
        msg = _first_diff("out", out.numpy(), want.numpy(), name,
                          f"B={b}, V={v}, temperature={temp.tolist()} (greedy below "
                          f"{GREEDY_TEMPERATURE})")
        if msg:
            raise ExerciseFailed(msg)
    print(f"check_gumbel_argmax_kernel: all {len(cases)} cases pass")
