"""Chapter 01's checker: paged decode attention in numpy against ``paged_attention_ref``.

The learner reads each request's keys and values from the paged KV cache through its block
table, cuts them at ``seq_len`` and attends with one query token per request (a decode step),
query head ``h`` reading KV head ``h // (num_heads // num_kv_heads)``. The cases are those a
first attempt gets wrong: one cached token, a sequence ending on a block boundary and one just
past it, stale keys left in a block past ``seq_len``, plain multi-head attention next to GQA, a
padding slot (``seq_len`` 0) and an empty batch. See notebooks/01_qwen3_and_paged_kv.ipynb.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from mrv2.exercises.checks import ExerciseFailed, _require_callable
from mrv2.forward_context import AttentionMetadata
from mrv2.kernels.attention import paged_attention_ref

_ATOL = 1e-5


def _decode_case(rng: np.random.Generator, seq_lens, num_heads: int, num_kv_heads: int,
                 block_size: int = 4, num_blocks: int = 16, head_dim: int = 8) -> dict:
    """One decode batch: random queries, a cache full of random (also stale) values."""
    b = len(seq_lens)
    max_blocks = max([-(-s // block_size) for s in seq_lens] + [1])
    # Distinct random blocks per request, in a random order: block ids say nothing of position.
    perm = rng.permutation(num_blocks)[:b * max_blocks]
    table = perm.reshape(b, max_blocks).astype(np.int32)                  # [B, max_blocks]
    cache = rng.normal(size=(2, num_blocks, block_size, num_kv_heads, head_dim))
    return {"q": rng.normal(size=(b, num_heads, head_dim)).astype(np.float32),     # [B, H, D]
            "kv_cache": cache.astype(np.float32),             # [2, NB, BS, H_kv, D]; every slot set
            "block_table": table, "seq_lens": np.asarray(seq_lens, dtype=np.int32),
            "scale": head_dim ** -0.5}


def _decode_cases(rng: np.random.Generator) -> list[tuple[str, dict]]:
    bs = 4
    cases = [
        ("one cached token (seq_len 1)", _decode_case(rng, [1], 4, 2)),
        ("a sequence ending on a block boundary", _decode_case(rng, [2 * bs], 4, 2)),
        ("one token past a block boundary (stale slots after seq_len)",
         _decode_case(rng, [bs + 1], 4, 2)),
        ("GQA, 4 query heads per KV head", _decode_case(rng, [7, 3], 8, 2)),
        ("multi-head attention (num_heads == num_kv_heads)", _decode_case(rng, [5, 9], 2, 2)),
        ("a padding slot (seq_len 0) gives zeros", _decode_case(rng, [6, 0, 3], 4, 2)),
        ("empty batch", _decode_case(rng, [], 4, 2)),
    ]
    for k in range(3):
        n = int(rng.integers(1, 5))
        cases.append((f"random batch {k}", _decode_case(rng, rng.integers(1, 13, size=n), 4, 2)))
    return cases


def _reference(inp: dict) -> np.ndarray:
    b = inp["seq_lens"].shape[0]
    meta = AttentionMetadata(
        query_start_loc=torch.arange(b + 1, dtype=torch.int32),    # one query token per request
        seq_lens=torch.from_numpy(inp["seq_lens"]),
        block_table=torch.from_numpy(inp["block_table"]),
        slot_mapping=torch.full((b,), -1, dtype=torch.int64),      # nothing is written here
        max_query_len=1, max_seq_len=int(inp["seq_lens"].max(initial=0)))
    out = paged_attention_ref(torch.from_numpy(inp["q"]), torch.from_numpy(inp["kv_cache"]),
                              meta, inp["scale"])
    return out.numpy()


def check_paged_decode_attention(fn: Callable, seed: int = 0) -> None:
    """Check a numpy paged decode attention against ``mrv2.kernels.attention.paged_attention_ref``.

    Args:
        fn: ``fn(q, kv_cache, block_table, seq_lens, scale)`` with numpy arrays ``q``
            float32 ``[B, H, D]`` (the one new token of each request, at position
            ``seq_lens[b] - 1``), ``kv_cache`` float32 ``[2, num_blocks, block_size, H_kv,
            D]`` (0: keys, 1: values; it already holds every request's keys up to and
            including its new token), ``block_table`` int32 ``[B, max_blocks]``,
            ``seq_lens`` int32 ``[B]`` and a float ``scale``; returns ``[B, H, D]``: the
            softmax(``q . k * scale``)-weighted values over positions ``0 .. seq_lens[b] -
            1``, and zeros for a slot whose ``seq_lens`` is 0.
        seed: the random cases' seed.

    Prints how many cases passed (all of them) and returns None, so that a notebook cell
    ending in the check shows only that line.

    Raises:
        TypeError: ``fn`` is not callable.
        ExerciseFailed: on the first case where the output differs by more than 1e-5 (or
            ``fn`` raises).
    """
    _require_callable(fn, "fn")
    cases = _decode_cases(np.random.default_rng(seed))
    for name, inp in cases:
        shown = (f"seq_lens={inp['seq_lens'].tolist()}, block_table={inp['block_table'].tolist()}"
                 f", num_heads={inp['q'].shape[1]}, num_kv_heads={inp['kv_cache'].shape[3]}, "
                 f"block_size={inp['kv_cache'].shape[2]}")
        want = _reference(inp)
        try:
            got = fn(inp["q"].copy(), inp["kv_cache"].copy(), inp["block_table"].copy(),
                     inp["seq_lens"].copy(), inp["scale"])
        except Exception as e:  # the learner's bug, reported with its case
            raise ExerciseFailed(f"case {name!r}: your function raised {type(e).__name__}: "
                                 f"{e}\n  inputs: {shown}") from e
        got = np.asarray(got, dtype=np.float64)
        if got.shape != want.shape:
            raise ExerciseFailed(f"case {name!r}: out has shape {got.shape}, expected "
                                 f"{want.shape} ([B, num_heads, head_dim])\n  inputs: {shown}")
        err = np.abs(got - want).max(axis=-1, initial=0.0)                        # [B, H]
        if (err > _ATOL).any() or not np.isfinite(got).all():
            b, h = np.argwhere((err > _ATOL) | ~np.isfinite(got).all(-1))[0]
            raise ExerciseFailed(
                f"case {name!r}: out[{b}, {h}] differs from the reference by {err[b, h]:.3g} "
                f"(request {b}, query head {h})\n  got:      {np.round(got[b, h], 4).tolist()}"
                f"\n  expected: {np.round(want[b, h], 4).tolist()}\n  inputs: {shown}")
    print(f"check_paged_decode_attention: all {len(cases)} cases pass")
