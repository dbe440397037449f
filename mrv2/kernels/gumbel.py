"""Gumbel-max sampling in Triton, with a stateless RNG keyed by (seed, position, vocab id).

Sampling token ``v`` with probability ``softmax(logits / T)[v]`` is the same as taking
``argmax_v(logits[v] / T + g_v)`` with ``g_v`` i.i.d. Gumbel(0, 1) noise (the Gumbel-max
trick). An argmax is a reduction, so the vocabulary is cut into blocks: each program
adds the noise to one block of one row and keeps its (max, argmax); a second tiny
kernel reduces the blocks of a row. No softmax and no probability vector is ever
materialised, and nothing is sorted.

The noise is a pure function of (request seed, absolute position of the token being
sampled, vocab id): an integer hash of those three numbers, computed in the kernel.
There is no RNG state to carry between steps, so a request samples exactly the same
tokens alone, in a batch of 256, at any batch slot, with any padding. Per-row knobs
(``temperature``, ``seed``) are read in the kernel through ``idx_mapping`` (batch slot
-> state row), never expanded per logit. The noise itself (two hash words per logit, then
an exactly rounded fp32 -log(-log(u))) is ``mrv2/kernels/gumbel_noise.py``.

Sampling does not compute all that per logit: ``g = -log(E) <= -log(E_lb)`` for the larger
of two lower bounds of E from the first hash word's top 23 bits alone, with ``u_up`` =
(those bits + 1) / 2**23 >= u: ``E >= 1 - u_up`` (tight as u -> 1, floored at 2**-66) and
``E >= -log(u_up)`` (tight elsewhere): one hash word, no int -> float conversion and two
fast logs bound every score within ~1e-3 where it can win (with a one-sided bound 11% of the
benchmark's blocks needed the exact pass; now ~0.1%). Each
lane (thread element) keeps its own best bound, its id and its runner-up bound across the
block's sub-chunks, elementwise; one reduction after the walk gives the block's
best-bounded logit (lowest id on ties) and the runner-up bound. That logit gets its exact
score; when no other bound reaches it (minus a rounding slack) it is the block's argmax,
else (near-ties) the block computes every exact score. The ids are the reference's either
way. See notebooks/05_gumbel_sampling.ipynb.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mrv2.kernels.gumbel_noise import (  # noqa: F401 (gumbel_noise, the references: re-exported)
    GREEDY_TEMPERATURE,
    _blocks,
    _f32,
    _hash_words,
    _launch_options,
    _mix32,
    _row_keys,
    _words_to_gumbel,
    gumbel_noise,
    gumbel_noise_ref,
    hash_words_ref,
    key_words_ref,
    words_to_gumbel_ref,
)
from mrv2.platform import TRITON_INTERPRET

_GREEDY_T: tl.constexpr = tl.constexpr(GREEDY_TEMPERATURE)
_INT32_MAX: tl.constexpr = tl.constexpr(2**31 - 1)
# The bound's lower bounds of E (see the kernel): 1 - u_up (floored at 2**-66, below any E:
# w >= 2**-65); -log(u_up) with u_up = (top 23 bits of hi + 1) / 2**23 = m - (1 - 2**-23)
# for m in [1, 2) built from those bits, less a margin for the approximate lg2 (|error| <
# 2**-20 at these magnitudes, times ln 2) and the kernel's fp32 E (~1e-7): 1e-5.
_NEG_LN2 = tl.constexpr(_f32(-0.6931471805599453))
_LOG2E_F = tl.constexpr(_f32(1.4426950408889634))
_ONE_M23, _E_MARGIN = tl.constexpr(1.0 - 2.0 ** -23), tl.constexpr(1e-5)
_TWO_M18 = tl.constexpr(2.0 ** -18)
# 1 - u_up = (2 - 2**-23) - m exactly (Sterbenz), and the floor 2**-66 below every E the noise
# can take (w >= 2**-65, item 3 of gumbel_noise.py).
_TWO_M_ULP, _E_FLOOR = tl.constexpr(2.0 - 2.0 ** -23), tl.constexpr(2.0 ** -66)
#: Interpreter tiles of at most this many logits skip the bound (see ``gumbel_sample``).
EXACT_TILE = 1 << 14
#: On the GPU a program walks its block this many logits at a time, with ``_GPU_WARPS``.
#: NOTE: the whole 4096-wide block at once needed 160 registers a thread (ptxas, sm_90, 8
#: warps): one program per SM, too few loads in flight. With the one-round hash and the
#: per-lane bound state (no shuffles or barriers left in the bound loop) the H200 sweep of
#: job D (256 x 151,936 bf16, `scripts/bench_sampler.py --sweep --gumbel-only`) put 512 at a
#: time with 4 warps first: 107.4 us, against 118.5 at 1024 (the old default) and 139.7 for
#: the two-round hash at 1024 (job R). The bf16 copy of the logits took 41.1 us there.
_GPU_SUB_V = 512  # session 8 final job (tight bound): 80.9 us bf16 256 x 151,936 (was 107.4)
_GPU_WARPS = 4


# --- Gumbel-max sampling ------------------------------------------------------------

@triton.jit
def _fast_log2(x, FAST: tl.constexpr):
    # log2 of positive NORMAL fp32 x, approximate (|error| < 2**-22 absolute): one MUFU lg2
    # on the GPU (.ftz: no subnormal fix-up, 3 instructions a logit fewer; the bound loop's
    # inputs are >= 2**-34); tl.log2 in the interpreter.
    if FAST:
        return tl.inline_asm_elementwise("lg2.approx.ftz.f32 $0, $1;", "=f,f", [x],
                                         dtype=tl.float32, is_pure=True, pack=1)
    else:
        return tl.log2(x)


@triton.jit
def _load_logits(logits_ptr, row_off, row_mask, cols, vocab_size):
    # A [BB, SUB] piece of the logits in fp32; masked rows and the tail past V are -inf.
    mask = row_mask[:, None] & (cols < vocab_size)[None, :]
    return tl.load(logits_ptr + row_off + cols[None, :], mask=mask,
                   other=float("-inf")).to(tl.float32)


@triton.jit
def _merge_argmax(best, best_idx, vals, cols, INT32_MAX: tl.constexpr):
    # Fold a sub-chunk [BB, SUB] into the running (max, argmax) of earlier, lower-index
    # sub-chunks; ties go to the lowest index. The first sub-chunk always lands (a row
    # whose values are all -inf keeps its first id).
    s1 = tl.max(vals, axis=1)                                                 # [BB]
    j1 = tl.min(tl.where(vals == s1[:, None], cols[None, :], INT32_MAX), axis=1)
    take = (s1 > best) | (best_idx == INT32_MAX)
    return tl.where(take, s1, best), tl.where(take, j1, best_idx)


@triton.jit(do_not_specialize=["num_rows"])
def _gumbel_block_argmax_kernel(
    logits_ptr, idx_mapping_ptr, temperature_ptr, seed_ptr, pos_ptr,    # inputs
    block_max_ptr, block_idx_ptr, out_ptr,                               # outputs
    num_rows, vocab_size,                                                # sizes
    logits_stride, partial_stride,                                       # strides
    BLOCK_B: tl.constexpr, BLOCK_V: tl.constexpr, SUB_V: tl.constexpr,
    SINGLE_BLOCK: tl.constexpr, FAST_LOG: tl.constexpr, BOUND: tl.constexpr,
    STAGES: tl.constexpr = None, UNROLL: tl.constexpr = None,
):
    # A program owns BLOCK_V logits of BLOCK_B rows and walks them SUB_V at a time
    # (few registers per thread, so several programs share an SM), keeping running maxima.
    pid_v = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)                 # [BB]
    sub = tl.arange(0, SUB_V)                                                 # [SUB]
    row_mask = rows < num_rows
    row_off = rows[:, None].to(tl.int64) * logits_stride                      # [BB, 1]
    # Stage 1: per-row knobs through idx_mapping (batch slot -> state row).
    req = tl.load(idx_mapping_ptr + rows, mask=row_mask, other=0).to(tl.int64)
    temp = tl.load(temperature_ptr + req, mask=row_mask, other=0.0)
    greedy = temp < _GREEDY_T
    best = tl.full([BLOCK_B], float("-inf"), dtype=tl.float32)
    best_idx = tl.full([BLOCK_B], _INT32_MAX, dtype=tl.int32)
    # Stage 2: sampled rows score x / T + g (masked tokens and the tail are -inf). g needs
    # two hash words, two logs, three divisions per logit; but g <= -log(~hi / 2**32)
    # (E >= 1 - u, see below), so a bound from one word and one approximate log per logit
    # finds the one logit that can win, and the runner-up bound says whether it surely does.
    if tl.sum((row_mask & (temp >= _GREEDY_T)).to(tl.int32), axis=0) > 0:
        seed = tl.load(seed_ptr + req, mask=row_mask, other=0).to(tl.int64)
        pos = tl.load(pos_ptr + rows, mask=row_mask, other=0).to(tl.int64)
        k1, k2 = _row_keys(seed, pos)
        safe_t = tl.where(greedy, 1.0, temp)
        inv_t = 1.0 / safe_t
        if BOUND:
            # NOTE: the bound is kept in log2 units (monotone, so the same order): x * (log2 e
            # / T) - log2(E_lb); only the runner-up goes back to natural units, once.
            inv_t2 = inv_t * _LOG2E_F                                         # [BB]
            # Per lane (one column of the [BB, SUB] chunk, i.e. ids = j mod SUB_V): its best
            # bound, that bound's id and its runner-up bound, updated elementwise; the
            # lanes meet in one reduction after the loop, not three per chunk.
            lane_ub = tl.full([BLOCK_B, SUB_V], float("-inf"), dtype=tl.float32)
            lane_2nd = tl.full([BLOCK_B, SUB_V], float("-inf"), dtype=tl.float32)
            lane_idx = tl.broadcast_to((pid_v * BLOCK_V + sub)[None, :], [BLOCK_B, SUB_V])
            x_sub = sub.to(tl.uint32) * 0x9E3779B1                            # [SUB]
            for s in tl.range(0, BLOCK_V, SUB_V, num_stages=STAGES, loop_unroll_factor=UNROLL):
                cols = pid_v * BLOCK_V + s + sub                              # [SUB]
                x = _load_logits(logits_ptr, row_off, row_mask, cols, vocab_size)  # [BB, SUB]
                # cols * 0x9E3779B1 (mod 2**32), as (chunk start) * c + sub * c: one add.
                x_v = (pid_v * BLOCK_V + s).to(tl.uint32) * 0x9E3779B1 + x_sub   # [SUB]
                hi = _mix32(x_v[None, :] ^ k1[:, None])                       # [BB, SUB]
                # g = -log(E) <= -log(E_lb) for any E_lb <= E. Two lower bounds from the top 23
                # bits of hi alone, as m = 1 + bits / 2**23 in [1, 2) and u_up = m - (1 - 2**-23)
                # >= u: E = -log(u) >= -log(u_up) (tight where u is not near 1), and E >= 1 - u
                # >= 1 - u_up = (2 - 2**-23) - m, exact in fp32 (tight as u -> 1), floored at
                # 2**-66 (no E is smaller: w >= 2**-65). No int -> float conversion (a
                # quarter-rate instruction): job 11A, 80.8 -> 78.5 us bf16. Only the top bucket
                # (u_up = 1, one logit in 2**23) is floored; its bound then wins its block, so it
                # gets the exact score. On the benchmark's logits (randn * 3, T = 0.6) 0.08% of
                # the blocks fall back to every exact score (float64 mirror on the CPU).
                m = ((hi >> 9) | 0x3F800000).to(tl.float32, bitcast=True)    # [1, 2)
                e_up = tl.fma(_fast_log2(m - _ONE_M23, FAST_LOG), _NEG_LN2, -_E_MARGIN)
                e_lb = tl.maximum(tl.maximum(e_up, _TWO_M_ULP - m), _E_FLOOR)  # [BB, SUB]
                ub = tl.where(greedy[:, None], x,
                              tl.fma(x, inv_t2[:, None], -_fast_log2(e_lb, FAST_LOG)))
                # NOTE: strictly greater: a lane's earlier (lower) id keeps a tie, and the
                # tie's bound lands in the runner-up, which then forces the exact pass. The
                # runner-up is the larger of the old one and the smaller of (ub, old best):
                # three min/max, no select that would need the old best kept in a copy.
                lane_idx = tl.where(ub > lane_ub, cols[None, :], lane_idx)
                lane_2nd = tl.maximum(lane_2nd, tl.minimum(ub, lane_ub))
                lane_ub = tl.maximum(lane_ub, ub)
            # The best-bounded id (lowest on ties; a row of -inf keeps the block's first
            # id) and the runner-up: the best of the other lanes' best and its lane's 2nd.
            best = tl.max(lane_ub, axis=1)                                    # [BB]
            best_idx = tl.min(tl.where(lane_ub == best[:, None], lane_idx, _INT32_MAX), axis=1)
            star_lane = lane_idx == best_idx[:, None]                         # [BB, SUB]
            ub_2nd = tl.max(tl.where(star_lane, lane_2nd, lane_ub), axis=1)   # [BB]
            # back to natural units: x / T - ln(E_lb) (greedy rows: x itself)
            ub_2nd = tl.where(greedy, ub_2nd, ub_2nd * -_NEG_LN2)
            # The exact score of the best-bounded logit (the same IEEE steps as below).
            star_ok = row_mask & (best_idx < vocab_size)
            x_star = tl.load(logits_ptr + rows.to(tl.int64) * logits_stride + best_idx,
                             mask=star_ok, other=float("-inf")).to(tl.float32)  # [BB]
            h_s, l_s = _hash_words(k1, k2, best_idx)
            best = tl.where(greedy, x_star,
                            tl.math.div_rn(x_star, safe_t) + _words_to_gumbel(h_s, l_s))
            # NOTE: the slack covers the bound's fp32 rounding (a few ulps of |x / T| + 46)
            # and the approximate lg2 (< 1e-4 absolute + 2**-21 relative); a logit whose
            # bound is below best - slack scores strictly below best, so when every other
            # bound is, it is the argmax.
            slack = 1e-4 + (tl.abs(best) + 92.0) * _TWO_M18
            done = star_ok & (greedy | (ub_2nd < best - slack) | (best == float("-inf")))
        else:  # NOTE: the interpreter pays per operation: small tiles skip the bound
            done = row_mask & ~row_mask
        if tl.sum((row_mask & ~done).to(tl.int32), axis=0) > 0:
            # Rare (near-ties, many logits close to the top): every logit's exact score.
            best = tl.full([BLOCK_B], float("-inf"), dtype=tl.float32)
            best_idx = tl.full([BLOCK_B], _INT32_MAX, dtype=tl.int32)
            for s in range(0, BLOCK_V, SUB_V):
                cols = pid_v * BLOCK_V + s + sub                              # [SUB]
                x = _load_logits(logits_ptr, row_off, row_mask, cols, vocab_size)  # [BB, SUB]
                hi, lo = _hash_words(k1[:, None], k2[:, None], cols[None, :])
                g = _words_to_gumbel(hi, lo)
                val = tl.where(greedy[:, None], x, tl.math.div_rn(x, safe_t[:, None]) + g)
                best, best_idx = _merge_argmax(best, best_idx, val, cols, _INT32_MAX)
    else:  # every row greedy: the plain argmax
        for s in range(0, BLOCK_V, SUB_V):
            cols = pid_v * BLOCK_V + s + sub                                  # [SUB]
            x = _load_logits(logits_ptr, row_off, row_mask, cols, vocab_size)  # [BB, SUB]
            best, best_idx = _merge_argmax(best, best_idx, x, cols, _INT32_MAX)
    if SINGLE_BLOCK:
        tl.store(out_ptr + rows, best_idx.to(tl.int64), mask=row_mask)
    else:
        part = rows.to(tl.int64) * partial_stride + pid_v
        tl.store(block_max_ptr + part, best, mask=row_mask)
        tl.store(block_idx_ptr + part, best_idx, mask=row_mask)


@triton.jit(do_not_specialize=["num_rows"])
def _argmax_reduce_kernel(
    block_max_ptr, block_idx_ptr,            # inputs
    out_ptr,                                 # outputs
    num_rows, num_blocks,                    # sizes
    partial_stride,                          # strides
    BLOCK_B: tl.constexpr, BLOCK_NB: tl.constexpr,
):
    # Load every block's (max, argmax) of BLOCK_B rows; keep the max, lowest index on ties.
    rows = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)                 # [BB]
    blk = tl.arange(0, BLOCK_NB)                                              # [NB]
    mask = (rows < num_rows)[:, None] & (blk < num_blocks)[None, :]
    offs = rows[:, None].to(tl.int64) * partial_stride + blk[None, :]
    vals = tl.load(block_max_ptr + offs, mask=mask, other=float("-inf"))      # [BB, NB]
    idx = tl.load(block_idx_ptr + offs, mask=mask, other=_INT32_MAX)
    best = tl.max(vals, axis=1)
    best_idx = tl.min(tl.where(vals == best[:, None], idx, _INT32_MAX), axis=1)
    # NOTE: only a NaN logit leaves no match; report id 0 rather than an invalid id.
    best_idx = tl.where(best_idx == _INT32_MAX, 0, best_idx)
    tl.store(out_ptr + rows, best_idx.to(tl.int64), mask=rows < num_rows)


def gumbel_sample(logits: torch.Tensor, idx_mapping: torch.Tensor, temperature: torch.Tensor,
                  seed: torch.Tensor, pos: torch.Tensor, out: torch.Tensor | None = None, *,
                  block_v: int | None = None, block_b: int | None = None,
                  sub_v: int | None = None, num_warps: int | None = None,
                  bound: bool | None = None, stages: int | None = None,
                  unroll: int | None = None) -> torch.Tensor:
    """Sample one token per row by Gumbel-max, without a softmax and without a CPU sync.

    Row ``b`` (state row ``r = idx_mapping[b]``) takes ``argmax(logits[b])`` when
    ``temperature[r] < 1e-5``, else ``argmax(logits[b] / temperature[r] + g)`` with
    ``g = gumbel_noise_ref(seed[r], pos[b])``. Ties go to the lowest token id; a -inf
    logit is never drawn while the row has a finite one.

    Args:
        logits: ``[B, V]`` float32 (or bfloat16 on the GPU); last dim contiguous.
        idx_mapping: ``[B]`` int32 batch slot -> state-table row.
        temperature: ``[R]`` float32 per state row.
        seed: ``[R]`` int64 per state row.
        pos: ``[B]`` int64 absolute position of the token each row samples.
        out: optional ``[B]`` int64 to write into.
        block_v, block_b, num_warps: launch overrides (defaults suit the platform).
        sub_v: logits a program handles at a time inside its block (a power of two
            dividing ``block_v``; default: 512 on the GPU, the whole block in the
            interpreter).
        bound: find each block's candidate by the one-word bound first (``None``: always
            on the GPU; in the interpreter only for tiles over ``EXACT_TILE`` logits).
            The ids are the same either way.

    Returns:
        ``[B]`` int64 token ids (``out`` when given), on the logits' device.
    """
    num_rows, vocab_size = logits.shape
    if out is None:
        out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    if num_rows == 0:
        return out
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    block_v, block_b = _blocks(num_rows, vocab_size, block_v, block_b, gpu_block_v=4096)
    if sub_v is None:
        sub_v = block_v if TRITON_INTERPRET else min(block_v, _GPU_SUB_V)
    if sub_v < 16 or sub_v & (sub_v - 1) or block_v % sub_v:
        raise ValueError(f"sub_v must be a power of two >= 16 dividing block_v ({block_v}), "
                         f"got {sub_v}")
    num_blocks = triton.cdiv(vocab_size, block_v)
    grid = (triton.cdiv(num_rows, block_b), num_blocks)
    opts = _launch_options()
    # NOTE: the bound's log only: an NVIDIA GPU's lg2.approx (MUFU); the exact ids never
    # depend on it (the slack covers its error).
    fast_log = not TRITON_INTERPRET and torch.version.hip is None
    if num_warps is not None or not TRITON_INTERPRET:
        opts["num_warps"] = num_warps or _GPU_WARPS   # the interpreter: only when given
    if bound is None:
        # NOTE: the interpreter pays per operation: on a small tile the exact score of
        # every logit (fewer, wider ops) is cheaper than the bound and its second stage.
        bound = not TRITON_INTERPRET or block_b * block_v > EXACT_TILE
    opts["BOUND"] = bound
    opts["STAGES"], opts["UNROLL"] = stages, unroll
    if num_blocks == 1:
        _gumbel_block_argmax_kernel[grid](
            logits, idx_mapping, temperature, seed, pos, out, out, out,
            num_rows, vocab_size, logits.stride(0), 0,
            BLOCK_B=block_b, BLOCK_V=block_v, SUB_V=sub_v, SINGLE_BLOCK=True,
            FAST_LOG=fast_log, **opts)
        return out
    block_max = torch.empty(num_rows, num_blocks, dtype=torch.float32, device=logits.device)
    block_idx = torch.empty(num_rows, num_blocks, dtype=torch.int32, device=logits.device)
    _gumbel_block_argmax_kernel[grid](
        logits, idx_mapping, temperature, seed, pos, block_max, block_idx, out,
        num_rows, vocab_size, logits.stride(0), num_blocks,
        BLOCK_B=block_b, BLOCK_V=block_v, SUB_V=sub_v, SINGLE_BLOCK=False,
        FAST_LOG=fast_log, **opts)
    block_nb = triton.next_power_of_2(num_blocks)
    rb = (min(max(1, 16384 // block_nb), triton.next_power_of_2(num_rows))
          if TRITON_INTERPRET else 4)
    _argmax_reduce_kernel[(triton.cdiv(num_rows, rb),)](
        block_max, block_idx, out, num_rows, num_blocks, num_blocks,
        BLOCK_B=rb, BLOCK_NB=block_nb)
    return out


def gumbel_sample_ref(logits: torch.Tensor, idx_mapping: torch.Tensor,
                      temperature: torch.Tensor, seed: torch.Tensor,
                      pos: torch.Tensor) -> torch.Tensor:
    """The torch reference of ``gumbel_sample`` (same arguments, same ids).

    Returns:
        ``[B]`` int64 token ids.
    """
    req = idx_mapping.to(torch.int64)
    temp = temperature[req]                                                   # [B]
    greedy = temp < GREEDY_TEMPERATURE
    x = logits.to(torch.float32)                                              # [B, V]
    noise = gumbel_noise_ref(seed[req], pos, logits.shape[1])                 # [B, V]
    val = torch.where(greedy[:, None], x, x / torch.where(greedy, 1.0, temp)[:, None] + noise)
    return val.argmax(dim=-1)
