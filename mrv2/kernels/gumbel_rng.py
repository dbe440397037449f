"""The Gumbel RNG's specification in torch: its constants and the reference noise.

``mrv2/kernels/gumbel.py`` computes, in Triton, the noise these functions define (the
module docstring there explains the hash, the complemented tail and the fp32 ``log``);
the tests hold the two to bit-for-bit equality on the CPU and the GPU. Kept apart from the
kernels so that each file stays readable; ``gumbel.py`` re-exports every name here.

The hash: two row keys ``k1, k2`` from (seed, position) by chains of the lowbias32
finaliser ``_mix32_ref``; then, per vocab id ``v``, ``x = v * 0x9E3779B1`` and the two
words ``hi = mix(x ^ k1)``, ``lo = mix(x ^ k2)``, ONE finaliser round each. One round
suffices because the keys are already full-entropy 32-bit values, distinct per (seed,
position), and lowbias32's avalanche is near ideal (every input bit flips every output
bit with probability ~1/2): its only job per logit is to decorrelate nearby ids of one
row, and the Weyl multiply already puts any two of the first 151,936 ids (Qwen's
vocabulary) at least 4 bits apart in ``x``. ``tests/test_gumbel.py`` is the evidence (chi-squared of the words'
top bits and of hi against lo, pair correlations, the sampled law).
"""

from __future__ import annotations

import struct

import torch


def _f32(x: float) -> float:
    """``x`` rounded to the nearest fp32 (so torch and Triton use the very same constant)."""
    return struct.unpack("f", struct.pack("f", x))[0]


_MASK32 = 0xFFFFFFFF
#: Rows whose temperature is below this take the argmax (greedy).
GREEDY_TEMPERATURE = 1e-5

# logf constants (fdlibm / musl): ln 2 split in a high and a low part, then the
# minimax polynomial of log((1 + s) / (1 - s)) in s^2.
_LN2_HI_F = float.fromhex("0x1.62e300p-1")   # 6.9313812256e-01
_LN2_LO_F = float.fromhex("0x1.2fefa2p-17")  # 9.0580006145e-06
_LG1_F = float.fromhex("0xaaaaaa.0p-24")
_LG2_F = float.fromhex("0xccce13.0p-25")
_LG3_F = float.fromhex("0x91e9ee.0p-25")
_LG4_F = float.fromhex("0xf89e26.0p-26")
# -log1p(-u) = u + u^2/2 + ... + u^6/6 for u < 2**-4.
_C3_F, _C5_F, _C6_F = _f32(1 / 3), _f32(1 / 5), _f32(1 / 6)
_TWO_M32_F = 2.0 ** -32
_TWO_M64_F = 2.0 ** -64
#: The top hash word below which u' < 2**-4 takes the series.
_SERIES_TOP = 1 << 28


# --- the RNG in torch (the reference) -------------------------------------------------
# uint32 values live in int64 tensors; products wrap modulo 2**64 and only the exact
# low 32 bits are kept.

def _mix32_ref(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 (C. Wellons' hash prospector): a xorshift-multiply bijection of uint32, on
    int64 holding uint32."""
    x = ((x ^ (x >> 16)) * 0x7FEB352D) & _MASK32
    x = ((x ^ (x >> 15)) * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def _row_keys_ref(seed: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two 32-bit keys per row from the int64 seed and int64 position (both ``[B]``)."""
    seed = seed.to(torch.int64)
    pos = pos.to(torch.int64)
    s_lo, s_hi = seed & _MASK32, (seed >> 32) & _MASK32
    p_lo, p_hi = pos & _MASK32, (pos >> 32) & _MASK32
    a = _mix32_ref(_mix32_ref(_mix32_ref(s_hi ^ 0x9E3779B9) ^ s_lo) ^ p_hi)
    k1 = _mix32_ref(a ^ p_lo)
    b = _mix32_ref(_mix32_ref(_mix32_ref(s_lo ^ 0x85EBCA6B) ^ s_hi) ^ p_lo)
    k2 = _mix32_ref(b ^ p_hi)
    return k1, k2


def key_words_ref(k1: torch.Tensor, k2: torch.Tensor,
                  vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The two 32-bit words of every (row, vocab id) from the row keys (``_hash_words``).

    One finaliser round each: ``hi = mix(x ^ k1)``, ``lo = mix(x ^ k2)`` with the Weyl
    spread ``x = v * 0x9E3779B1`` (gumbel.py's docstring, item 2, says why one suffices).

    Args:
        k1, k2: ``[B]`` int64 holding uint32 row keys.
        vocab_size: V.

    Returns:
        ``(hi, lo)``, each ``[B, V]`` int64 holding uint32.
    """
    v = torch.arange(vocab_size, device=k1.device, dtype=torch.int64)
    x = ((v * 0x9E3779B1) & _MASK32)[None, :]                                 # [1, V]
    return _mix32_ref(x ^ k1[:, None]), _mix32_ref(x ^ k2[:, None])           # [B, V] each


def hash_words_ref(seed: torch.Tensor, pos: torch.Tensor,
                   vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The two random 32-bit words of every (row, vocab id).

    Args:
        seed: ``[B]`` int64; pos: ``[B]`` int64.
        vocab_size: V.

    Returns:
        ``(hi, lo)``, each ``[B, V]`` int64 holding uint32.
    """
    return key_words_ref(*_row_keys_ref(seed, pos), vocab_size)


def _log_ref(x: torch.Tensor) -> torch.Tensor:
    """fp32 natural log of positive normal ``x``; the same IEEE steps as ``_logf``."""
    ix = x.view(torch.int32) + (0x3F800000 - 0x3F3504F3)
    k = ((ix >> 23) - 0x7F).to(torch.float32)
    f = ((ix & 0x007FFFFF) + 0x3F3504F3).view(torch.float32) - 1.0           # [sqrt(.5)-1, sqrt(2)-1)
    s = f / (f + 2.0)
    z = s * s
    w = z * z
    t1 = w * (w * _LG4_F + _LG2_F)
    t2 = z * (w * _LG3_F + _LG1_F)
    r = t2 + t1
    hfsq = f * f * 0.5
    return s * (hfsq + r) + k * _LN2_LO_F - hfsq + f + k * _LN2_HI_F


def words_to_gumbel_ref(hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """Gumbel(0, 1) variates from two uint32 words (int64 tensors), in fp32."""
    u = hi.to(torch.float32) * _TWO_M32_F + (lo.to(torch.float32) + 0.5) * _TWO_M64_F
    hi_c, lo_c = hi ^ _MASK32, lo ^ _MASK32
    w = hi_c.to(torch.float32) * _TWO_M32_F + (lo_c.to(torch.float32) + 0.5) * _TWO_M64_F
    # E = -log(1 - w) (Exponential(1)): a series when w is small, else -log(u).
    poly = w * _C6_F + _C5_F
    poly = w * poly + 0.25
    poly = w * poly + _C3_F
    poly = w * poly + 0.5
    poly = w * poly + 1.0
    e_small = w * poly
    e_big = -_log_ref(u)
    e = torch.where(hi_c < _SERIES_TOP, e_small, e_big)
    return -_log_ref(e)


def gumbel_noise_ref(seed: torch.Tensor, pos: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Stateless Gumbel(0, 1) noise keyed by (seed, position, vocab id).

    Args:
        seed: ``[B]`` int64 per-row seeds.
        pos: ``[B]`` int64 absolute position of the token each row samples.
        vocab_size: V.

    Returns:
        ``[B, V]`` float32 noise, bit-identical to ``gumbel_noise`` (the kernel).
    """
    hi, lo = hash_words_ref(seed, pos, vocab_size)
    return words_to_gumbel_ref(hi, lo)


# --- the RNG in Triton ------------------------------------------------------------------
