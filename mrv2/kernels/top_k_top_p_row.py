"""Top-k / top-p / min-p by threshold search, one program per row (the first version).

The same filter as ``mrv2/kernels/top_k_top_p.py`` (see its docstring for the
semantics), searched by a single program per row that loops over the whole row for
every pass: 1 max / min pass, up to 8 pivot-search passes, 1 write pass. With 256
rows of 151,936 logits that is latency-bound (5.8 ms on the H200), so the GPU uses the
chunked search of ``top_k_top_p.py``; this one is kept because under TRITON_INTERPRET
(one Python loop per program) a single program per row is the cheaper way to run, and
as the baseline for ``scripts/bench_sampler.py``.

The search runs over the *integer keys* of fp32 values (the bit pattern, with the low 31
bits flipped for negatives, orders like the floats), so it ends on an exact logit
value after at most 32 bits: each pass over the row tests ``NUM_PIVOTS`` candidate
thresholds at once ([BLOCK_V, NUM_PIVOTS] compares), so 16 pivots need 8 passes.
Each thread keeps its own partial counts / masses over a whole pass (one
cross-thread reduction per pass, not per block), and a row runs only the searches it
uses (top-k alone counts, top-p alone sums masses, min-p alone one ``Z`` pass). Rows
with every filter off (or greedy rows) return at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mrv2.kernels.gumbel import GREEDY_TEMPERATURE
from mrv2.platform import TRITON_INTERPRET

_GREEDY_T: tl.constexpr = tl.constexpr(GREEDY_TEMPERATURE)
_INT32_MIN: tl.constexpr = tl.constexpr(-2**31)


@triton.jit
def _key(s):
    # fp32 -> int32 key ordered like the floats (low 31 bits flipped for negatives).
    bits = s.to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _search(row_ptr, vocab_size, temp, m, k, top_p, key_min, key_m,
            DO_K: tl.constexpr, DO_P: tl.constexpr,
            BLOCK_V: tl.constexpr, NUM_PIVOTS: tl.constexpr, NUM_ROUNDS: tl.constexpr):
    # The top-k and/or top-p threshold keys (each the smallest key t in (lo, hi] where its
    # predicate holds: count(s > t) < k, mass(s > t) < top_p * Z), and Z = sum(exp(s - m)).
    # NOTE: per-thread partial counts/masses [BV, P] are reduced once per pass, not per block.
    cols0 = tl.arange(0, BLOCK_V)
    j = (tl.arange(0, NUM_PIVOTS) + 1).to(tl.int64)                           # [P]
    lo_k = key_min - 1
    hi_k = key_m
    lo_p = key_min - 1
    hi_p = key_m
    z = 0.0
    for rnd in range(NUM_ROUNDS):
        # A converged bracket (hi = lo + 1) needs no pass; round 0 always runs (it sums Z).
        active = rnd == 0
        if DO_K:
            active = active | (hi_k - lo_k > 1)
        if DO_P:
            active = active | (hi_p - lo_p > 1)
        if active:
            piv_k = (lo_k + ((hi_k - lo_k) * j) // NUM_PIVOTS).to(tl.int32)     # [P]
            piv_p = (lo_p + ((hi_p - lo_p) * j) // NUM_PIVOTS).to(tl.int32)     # [P]
            cnt = tl.zeros([BLOCK_V, NUM_PIVOTS], dtype=tl.int32)
            mass = tl.zeros([BLOCK_V, NUM_PIVOTS], dtype=tl.float32)
            z_acc = tl.zeros([BLOCK_V], dtype=tl.float32)
            for start in range(0, vocab_size, BLOCK_V):
                cols = start + cols0
                s = tl.math.div_rn(tl.load(row_ptr + cols, mask=cols < vocab_size,
                                           other=float("-inf")).to(tl.float32), temp)
                key = _key(s)[:, None]                                         # [BV, 1]
                if DO_K:
                    cnt += (key > piv_k[None, :]).to(tl.int32)                 # [BV, P]
                if DO_P:
                    e = tl.exp(s - m)                                          # [BV]
                    z_acc += e
                    mass += tl.where(key > piv_p[None, :], e[:, None], 0.0)    # [BV, P]
                else:
                    if rnd == 0:
                        z_acc += tl.exp(s - m)
            if rnd == 0:
                z = tl.sum(z_acc, axis=0)
            # Predicates are monotone along the (non-decreasing) pivots: the first pivot
            # that holds is the new hi, the last that fails the new lo.
            if DO_K:
                found = tl.sum(cnt, axis=0).to(tl.float32) < k.to(tl.float32)   # [P]
                hi_k = tl.min(tl.where(found, piv_k.to(tl.int64), hi_k), axis=0)
                lo_k = tl.max(tl.where(found, lo_k, piv_k.to(tl.int64)), axis=0)
            if DO_P:
                found = tl.sum(mass, axis=0) < top_p * z
                hi_p = tl.min(tl.where(found, piv_p.to(tl.int64), hi_p), axis=0)
                lo_p = tl.max(tl.where(found, lo_p, piv_p.to(tl.int64)), axis=0)
    if DO_K and DO_P:
        thresh = tl.maximum(hi_k, hi_p)
    elif DO_K:
        thresh = hi_k
    else:
        thresh = hi_p
    return thresh, z


@triton.jit
def _top_k_top_p_min_p_kernel(
    logits_ptr, idx_mapping_ptr, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr,  # inputs
    # (outputs: logits_ptr, in place)
    vocab_size,                                                                      # sizes
    logits_stride,                                                                   # strides
    BLOCK_V: tl.constexpr, NUM_PIVOTS: tl.constexpr, NUM_ROUNDS: tl.constexpr,
):
    b = tl.program_id(0)
    # Stage 1: the row's knobs through idx_mapping; skip rows with nothing to do.
    req = tl.load(idx_mapping_ptr + b).to(tl.int64)
    temp = tl.load(temperature_ptr + req)
    k = tl.load(top_k_ptr + req)
    top_p = tl.load(top_p_ptr + req)
    min_p = tl.load(min_p_ptr + req)
    use_k = (k > 0) & (k < vocab_size)
    use_p = top_p < 1.0
    if (temp >= _GREEDY_T) & (use_k | use_p | (min_p > 0.0)):
        row_ptr = logits_ptr + b.to(tl.int64) * logits_stride
        cols0 = tl.arange(0, BLOCK_V)
        # Stage 2: row max m and smallest finite value of s = x / T.
        m = float("-inf")
        s_min = float("inf")
        for start in range(0, vocab_size, BLOCK_V):
            cols = start + cols0
            s = tl.math.div_rn(tl.load(row_ptr + cols, mask=cols < vocab_size,
                                       other=float("-inf")).to(tl.float32), temp)
            m = tl.maximum(m, tl.max(s, axis=0))
            s_min = tl.minimum(s_min, tl.min(tl.where(s > float("-inf"), s, float("inf")), axis=0))
        # Stage 3: the searches the row uses (key(s_min) - 1 fails, key(m) holds).
        key_m = _key(m).to(tl.int64)
        key_min = _key(s_min).to(tl.int64)
        if use_k & use_p:
            thresh, z = _search(row_ptr, vocab_size, temp, m, k, top_p, key_min, key_m,
                                True, True, BLOCK_V, NUM_PIVOTS, NUM_ROUNDS)
        elif use_k:
            thresh, z = _search(row_ptr, vocab_size, temp, m, k, top_p, key_min, key_m,
                                True, False, BLOCK_V, NUM_PIVOTS, NUM_ROUNDS)
        else:
            # top-p alone, or min-p alone (then one round only sums Z; the threshold is off)
            thresh, z = _search(row_ptr, vocab_size, temp, m, k, top_p, key_min, key_m,
                                False, True, BLOCK_V, NUM_PIVOTS, NUM_ROUNDS)
            thresh = tl.where(use_p, thresh, -2**31)
        # Stage 4: one threshold (the larger of the active ones); the top token stays.
        thresh = tl.minimum(thresh, key_m).to(tl.int32)
        # NOTE: min_p <= 0 gives p_floor <= 0, which no probability is below: off for free.
        p_floor = min_p * (1.0 / z)
        # Stage 5: write -inf over the removed logits.
        for start in range(0, vocab_size, BLOCK_V):
            cols = start + cols0
            mask = cols < vocab_size
            s = tl.math.div_rn(tl.load(row_ptr + cols, mask=mask,
                                       other=float("-inf")).to(tl.float32), temp)
            drop = _key(s) < thresh
            drop = drop | (tl.exp(s - m) / z < p_floor)
            drop = drop & (s < m) & (s > float("-inf"))
            neg_inf = tl.full([BLOCK_V], float("-inf"), tl.float32)
            tl.store(row_ptr + cols, neg_inf.to(logits_ptr.dtype.element_ty), mask=mask & drop)


def apply_top_k_top_p_min_p_row(logits: torch.Tensor, idx_mapping: torch.Tensor,
                            temperature: torch.Tensor, top_k: torch.Tensor,
                            top_p: torch.Tensor, min_p: torch.Tensor, *,
                            block_v: int | None = None, num_pivots: int = 16,
                            num_warps: int | None = None) -> torch.Tensor:
    """Write -inf, in place, over the logits that top-k / top-p / min-p remove.

    Probabilities are those of ``logits / temperature``; greedy rows (temperature
    < 1e-5) and rows with every filter off are left untouched. No CPU sync.

    Args:
        logits: ``[B, V]`` float32 (or bfloat16 on the GPU), last dim contiguous; modified.
        idx_mapping: ``[B]`` int32 batch slot -> state-table row.
        temperature: ``[R]`` float32.
        top_k: ``[R]`` int32 (<= 0 or >= V: off).
        top_p: ``[R]`` float32 (>= 1: off; the top token always stays).
        min_p: ``[R]`` float32 (<= 0: off).
        block_v, num_pivots, num_warps: launch overrides.

    Returns:
        ``logits`` itself.
    """
    num_rows, vocab_size = logits.shape
    if num_rows == 0 or vocab_size == 0:
        return logits
    if logits.stride(1) != 1:
        raise ValueError("apply_top_k_top_p_min_p_row works in place and needs logits with a "
                         f"contiguous last dim, got strides {tuple(logits.stride())}")
    if num_pivots < 2 or num_pivots & (num_pivots - 1):
        raise ValueError(f"num_pivots must be a power of two >= 2, got {num_pivots}")
    if block_v is None:
        block_v = min(4096 if TRITON_INTERPRET else 512,
                      triton.next_power_of_2(max(vocab_size, 16)))
    # The key range spans at most 2**32 values; each pass divides it by num_pivots.
    num_rounds = -(-32 // (num_pivots.bit_length() - 1))
    opts = {} if TRITON_INTERPRET else {"num_warps": num_warps or 8}
    _top_k_top_p_min_p_kernel[(num_rows,)](
        logits, idx_mapping, temperature, top_k, top_p, min_p,
        vocab_size, logits.stride(0),
        BLOCK_V=block_v, NUM_PIVOTS=num_pivots, NUM_ROUNDS=num_rounds, **opts)
    return logits

