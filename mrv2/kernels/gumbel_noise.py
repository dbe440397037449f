"""The sampler's stateless RNG in Triton: Gumbel(0, 1) noise keyed by (seed, position, id).

``mrv2/kernels/gumbel.py`` samples with it; ``mrv2/kernels/gumbel_rng.py`` is its torch
reference, bit for bit. The noise is a pure function of (request seed, absolute position of
the token being sampled, vocab id): an integer hash of those three numbers, so there is no
RNG state to carry between steps.

The RNG, in detail (every float step is plain IEEE fp32 with a fixed evaluation
order, so the torch reference reproduces the kernel's noise bit for bit):

1. Row keys: the 64-bit seed and 64-bit position, split into 32-bit words, go through
   two chains of a 32-bit integer finaliser (``_mix32``: xorshift-multiply, a
   bijection of uint32), giving two row keys ``k1, k2``. For a fixed seed, distinct
   positions give distinct keys (each step of a chain is a bijection).
2. Two 32-bit words per logit, one finaliser round each: ``x = v * 0x9E3779B1`` (a Weyl
   spread of the vocab id), ``hi = mix(x ^ k1)``, ``lo = mix(x ^ k2)``: 64 random bits.
   ``mix`` is lowbias32 (C. Wellons' hash prospector: two xorshift-multiply steps, near
   ideal avalanche). One round suffices: the keys carry the randomness (full 32-bit,
   from (seed, position) through four rounds), and the round only has to decorrelate the
   ids of one row, whose ``x`` differ in at least 4 bits for the first 151,936 ids; two
   independent keys make ``lo`` independent of ``hi``. The statistical tests in
   ``tests/test_gumbel.py`` (the words' top bits, hi vs lo, pairs of ids across rows, the
   sampled law) are the evidence. It halves the integer work of the sampler's bound loop.
3. ``u = (hi * 2**32 + lo + 0.5) / 2**64`` in (0, 1); ``g = -log(E)`` with ``E = -log(u)``
   an Exponential(1) variate. The right tail of ``g`` (the values that win an argmax)
   comes from ``u -> 1``, where ``1 - u`` carries all the information: it is built from
   the complemented words ``(~hi * 2**32 + ~lo + 0.5) / 2**64`` with full relative
   precision, and ``E = -log1p(-u')`` (``u' = 1 - u``) is, for ``u' < 2**-4`` (top word
   < 2**28), the series ``u' + u'^2/2 + ... + u'^6/6`` (truncation < 2**-24 relative),
   else ``-log(u)`` with ``u <= 15/16``. The left tail (``u -> 0``) is resolved down to
   2**-65. So ``g`` spans about [-3.8, 45.1], unquantised at the top (a 24-bit uniform,
   as an early vLLM version had, caps ``g`` at 16.6 and quantises it above ~10).
4. ``log`` is our own fp32 routine (range reduction, then the fdlibm/musl ``logf``
   polynomial, < 1 ulp): ``tl.log``, numpy's and torch's disagree in the last bit on
   ~10% of inputs. Divisions use ``div_rn`` and the GPU launch turns off FMA
   contraction, so the GPU noise equals the CPU noise too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mrv2.kernels.gumbel_rng import (  # noqa: F401 (the reference, re-exported)
    _C3_F,
    _C5_F,
    _C6_F,
    _LG1_F,
    _LG2_F,
    _LG3_F,
    _LG4_F,
    _LN2_HI_F,
    _LN2_LO_F,
    _MASK32,
    _SERIES_TOP,
    _TWO_M32_F,
    _TWO_M64_F,
    GREEDY_TEMPERATURE,
    _f32,
    _log_ref,
    _mix32_ref,
    _row_keys_ref,
    gumbel_noise_ref,
    hash_words_ref,
    key_words_ref,
    words_to_gumbel_ref,
)
from mrv2.platform import TRITON_INTERPRET

_LN2_HI: tl.constexpr = tl.constexpr(_LN2_HI_F)
_LN2_LO: tl.constexpr = tl.constexpr(_LN2_LO_F)
_LG1, _LG2, _LG3, _LG4 = (tl.constexpr(c) for c in (_LG1_F, _LG2_F, _LG3_F, _LG4_F))
_C3, _C5, _C6 = (tl.constexpr(c) for c in (_C3_F, _C5_F, _C6_F))
_TWO_M32, _TWO_M64 = tl.constexpr(_TWO_M32_F), tl.constexpr(_TWO_M64_F)
_SERIES_TOP_C: tl.constexpr = tl.constexpr(_SERIES_TOP)


def _launch_options() -> dict:
    # NOTE: on the GPU, Triton fuses a*b+c into one FMA by default, which rounds once
    # where torch rounds twice: turn it off so the noise equals the reference bit for bit.
    return {} if TRITON_INTERPRET else {"enable_fp_fusion": False}


@triton.jit
def _mix32(x):
    # x: uint32; multiplications wrap modulo 2**32, shifts are logical.
    x = (x ^ (x >> 16)) * 0x7FEB352D
    x = (x ^ (x >> 15)) * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _row_keys(seed, pos):
    # seed, pos: int64 (any shape) -> two uint32 keys of that shape.
    s_lo = seed.to(tl.uint32)
    s_hi = (seed >> 32).to(tl.uint32)
    p_lo = pos.to(tl.uint32)
    p_hi = (pos >> 32).to(tl.uint32)
    a = _mix32(_mix32(_mix32(s_hi ^ 0x9E3779B9) ^ s_lo) ^ p_hi)
    k1 = _mix32(a ^ p_lo)
    b = _mix32(_mix32(_mix32(s_lo ^ 0x85EBCA6B) ^ s_hi) ^ p_lo)
    k2 = _mix32(b ^ p_hi)
    return k1, k2


@triton.jit
def _hash_words(k1, k2, v):
    # k1, k2: uint32 row keys; v: int32 vocab ids (broadcastable) -> (hi, lo) uint32.
    x = v.to(tl.uint32) * 0x9E3779B1
    return _mix32(x ^ k1), _mix32(x ^ k2)


@triton.jit
def _logf(x):
    # Natural log of positive normal fp32 x: range reduction, then the logf polynomial.
    ix = x.to(tl.int32, bitcast=True) + (0x3F800000 - 0x3F3504F3)
    k = ((ix >> 23) - 0x7F).to(tl.float32)
    f = ((ix & 0x007FFFFF) + 0x3F3504F3).to(tl.float32, bitcast=True) - 1.0
    s = tl.math.div_rn(f, f + 2.0)
    z = s * s
    w = z * z
    t1 = w * (w * _LG4 + _LG2)
    t2 = z * (w * _LG3 + _LG1)
    r = t2 + t1
    hfsq = f * f * 0.5
    return s * (hfsq + r) + k * _LN2_LO - hfsq + f + k * _LN2_HI


@triton.jit
def _words_to_gumbel(hi, lo):
    # Two uint32 words -> a Gumbel(0, 1) fp32 variate (see the module docstring).
    u = hi.to(tl.float32) * _TWO_M32 + (lo.to(tl.float32) + 0.5) * _TWO_M64
    hi_c = hi ^ 0xFFFFFFFF
    lo_c = lo ^ 0xFFFFFFFF
    w = hi_c.to(tl.float32) * _TWO_M32 + (lo_c.to(tl.float32) + 0.5) * _TWO_M64  # 1 - u
    poly = w * _C6 + _C5
    poly = w * poly + 0.25
    poly = w * poly + _C3
    poly = w * poly + 0.5
    poly = w * poly + 1.0
    e_small = w * poly
    e_big = -_logf(u)
    e = tl.where(hi_c < _SERIES_TOP_C, e_small, e_big)
    return -_logf(e)


@triton.jit(do_not_specialize=["num_rows"])
def _gumbel_noise_kernel(
    seed_ptr, pos_ptr,                      # inputs
    noise_ptr,                              # outputs
    num_rows, vocab_size,                   # sizes
    noise_stride,                           # strides
    BLOCK_B: tl.constexpr, BLOCK_V: tl.constexpr,
):
    # Load the row keys of a [BLOCK_B, BLOCK_V] tile, hash, store the noise.
    rows = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)                 # [BB]
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)                 # [BV]
    row_mask = rows < num_rows
    seed = tl.load(seed_ptr + rows, mask=row_mask, other=0).to(tl.int64)
    pos = tl.load(pos_ptr + rows, mask=row_mask, other=0).to(tl.int64)
    k1, k2 = _row_keys(seed, pos)
    hi, lo = _hash_words(k1[:, None], k2[:, None], cols[None, :])           # [BB, BV]
    g = _words_to_gumbel(hi, lo)
    mask = row_mask[:, None] & (cols < vocab_size)[None, :]
    tl.store(noise_ptr + rows[:, None].to(tl.int64) * noise_stride + cols[None, :], g, mask=mask)


def _blocks(num_rows: int, vocab_size: int, block_v: int | None,
            block_b: int | None, gpu_block_v: int = 2048) -> tuple[int, int]:
    if block_v is None:
        block_v = min(4096 if TRITON_INTERPRET else gpu_block_v,
                      triton.next_power_of_2(max(vocab_size, 16)))
    if block_b is None:
        # NOTE: the interpreter runs programs one by one: many rows per program there;
        # on the GPU one row per program already gives B * V / BLOCK_V programs.
        # NOTE: the full noise is ALU-bound (hash, 2 logf, 3 div_rn per logit); sampling
        # bounds it with one word and one log, and pays a fixed exact score per program:
        # bigger blocks there. `scripts/bench_sampler.py --sweep` times the alternatives.
        block_b = (min(max(1, 262144 // block_v), triton.next_power_of_2(max(num_rows, 1)))
                   if TRITON_INTERPRET else 1)
    return block_v, block_b


def gumbel_noise(seed: torch.Tensor, pos: torch.Tensor, vocab_size: int, *,
                 block_v: int | None = None, block_b: int | None = None) -> torch.Tensor:
    """The kernel's Gumbel noise, materialised (for tests and the notebook).

    Args:
        seed: ``[B]`` int64; pos: ``[B]`` int64.
        vocab_size: V.

    Returns:
        ``[B, V]`` float32, bit-identical to ``gumbel_noise_ref``.
    """
    num_rows = seed.shape[0]
    noise = torch.empty(num_rows, vocab_size, dtype=torch.float32, device=seed.device)
    if num_rows == 0 or vocab_size == 0:
        return noise
    block_v, block_b = _blocks(num_rows, vocab_size, block_v, block_b)
    grid = (triton.cdiv(num_rows, block_b), triton.cdiv(vocab_size, block_v))
    _gumbel_noise_kernel[grid](seed, pos, noise, num_rows, vocab_size, noise.stride(0),
                               BLOCK_B=block_b, BLOCK_V=block_v, **_launch_options())
    return noise

