"""Candidates: a search that ends in one program per row, when the bracket is already tight.

After ``_init_kernel`` the block maxima have usually pinned the threshold down to a few
dozen keys: with top-k 20 / top-p 0.95 at 151,936 logits (T = 0.6, randn * 3) about 20
tokens of the row lie above the bracket's lo. The pivot rounds would still read the whole
row once per round, and round 0 is the dear one (job 12A, H200: the count kernel's first
launch held most of its 0.4 ms fp32 / 1.0 ms bf16 a call). So one pass first keeps the
*candidates*, every key above lo, and one program per row finishes the search on them:

1. ``_gather_kernel`` (rows x chunks): per chunk the number of keys above lo and, when at
   most ``SLOTS``, those keys and their ``s`` in id order into the chunk's slots
   (``cand [R, NC, 1 + 2 * SLOTS]`` fp32: the count and the keys as int32 bits, then s).
2. ``_finish_kernel`` (rows): a row whose every chunk fit its slots holds all the keys
   above lo, so count(key > t) and sum(exp(s - m), key > t) over the candidates are the
   row's for any t >= lo: bisection over them gives the exact threshold, and the bracket
   is stored converged, (t - 1, t]. The pivot rounds then skip the row (its programs read
   a few words and exit). A row with a chunk that overflowed keeps its bracket and goes
   through the rounds as before.

A row that falls back pays that read of the logits for nothing, so ``_init_kernel``
skips the pass for a row where more than half the blocks have their max above lo (every
such block holds a candidate; top-p alone, whose lo the maxima rarely raise, is the
usual case): it presets each chunk's count to ``SLOTS + 1``, "overflowed".

On the H200 (job 12E, 256 x 151,936, graph replay, both trees in one job) the filter at
top-k 20 / top-p 0.95 went from 0.80 to 0.50 ms in fp32 and from 1.27 to 0.55 ms in bf16;
the gather pass takes 90 / 104 us, the finish 34 us, and the 8 rounds that now find every
row closed still 113 / 154 us (their programs' launch and exit; one program per 4 chunks
would halve that but slows the rows that fall back: job 12D).
"""

from __future__ import annotations

import triton
import triton.language as tl

from mrv2.kernels.top_k_top_p_chunked import (
    _bound,
    _load_bracket,
    _load_s,
    _row_knobs,
    _store_ends,
)
from mrv2.kernels.top_k_top_p_row import _key

_INT32_MAX: tl.constexpr = tl.constexpr(2**31 - 1)


@triton.jit
def _gather_kernel(
    logits_ptr, idx_mapping_ptr, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr,  # inputs
    bracket_ptr,
    cand_ptr,                                                                        # outputs
    vocab_size, num_chunks,                                                          # sizes
    logits_stride, cand_stride,                                                      # strides
    CHUNK_V: tl.constexpr, SUB_V: tl.constexpr, NUM_PIVOTS: tl.constexpr,
    SLOTS: tl.constexpr,
):
    b = tl.program_id(0)
    c = tl.program_id(1)
    temp, _k, _top_p, _min_p, use_k, use_p, active = _row_knobs(
        b, idx_mapping_ptr, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, vocab_size)
    lo_k, _hi_k, lo_p, _hi_p, need_k, need_p = _load_bracket(bracket_ptr, b, use_k, use_p,
                                                             NUM_PIVOTS)
    out = cand_ptr + (b * num_chunks + c).to(tl.int64) * cand_stride
    # NOTE: _init_kernel set the count to SLOTS + 1 on a row it judged would overflow.
    skip = tl.load(out).to(tl.int32, bitcast=True) > SLOTS
    if active & (need_k | need_p) & ~skip:
        # The candidates: every key above the open searches' lowest lo.
        lo = tl.minimum(tl.where(need_k, lo_k, _INT32_MAX), tl.where(need_p, lo_p, _INT32_MAX))
        row_ptr = logits_ptr + b.to(tl.int64) * logits_stride
        s = _load_s(row_ptr, c * CHUNK_V + tl.arange(0, CHUNK_V), vocab_size, temp)  # [CV]
        num_cand = tl.sum((_key(s).to(tl.int64) > lo).to(tl.int32), axis=0)
        tl.store(out, num_cand.to(tl.float32, bitcast=True))
        if (num_cand > 0) & (num_cand <= SLOTS):
            # Their slots, SUB_V logits at a time (the reloads hit the cache): a running
            # count plus a cumsum over the sub-block. NOTE: not one cumsum over the chunk:
            # its [CV] slots and their addresses took 126 registers (fp32), too few
            # programs per SM for the first pass's loads.
            base = 1                                                           # slot 0: count
            for start in range(0, CHUNK_V, SUB_V):
                sb = _load_s(row_ptr, c * CHUNK_V + start + tl.arange(0, SUB_V), vocab_size,
                             temp)                                             # [SUB]
                kb = _key(sb)
                is_cand = kb.to(tl.int64) > lo                                 # [SUB]
                n = tl.sum(is_cand.to(tl.int32), axis=0)
                if n > 0:
                    slot = base + tl.cumsum(is_cand.to(tl.int32), axis=0) - 1   # [SUB]
                    tl.store(out + slot, kb.to(tl.float32, bitcast=True), mask=is_cand)
                    tl.store(out + SLOTS + slot, sb, mask=is_cand)
                base += n


@triton.jit
def _finish_kernel(
    idx_mapping_ptr, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, cand_ptr,    # inputs
    bracket_ptr, row_f_ptr,                                                          # in/out
    vocab_size, num_chunks,                                                          # sizes
    cand_stride,                                                                     # strides
    NC_POW2: tl.constexpr, NUM_PIVOTS: tl.constexpr, SLOTS: tl.constexpr,
    SLOTS_POW2: tl.constexpr,
):
    b = tl.program_id(0)
    _temp, k, top_p, _min_p, use_k, use_p, active = _row_knobs(
        b, idx_mapping_ptr, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, vocab_size)
    lo_k, hi_k, lo_p, hi_p, need_k, need_p = _load_bracket(bracket_ptr, b, use_k, use_p,
                                                           NUM_PIVOTS)
    # NOTE: the same condition as _gather_kernel's: it read the same bracket.
    if active & (need_k | need_p):
        ci = tl.arange(0, NC_POW2)
        mask = ci < num_chunks
        rows = cand_ptr + (b * num_chunks + ci).to(tl.int64) * cand_stride        # [NC]
        num_cand = tl.load(rows, mask=mask, other=0.0).to(tl.int32, bitcast=True)  # [NC]
        if tl.max(num_cand, axis=0) <= SLOTS:
            sj = tl.arange(0, SLOTS_POW2)
            valid = mask[:, None] & (sj[None, :] < num_cand[:, None])          # [NC, SP]
            keys = tl.load(rows[:, None] + 1 + sj[None, :], mask=valid, other=0.0)
            keys = keys.to(tl.int32, bitcast=True).to(tl.int64)                 # [NC, SP]
            # t: the largest key in [lo, hi) whose predicate fails (count >= k, mass >=
            # top_p * Z above it), so t + 1 is the threshold (_narrow_kernel's hi).
            if need_k:
                lo_k = _bound(keys, valid.to(tl.float32), k.to(tl.float32), lo_k, hi_k)
                hi_k = lo_k + 1
            if need_p:
                s = tl.load(rows[:, None] + 1 + SLOTS + sj[None, :], mask=valid, other=0.0)
                e = tl.where(valid, tl.exp(s - tl.load(row_f_ptr + b * 2)), 0.0)  # [NC, SP]
                lo_p = _bound(keys, e, top_p * tl.load(row_f_ptr + b * 2 + 1), lo_p, hi_p)
                hi_p = lo_p + 1
            # converged: the pivot rounds skip the row, so its pivots are not written
            _store_ends(bracket_ptr, b, lo_k, hi_k, lo_p, hi_p, NUM_PIVOTS)


def cand_width(slots: int) -> int:
    """Floats per chunk in the candidate scratch: the count, ``slots`` keys, ``slots`` s."""
    return 1 + 2 * slots
