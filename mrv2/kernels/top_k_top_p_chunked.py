"""The chunked threshold search of top-k / top-p / min-p: (rows x chunks) programs a pass.

The kernels behind ``apply_top_k_top_p_min_p`` on the GPU; the semantics, the passes
and the launch order are in ``mrv2/kernels/top_k_top_p.py``'s docstring. Scratch
layout (``TopKTopPWorkspace``): ``bracket [R, 4 + 2P]`` int64 (lo_k, hi_k, lo_p, hi_p,
then the next round's P pivots for each search),
``row_f [R, 2]`` fp32 (m, Z), ``part [R, NC, W]`` fp32 per chunk, ``W = max(2P + 4, NB) + 3``
(``NB = CHUNK_V // BLOCK_V``): a round's P counts (int32 bits), P masses and the
smallest / largest key inside each bracket (4 x int32 bits), written over the NB block
maxima that ``_init_kernel`` has read; then the chunk's ``sum(exp(s - m_c))``, its max
``m_c`` and its smallest finite ``s``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from mrv2.kernels.gumbel import GREEDY_TEMPERATURE
from mrv2.kernels.top_k_top_p_row import _key

_GREEDY_T: tl.constexpr = tl.constexpr(GREEDY_TEMPERATURE)
_INT32_MIN: tl.constexpr = tl.constexpr(-2**31)
_INT32_MAX: tl.constexpr = tl.constexpr(2**31 - 1)


@triton.jit
def _row_knobs(b, idx_mapping_ptr, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr,
               vocab_size):
    # The row's knobs through idx_mapping, and whether it has anything to do.
    req = tl.load(idx_mapping_ptr + b).to(tl.int64)
    temp = tl.load(temperature_ptr + req)
    k = tl.load(top_k_ptr + req)
    top_p = tl.load(top_p_ptr + req)
    min_p = tl.load(min_p_ptr + req)
    use_k = (k > 0) & (k < vocab_size)
    use_p = top_p < 1.0
    active = (temp >= _GREEDY_T) & (use_k | use_p | (min_p > 0.0))
    return temp, k, top_p, min_p, use_k, use_p, active


@triton.jit
def _load_s(row_ptr, cols, vocab_size, temp):
    x = tl.load(row_ptr + cols, mask=cols < vocab_size, other=float("-inf"))
    return tl.math.div_rn(x.to(tl.float32), temp)


@triton.jit
def _stats_kernel(
    logits_ptr, idx_mapping_ptr, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr,  # inputs
    part_ptr,                                                                        # outputs
    vocab_size, num_chunks,                                                          # sizes
    logits_stride, part_stride,                                                      # strides
    CHUNK_V: tl.constexpr, BLOCK_V: tl.constexpr, PART_STATS: tl.constexpr,
):
    b = tl.program_id(0)
    c = tl.program_id(1)
    temp, _k, _top_p, _min_p, _use_k, _use_p, active = _row_knobs(
        b, idx_mapping_ptr, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, vocab_size)
    if active:
        # Load one chunk: its max m_c, smallest finite s, sum(exp(s - m_c)), block maxima.
        cols = c * CHUNK_V + tl.arange(0, CHUNK_V)
        s = _load_s(logits_ptr + b.to(tl.int64) * logits_stride, cols, vocab_size, temp)
        m_c = tl.max(s, axis=0)
        # NOTE: an all -inf chunk would give exp(-inf - -inf) = nan; its sum is 0.
        z_c = tl.sum(tl.exp(s - tl.where(m_c > float("-inf"), m_c, 0.0)), axis=0)
        block_max = tl.max(tl.reshape(s, [CHUNK_V // BLOCK_V, BLOCK_V]), axis=1)  # [NB]
        out = part_ptr + (b * num_chunks + c).to(tl.int64) * part_stride
        tl.store(out + tl.arange(0, CHUNK_V // BLOCK_V), block_max)
        tl.store(out + PART_STATS, z_c)
        tl.store(out + PART_STATS + 1, m_c)
        tl.store(out + PART_STATS + 2, tl.min(tl.where(s > float("-inf"), s, float("inf")),
                                              axis=0))


@triton.jit
def _bound(keys, weight, need, lo, hi):
    # The largest t in [lo, hi) with sum(weight, keys > t) >= need, by bisection (lo if none).
    # NOTE: the keys are a subset of the row (block maxima), so the whole row has at least
    # that count / mass above t: the predicate fails at t, which makes t a valid lo.
    for _ in range(32):
        mid = lo + (hi - lo) // 2
        ok = tl.sum(tl.sum(tl.where(keys > mid, weight, 0.0), axis=1), axis=0) >= need
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid)
    return lo


@triton.jit
def _init_kernel(
    idx_mapping_ptr, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, part_ptr,    # inputs
    bracket_ptr, row_f_ptr, cand_ptr,                                                # outputs
    vocab_size, num_chunks,                                                          # sizes
    part_stride, cand_stride,                                                        # strides
    NC_POW2: tl.constexpr, NB: tl.constexpr, PART_STATS: tl.constexpr,
    NUM_PIVOTS: tl.constexpr, SLOTS: tl.constexpr,
):
    b = tl.program_id(0)
    _temp, k, top_p, _min_p, use_k, use_p, active = _row_knobs(
        b, idx_mapping_ptr, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, vocab_size)
    if active:
        # Reduce the chunk stats: m, s_min, Z = sum(z_c * exp(m_c - m)).
        ci = tl.arange(0, NC_POW2)
        mask = ci < num_chunks
        rows = part_ptr + (b * num_chunks + ci).to(tl.int64) * part_stride       # [NC]
        m_c = tl.load(rows + PART_STATS + 1, mask=mask, other=float("-inf"))
        m = tl.max(m_c, axis=0)
        s_min = tl.min(tl.load(rows + PART_STATS + 2, mask=mask, other=float("inf")), axis=0)
        z_c = tl.load(rows + PART_STATS, mask=mask, other=0.0)
        z = tl.sum(tl.where(m_c > float("-inf"), z_c * tl.exp(m_c - m), 0.0), axis=0)
        key_m = _key(m).to(tl.int64)
        lo = _key(s_min).to(tl.int64) - 1
        # Raise each lo with the block maxima: >= k of them above t, or >= top_p * Z of
        # mass above t, means the row's predicate fails at t.
        block_max = tl.load(rows[:, None] + tl.arange(0, NB)[None, :], mask=mask[:, None],
                            other=float("-inf"))                                  # [NC, NB]
        keys = _key(block_max).to(tl.int64)
        lo_k = lo
        lo_p = lo
        if use_k:
            lo_k = _bound(keys, tl.full([NC_POW2, NB], 1.0, tl.float32), k.to(tl.float32),
                          lo, key_m)
        if use_p:
            lo_p = _bound(keys, tl.exp(block_max - m), top_p * z, lo, key_m)
        # NOTE: only max(thresh_k, thresh_p) matters, and thresh_k > lo_k: the top-p search
        # may start at lo_k too (a thresh_p below it is never used), and the other way round.
        lo_k, lo_p = _share_lo(lo_k, key_m, lo_p, key_m, use_k & use_p)
        # The candidates pass (top_k_top_p_cand.py) skips a row where more than half the
        # blocks have their max above lo (each holds a candidate: they would overflow the
        # slots): each chunk's count starts at SLOTS + 1, "overflowed", and is never read.
        # NOTE: its own name: ``lo`` (the unraised start) still decides round 0's pivots.
        lo_cand = tl.minimum(tl.where(use_k, lo_k, key_m), tl.where(use_p, lo_p, key_m))
        hot = tl.sum(tl.sum((keys > lo_cand).to(tl.int32), axis=1), axis=0)
        skip = 2 * hot > num_chunks * NB
        tl.store(cand_ptr + (b * num_chunks + ci).to(tl.int64) * cand_stride,
                 tl.where(skip, SLOTS + 1, 0).to(tl.float32, bitcast=True), mask=mask)
        # Round 0's pivots: a search the maxima did not narrow spans the whole row, so
        # its pivots go at log-probability gaps below m instead of uniform keys.
        piv_k = tl.where(lo_k == lo, _gap_pivots(m, lo_k, key_m, NUM_PIVOTS),
                         _pivots(lo_k, key_m, NUM_PIVOTS))
        piv_p = tl.where(lo_p == lo, _gap_pivots(m, lo_p, key_m, NUM_PIVOTS),
                         _pivots(lo_p, key_m, NUM_PIVOTS))
        _store_bracket(bracket_ptr, b, lo_k, key_m, lo_p, key_m, piv_k, piv_p, NUM_PIVOTS)
        tl.store(row_f_ptr + b * 2, m)
        tl.store(row_f_ptr + b * 2 + 1, z)


@triton.jit
def _share_lo(lo_k, hi_k, lo_p, hi_p, both):
    # Both searches start at the larger lo; one whose hi is <= it is settled (hi - 1, hi].
    lo = tl.maximum(lo_k, lo_p)
    new_k = tl.minimum(lo, hi_k - 1)
    new_p = tl.minimum(lo, hi_p - 1)
    return tl.where(both, new_k, lo_k), tl.where(both, new_p, lo_p)


@triton.jit
def _store_ends(bracket_ptr, b, lo_k, hi_k, lo_p, hi_p, NUM_PIVOTS: tl.constexpr):
    # The first four fields of a bracket row: lo_k, hi_k, lo_p, hi_p.
    row = bracket_ptr + b * (4 + 2 * NUM_PIVOTS)
    tl.store(row, lo_k)
    tl.store(row + 1, hi_k)
    tl.store(row + 2, lo_p)
    tl.store(row + 3, hi_p)


@triton.jit
def _store_bracket(bracket_ptr, b, lo_k, hi_k, lo_p, hi_p, piv_k, piv_p,
                   NUM_PIVOTS: tl.constexpr):
    # A row of the bracket table: lo_k, hi_k, lo_p, hi_p, the next round's P + P pivots.
    _store_ends(bracket_ptr, b, lo_k, hi_k, lo_p, hi_p, NUM_PIVOTS)
    row = bracket_ptr + b * (4 + 2 * NUM_PIVOTS)
    pj = tl.arange(0, NUM_PIVOTS)
    tl.store(row + 4 + pj, piv_k.to(tl.int64))
    tl.store(row + 4 + NUM_PIVOTS + pj, piv_p.to(tl.int64))


@triton.jit
def _load_bracket(bracket_ptr, b, use_k, use_p, NUM_PIVOTS: tl.constexpr):
    row = bracket_ptr + b * (4 + 2 * NUM_PIVOTS)
    lo_k = tl.load(row)
    hi_k = tl.load(row + 1)
    lo_p = tl.load(row + 2)
    hi_p = tl.load(row + 3)
    # A converged bracket (hi = lo + 1) needs no more rounds.
    need_k = use_k & (hi_k - lo_k > 1)
    need_p = use_p & (hi_p - lo_p > 1)
    return lo_k, hi_k, lo_p, hi_p, need_k, need_p


@triton.jit
def _load_pivots(bracket_ptr, b, NUM_PIVOTS: tl.constexpr):
    # The round's pivots (written by the init / the previous narrow kernel), as int32 keys.
    # NOTE: computed once and stored, so _count_kernel and _narrow_kernel use the same ones.
    row = bracket_ptr + b * (4 + 2 * NUM_PIVOTS) + 4
    pj = tl.arange(0, NUM_PIVOTS)
    return tl.load(row + pj).to(tl.int32), tl.load(row + NUM_PIVOTS + pj).to(tl.int32)


@triton.jit
def _pivots(lo, hi, NUM_PIVOTS: tl.constexpr):
    # NUM_PIVOTS non-decreasing keys in [lo, hi], the last one hi.
    j = (tl.arange(0, NUM_PIVOTS) + 1).to(tl.int64)                           # [P]
    return lo + ((hi - lo) * j) // NUM_PIVOTS


@triton.jit
def _gap_pivots(m, lo, hi, NUM_PIVOTS: tl.constexpr):
    # The keys of m - gap, gaps from 64 down to 1/4 (geometric), clamped to [lo, hi].
    j = tl.arange(0, NUM_PIVOTS).to(tl.float32)
    gap = 0.25 * tl.exp2((NUM_PIVOTS - 1 - j) * (8.0 / (NUM_PIVOTS - 1)))     # [P]
    piv = _key(m - gap).to(tl.int64)
    return tl.minimum(tl.maximum(piv, lo), hi)


@triton.jit
def _chunk_partials(row_ptr, chunk_start, vocab_size, temp, m,
                    lo_k, hi_k, lo_p, hi_p, piv_k, piv_p,
                    DO_K: tl.constexpr, DO_P: tl.constexpr,
                    CHUNK_V: tl.constexpr, BLOCK_V: tl.constexpr, NUM_PIVOTS: tl.constexpr):
    # Over one chunk: count(key > piv_k[j]) and sum(exp(s - m), key > piv_p[j]).
    # Pass 1, the whole chunk in one load (enough bytes in flight to hide the latency):
    # what lies above hi passes every pivot, what lies at or below lo none.
    s = _load_s(row_ptr, chunk_start + tl.arange(0, CHUNK_V), vocab_size, temp)
    key = _key(s)                                                              # [CV]
    cnt = tl.zeros([NUM_PIVOTS], dtype=tl.int32)
    mass = tl.zeros([NUM_PIVOTS], dtype=tl.float32)
    # Also the smallest / largest key inside each bracket (the answer is one of them).
    num_inside = 0
    min_k, max_k, min_p, max_p = _INT32_MAX, _INT32_MIN, _INT32_MAX, _INT32_MIN
    if DO_K:
        cnt += tl.sum((key > hi_k).to(tl.int32), axis=0)
        inside = (key > lo_k) & (key <= hi_k)                                  # [CV]
        num_inside += tl.sum(inside.to(tl.int32), axis=0)
        min_k = tl.min(tl.where(inside, key, _INT32_MAX), axis=0)
        max_k = tl.max(tl.where(inside, key, _INT32_MIN), axis=0)
    if DO_P:
        mass += tl.sum(tl.where(key > hi_p, tl.exp(s - m), 0.0), axis=0)
        inside = (key > lo_p) & (key <= hi_p)                                  # [CV]
        num_inside += tl.sum(inside.to(tl.int32), axis=0)
        min_p = tl.min(tl.where(inside, key, _INT32_MAX), axis=0)
        max_p = tl.max(tl.where(inside, key, _INT32_MIN), axis=0)
    # Pass 2, only if a key lies inside a bracket: [BLOCK_V, P] compares block by block,
    # over the blocks that hold one (the reloads hit the cache).
    # NOTE: per-thread partials [BV, P] are reduced once per chunk, not per block.
    if num_inside > 0:
        cols0 = tl.arange(0, BLOCK_V)
        cnt_bp = tl.zeros([BLOCK_V, NUM_PIVOTS], dtype=tl.int32)
        mass_bp = tl.zeros([BLOCK_V, NUM_PIVOTS], dtype=tl.float32)
        for start in range(0, CHUNK_V, BLOCK_V):
            sb = _load_s(row_ptr, chunk_start + start + cols0, vocab_size, temp)
            kb = _key(sb)                                                      # [BV]
            if DO_K:
                in_b = (kb > lo_k) & (kb <= hi_k)                            # [BV]
                if tl.max(in_b.to(tl.int32), axis=0) > 0:
                    cnt_bp += (in_b[:, None] & (kb[:, None] > piv_k[None, :])).to(tl.int32)
            if DO_P:
                in_b = (kb > lo_p) & (kb <= hi_p)                            # [BV]
                if tl.max(in_b.to(tl.int32), axis=0) > 0:
                    eb = tl.exp(sb - m)                                        # [BV]
                    take = in_b[:, None] & (kb[:, None] > piv_p[None, :])    # [BV, P]
                    mass_bp += tl.where(take, eb[:, None], 0.0)
        cnt += tl.sum(cnt_bp, axis=0)
        mass += tl.sum(mass_bp, axis=0)
    return cnt, mass, min_k, max_k, min_p, max_p


@triton.jit
def _count_kernel(
    logits_ptr, idx_mapping_ptr, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr,  # inputs
    bracket_ptr, row_f_ptr,
    part_ptr,                                                                        # outputs
    vocab_size, num_chunks,                                                          # sizes
    logits_stride, part_stride,                                                      # strides
    CHUNK_V: tl.constexpr, BLOCK_V: tl.constexpr, NUM_PIVOTS: tl.constexpr,
):
    b = tl.program_id(0)
    c = tl.program_id(1)
    temp, _k, _top_p, _min_p, use_k, use_p, active = _row_knobs(
        b, idx_mapping_ptr, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, vocab_size)
    lo_k, hi_k, lo_p, hi_p, need_k, need_p = _load_bracket(bracket_ptr, b, use_k, use_p,
                                                           NUM_PIVOTS)
    # A program runs only while one of its row's brackets is open.
    if active & (need_k | need_p):
        m = tl.load(row_f_ptr + b * 2)
        row_ptr = logits_ptr + b.to(tl.int64) * logits_stride
        piv_k, piv_p = _load_pivots(bracket_ptr, b, NUM_PIVOTS)                # [P], [P]
        lo_k32, hi_k32 = lo_k.to(tl.int32), hi_k.to(tl.int32)
        lo_p32, hi_p32 = lo_p.to(tl.int32), hi_p.to(tl.int32)
        # Count / sum only the searches still open.
        if need_k & need_p:
            cnt, mass, min_k, max_k, min_p, max_p = _chunk_partials(
                row_ptr, c * CHUNK_V, vocab_size, temp, m, lo_k32, hi_k32, lo_p32, hi_p32,
                piv_k, piv_p, True, True, CHUNK_V, BLOCK_V, NUM_PIVOTS)
        elif need_k:
            cnt, mass, min_k, max_k, min_p, max_p = _chunk_partials(
                row_ptr, c * CHUNK_V, vocab_size, temp, m, lo_k32, hi_k32, lo_p32, hi_p32,
                piv_k, piv_p, True, False, CHUNK_V, BLOCK_V, NUM_PIVOTS)
        else:
            cnt, mass, min_k, max_k, min_p, max_p = _chunk_partials(
                row_ptr, c * CHUNK_V, vocab_size, temp, m, lo_k32, hi_k32, lo_p32, hi_p32,
                piv_k, piv_p, False, True, CHUNK_V, BLOCK_V, NUM_PIVOTS)
        # Store [cnt (as fp32 bits) | mass | min_k, max_k, min_p, max_p (bits)].
        out = part_ptr + (b * num_chunks + c).to(tl.int64) * part_stride
        pj = tl.arange(0, NUM_PIVOTS)
        tl.store(out + pj, cnt.to(tl.float32, bitcast=True))
        tl.store(out + NUM_PIVOTS + pj, mass)
        e4 = tl.arange(0, 4)
        ends = tl.where(e4 == 0, min_k, tl.where(e4 == 1, max_k, tl.where(e4 == 2, min_p, max_p)))
        tl.store(out + 2 * NUM_PIVOTS + e4, ends.to(tl.float32, bitcast=True))


@triton.jit
def _narrow(lo, hi, piv, found):
    # Predicates are monotone along the (non-decreasing) pivots: the first pivot that
    # holds is the new hi, the last that fails the new lo.
    piv = piv.to(tl.int64)                                                     # [P]
    new_hi = tl.min(tl.where(found, piv, hi), axis=0)
    new_lo = tl.max(tl.where(found, lo, piv), axis=0)
    return new_lo, new_hi


@triton.jit
def _to_data(lo, hi, rows, mask, col):
    # The answer is a key of the row inside the bracket the round counted in (or lo + 1
    # when the predicate already held at lo, which a shared lo allows): so the bracket
    # shrinks to (smallest inside - 1, largest inside]; one key inside: converged.
    ends_lo = tl.load(rows + col, mask=mask, other=0.0).to(tl.int32, bitcast=True)
    ends_hi = tl.load(rows + col + 1, mask=mask, other=0.0).to(tl.int32, bitcast=True)
    key_lo = tl.min(tl.where(mask, ends_lo, _INT32_MAX), axis=0).to(tl.int64)
    key_hi = tl.max(tl.where(mask, ends_hi, _INT32_MIN), axis=0).to(tl.int64)
    found = key_hi >= key_lo
    new_lo = tl.where(found, tl.maximum(lo, key_lo - 1), lo)
    new_hi = tl.where(found, tl.minimum(hi, key_hi), hi)
    return tl.minimum(new_lo, new_hi - 1), new_hi


@triton.jit
def _narrow_kernel(
    idx_mapping_ptr, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, part_ptr,    # inputs
    bracket_ptr, row_f_ptr,                                                          # in/out
    vocab_size, num_chunks,                                                          # sizes
    part_stride,                                                                     # strides
    NC_POW2: tl.constexpr, NUM_PIVOTS: tl.constexpr,
):
    b = tl.program_id(0)
    _temp, k, top_p, _min_p, use_k, use_p, active = _row_knobs(
        b, idx_mapping_ptr, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, vocab_size)
    lo_k, hi_k, lo_p, hi_p, need_k, need_p = _load_bracket(bracket_ptr, b, use_k, use_p,
                                                           NUM_PIVOTS)
    # NOTE: the same condition as _count_kernel's: it read the same bracket.
    if active & (need_k | need_p):
        # Reduce the chunks' partials [NC, P] over the chunks.
        ci = tl.arange(0, NC_POW2)
        pj = tl.arange(0, NUM_PIVOTS)
        rows = part_ptr + (b * num_chunks + ci).to(tl.int64) * part_stride        # [NC]
        mask = ci < num_chunks
        piv_k, piv_p = _load_pivots(bracket_ptr, b, NUM_PIVOTS)                # [P], [P]
        if need_k:
            cnt = tl.load(rows[:, None] + pj[None, :], mask=mask[:, None], other=0.0)
            cnt = tl.sum(cnt.to(tl.int32, bitcast=True), axis=0)                # [P]
            lo_k, hi_k = _narrow(lo_k, hi_k, piv_k, cnt < k)
            lo_k, hi_k = _to_data(lo_k, hi_k, rows, mask, 2 * NUM_PIVOTS)
        if need_p:
            mass = tl.load(rows[:, None] + NUM_PIVOTS + pj[None, :], mask=mask[:, None],
                           other=0.0)
            z = tl.load(row_f_ptr + b * 2 + 1)
            lo_p, hi_p = _narrow(lo_p, hi_p, piv_p, tl.sum(mass, axis=0) < top_p * z)
            lo_p, hi_p = _to_data(lo_p, hi_p, rows, mask, 2 * NUM_PIVOTS + 2)
        lo_k, lo_p = _share_lo(lo_k, hi_k, lo_p, hi_p, use_k & use_p)
        _store_bracket(bracket_ptr, b, lo_k, hi_k, lo_p, hi_p, _pivots(lo_k, hi_k, NUM_PIVOTS),
                       _pivots(lo_p, hi_p, NUM_PIVOTS), NUM_PIVOTS)


@triton.jit
def _write_kernel(
    logits_ptr, idx_mapping_ptr, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr,  # inputs
    bracket_ptr, row_f_ptr,
    # (outputs: logits_ptr, in place)
    vocab_size,                                                                      # sizes
    logits_stride,                                                                   # strides
    CHUNK_V: tl.constexpr, NUM_PIVOTS: tl.constexpr,
):
    b = tl.program_id(0)
    c = tl.program_id(1)
    temp, _k, _top_p, min_p, use_k, use_p, active = _row_knobs(
        b, idx_mapping_ptr, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, vocab_size)
    if active:
        # One threshold (the larger of the active ones); the top token stays.
        hi_k = tl.load(bracket_ptr + b * (4 + 2 * NUM_PIVOTS) + 1)
        hi_p = tl.load(bracket_ptr + b * (4 + 2 * NUM_PIVOTS) + 3)
        m = tl.load(row_f_ptr + b * 2)
        z = tl.load(row_f_ptr + b * 2 + 1)
        thresh = tl.where(use_k, hi_k, _INT32_MIN)
        thresh = tl.where(use_p, tl.maximum(thresh, hi_p), thresh)
        thresh = tl.minimum(thresh, _key(m).to(tl.int64)).to(tl.int32)
        # NOTE: min_p <= 0 gives p_floor <= 0, which no probability is below: off for free.
        p_floor = min_p * (1.0 / z)
        # Write -inf over the removed logits of this chunk.
        row_ptr = logits_ptr + b.to(tl.int64) * logits_stride
        cols = c * CHUNK_V + tl.arange(0, CHUNK_V)
        s = _load_s(row_ptr, cols, vocab_size, temp)
        drop = _key(s) < thresh
        drop = drop | (tl.exp(s - m) / z < p_floor)
        drop = drop & (s < m) & (s > float("-inf"))
        neg_inf = tl.full([CHUNK_V], float("-inf"), tl.float32)
        tl.store(row_ptr + cols, neg_inf.to(logits_ptr.dtype.element_ty),
                 mask=(cols < vocab_size) & drop)
