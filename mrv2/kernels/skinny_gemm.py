"""Decode-sized matrix products: ``x @ W.T`` for a handful of rows, as a weight stream.

At batch 1 to 8 a decode step's linear layers are matrix-vector products: every weight
byte is read once and used for at most 8 multiply-adds, so the time is the weight read.
cuBLAS picks tile shapes (and split-K) made for large M, and pays ~9-16 us per product
for 4-12 MB of Qwen3-0.6B weights that the H200 streams in 1-3 us
(``../shared/PLATFORM.md``, decode-sized GEMMs). This kernel is the plainest weight
stream: a program owns ``BLOCK_N`` output columns (rows of ``W``), walks ``K`` in
``BLOCK_K`` steps, multiplies each ``[BLOCK_N, BLOCK_K]`` weight tile with the ``M``
activation rows in registers (no tensor cores: M is far below their 16-row minimum) and
accumulates in fp32. No split-K, so no reduction kernel and no memset after it.

Where it pays (H200, job R, ``scripts/bench_skinny_gemm.py``, bf16): a 28-layer chain of
the four Qwen3-0.6B products in one CUDA graph took 528 us against cuBLAS's 828 at M = 1
(0.64x) and 647 against 766 at M = 2 (0.84x), but 1.4x and 3.9x cuBLAS's time at M = 4
and 8, where re-reading each weight tile per row in registers loses to tensor cores. Alone
(L2 flushed) it is about cuBLAS's time, except o_proj (7.5 vs 16.3 us at M = 1): the win
is mostly the split-K reduction kernels and memsets cuBLAS adds inside the graph. ``bench
decode`` at batch 1 went from 1.47 to 1.15 wall ms per step. So the model's ``linear``
takes it for at most ``MODEL_MAX_M`` rows on the GPU (``MRV2_SKINNY_GEMM=0`` turns it
off), cuBLAS above. The torch reference is ``F.linear`` itself.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import nn

from mrv2.platform import TRITON_INTERPRET

#: The most activation rows the kernel takes (it keeps an accumulator per row).
MAX_M = 8
#: The model's linears take the kernel up to this many rows (cuBLAS above; see above).
MODEL_MAX_M = 2
#: On the GPU unless ``MRV2_SKINNY_GEMM=0``.
ENABLED: bool = (not TRITON_INTERPRET) and os.environ.get("MRV2_SKINNY_GEMM", "1") != "0"


@triton.jit
def _skinny_gemm_kernel(
    x_ptr, w_ptr, bias_ptr,                  # inputs: x [M, K], W [N, K], bias [N]
    out_ptr,                                 # output [M, N]
    M, N, K,                                 # sizes
    stride_xm, stride_wn, stride_om,         # strides (last dims contiguous)
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
):
    # One program: BLOCK_N columns of the output for all M (<= BLOCK_M) rows.
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)                   # [BN]
    m = tl.arange(0, BLOCK_M)                                                # [BM]
    kk = tl.arange(0, BLOCK_K)                                               # [BK]
    n_mask = n < N
    m_mask = m < M
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + kk
        w_mask = n_mask[:, None]                                             # [BN, 1]
        x_mask = m_mask[:, None]                                             # [BM, 1]
        if not EVEN_K:  # NOTE: a K that BLOCK_K divides needs no mask along K
            w_mask = w_mask & (k < K)[None, :]
            x_mask = x_mask & (k < K)[None, :]
        w = tl.load(w_ptr + n[:, None].to(tl.int64) * stride_wn + k[None, :],
                    mask=w_mask, other=0.0)                                  # [BN, BK]
        x = tl.load(x_ptr + m[:, None] * stride_xm + k[None, :],
                    mask=x_mask, other=0.0)                                  # [BM, BK]
        prod = w.to(tl.float32)[None, :, :] * x.to(tl.float32)[:, None, :]  # [BM, BN, BK]
        acc += tl.sum(prod, axis=2)                                          # [BM, BN]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + m[:, None] * stride_om + n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


def _launch(M: int, N: int, K: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) for a shape. Job R's sweep at M = 1: 4 columns and
    1024-wide K steps with 4 warps was the best launch of qkv, gate_up and down (within 7%
    for o_proj); 8 columns doubled qkv's time (16.96 vs 8.10 us)."""
    block_k = min(triton.next_power_of_2(K), 1024 if M <= 2 else 512 if M <= 4 else 256)
    return 4, block_k, 4


def check_linear_args(name: str, x: torch.Tensor, weight: torch.Tensor, max_m: int) -> None:
    """Raise ``ValueError`` naming the problem when ``x [M, K] @ weight [N, K].T`` cannot
    go to a decode-sized kernel ``name`` taking at most ``max_m`` rows (before any work)."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"{name} needs x [M, K] and weight [N, K], got "
                         f"{tuple(x.shape)} and {tuple(weight.shape)}")
    if x.shape[0] > max_m:
        raise ValueError(f"{name} takes at most {max_m} rows, got {x.shape[0]}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"{name} needs x and weight with a contiguous last dim, got "
                         f"strides {x.stride()} and {weight.stride()}")


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  *, block_n: int | None = None, block_k: int | None = None,
                  num_warps: int | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for at most ``MAX_M`` rows, as one weight stream.

    Args:
        x: ``[M, K]`` activations (M <= MAX_M), last dim contiguous.
        weight: ``[N, K]`` (an ``nn.Linear`` weight), last dim contiguous, x's dtype.
        bias: optional ``[N]``.
        block_n, block_k, num_warps: launch overrides (the sweep's knobs).

    Returns:
        ``[M, N]`` in x's dtype (fp32 accumulation).
    """
    check_linear_args("skinny_linear", x, weight, MAX_M)
    M, K = x.shape
    N = weight.shape[0]
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return out
    if K == 0:
        return out.zero_() if bias is None else out.copy_(bias.expand(M, N))
    bn, bk, nw = _launch(M, N, K)
    bn, bk, nw = block_n or bn, block_k or bk, num_warps or nw
    grid = (triton.cdiv(N, bn),)
    opts = {} if TRITON_INTERPRET else {"num_warps": nw}
    _skinny_gemm_kernel[grid](
        x, weight, bias if bias is not None else weight, out, M, N, K,
        x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=max(1, triton.next_power_of_2(M)), BLOCK_N=bn,
        BLOCK_K=bk, EVEN_K=K % bk == 0, **opts)
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """The model's linear: ``skinny_linear`` for decode-sized ``x`` when enabled, else
    ``F.linear`` (cuBLAS). The choice reads only shapes, so it is graph- and sync-safe."""
    if (ENABLED and x.dim() == 2 and x.shape[0] <= MODEL_MAX_M and x.is_cuda
            and x.stride(1) == 1 and weight.stride(1) == 1):
        return skinny_linear(x, weight, bias)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """``nn.Linear`` whose forward is :func:`linear` (the same weights and names)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
