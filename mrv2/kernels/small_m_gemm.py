"""Decode-sized matrix products on tensor cores: ``x @ W.T`` for 3 to 64 rows, one weight stream.

At batch 4 to 64 a decode step's linear layers still read far more weight bytes than they
do work with: Qwen3-0.6B's four products of a layer stream 31.5 MB, which the H200 reads in
~7.5 us, yet cuBLAS spends ~22 us on them at batch 32 inside the decode CUDA graph, plus a
``splitKreduce`` kernel (and a memset) for its split-K tiles (``../shared/PLATFORM.md``,
decode-sized GEMMs). ``skinny_gemm.py`` wins at 1-2 rows without tensor cores and loses from
4 rows on, where re-reading each weight tile once per row in registers costs more than the
bytes. This kernel is the weight stream with tensor cores: a program owns ``BLOCK_N`` output
columns (rows of ``W``) and ``BLOCK_M`` activation rows (M padded up to the 16 rows ``tl.dot``
needs), walks ``K`` in ``BLOCK_K`` steps with ``tl.dot`` on ``[BLOCK_M, BLOCK_K] x [BLOCK_K,
BLOCK_N]`` into an fp32 accumulator, software-pipelined (``num_stages`` tiles in flight), and
stores in x's dtype. No split-K: every output element is written once by one program, so
there is no reduction kernel and no zeroed buffer, and a CUDA graph holds one launch per
product.

The catch is the program count: without split-K, ``N / BLOCK_N`` programs share the 132 SMs,
and ``tl.dot``'s smallest tile is 16 wide, so N = 1024 (o_proj, down_proj) gets at most 64
programs, each streaming its slab at twice an SM's share of the bandwidth (deep pipelines,
``num_stages`` and ``BLOCK_K``, are how one SM keeps enough bytes in flight). Where M is
large, ``BLOCK_M`` below M splits the rows instead (more programs, each weight tile read once
from HBM and again from L2). ``_launch`` picks provisional defaults; the GPU sweep
(``scripts/bench_small_m_gemm.py --sweep``) measures the real ones. The torch reference is
``F.linear`` itself. Not wired into the model yet.

Compiled for sm_90 without a GPU (Triton 3.6, ``triton.compile`` + ``ptxas -v``), the bf16
defaults take 48-107 registers a thread with no spills; below 64 rows the dot is
``mma.sync``, at 64 rows a Hopper ``wgmma``; loads are ``cp.async`` into shared memory.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mrv2.kernels.skinny_gemm import check_linear_args
from mrv2.platform import TRITON_INTERPRET

#: The most activation rows ``small_m_linear`` takes (beyond this cuBLAS is the right tool).
MAX_M = 64
#: SMs of the H200 the defaults are shaped for (an H100 SXM has the same 132).
NUM_SMS = 132
#: Shared memory one SM offers a block on sm_90 (227 KB), less room for the epilogue.
_SMEM_BYTES = 200 * 1024


# NOTE: M only masks rows, so it is not specialised: one compile per launch config serves every
# row count (otherwise M = 16, 32, 64 and M = 4, 8 would each compile their own binary).
@triton.jit(do_not_specialize=["M"])
def _small_m_gemm_kernel(
    x_ptr, w_ptr, bias_ptr,                  # inputs: x [M, K], W [N, K], bias [N]
    out_ptr,                                 # output [M, N]
    M, N, K,                                 # sizes
    stride_xm, stride_wn, stride_om,         # strides (last dims contiguous)
    HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
):
    # One program: BLOCK_N output columns x BLOCK_M rows; grid (column blocks, row blocks).
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)                   # [BN]
    m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)                   # [BM]
    kk = tl.arange(0, BLOCK_K)                                               # [BK]
    m_mask = m < M
    # NOTE: the last column block wraps onto real rows of W (n % N) instead of masking, so
    # every weight load is unmasked when BLOCK_K divides K; the store drops those columns.
    n_load = n % N
    x_ptrs = x_ptr + m[:, None].to(tl.int64) * stride_xm + kk[None, :]      # [BM, BK]
    w_ptrs = w_ptr + n_load[None, :].to(tl.int64) * stride_wn + kk[:, None]  # [BK, BN]: W^T
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        # load: padded rows of x read as zeros (masked, so they cost no bytes)
        if EVEN_K:
            x = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)
            w = tl.load(w_ptrs)
        else:
            k_ok = kk < K - k0
            x = tl.load(x_ptrs, mask=m_mask[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None], other=0.0)
        # compute: tensor cores, fp32 accumulation
        if IEEE:  # fp32 inputs: exact fp32 products, as F.linear (no TF32)
            acc = tl.dot(x, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w, acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    # store: bias in fp32, then x's dtype
    n_mask = n < N
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + m[:, None].to(tl.int64) * stride_om + n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def _smem_bytes(block_m: int, block_n: int, block_k: int, num_stages: int,
                elem_bytes: int = 2) -> int:
    """Shared memory the pipelined loop holds for its x and W tiles.

    Triton 3.6 for sm_90 (``triton.compile`` without a GPU, metadata ``shared``): with
    ``block_m`` >= 64 the dot is a Hopper ``wgmma`` that reads both tiles from shared memory
    and the loop keeps ``num_stages`` buffers; below 64 rows it is ``mma.sync`` and keeps
    ``num_stages - 1``. (With 2 warps there is no ``wgmma``: the count is then an upper bound.)
    """
    buffers = num_stages if block_m >= 64 else max(1, num_stages - 1)
    return buffers * (block_m + block_n) * block_k * elem_bytes


def _launch(M: int, N: int, K: int, elem_bytes: int = 2) -> dict[str, int]:
    """Default launch for ``M`` rows of ``[N, K]``: block_m, block_n, block_k, num_warps,
    num_stages. PROVISIONAL until the H200 sweep (``scripts/bench_small_m_gemm.py
    --sweep``) measures them; its knobs are ``small_m_linear``'s overrides.

    The model behind them: the time is the bytes the busiest SM pulls. ``block_m`` is M
    padded to a power of two (16 at least: ``tl.dot``'s minimum; at most 64), so W is read
    once. ``block_n`` in (16, 32, 64) minimises programs-per-SM x (block_n W rows + M/2 x
    rows, the x re-reads hitting L2): 16 for N = 1024 (64 programs), 32 for qkv's 4096 (128
    programs), 16 then 64 for gate_up's 6144 as M grows. ``block_k`` (K / 4, in [64, 512])
    and ``num_stages`` (4) shrink until the tiles in flight fit the shared memory of the
    programs sharing one SM: deep pipelines are how 64 programs keep HBM busy. ``elem_bytes``
    is x's element size (fp32 tiles take twice the shared memory of bf16 ones).
    """
    block_m = min(max(16, triton.next_power_of_2(M)), 64)
    waves = {bn: triton.cdiv(triton.cdiv(N, bn), NUM_SMS) for bn in (16, 32, 64)}
    block_n = min(waves, key=lambda bn: (waves[bn] * (bn + M / 2), bn))
    budget = _SMEM_BYTES // waves[block_n]
    block_k = min(512, max(64, triton.next_power_of_2(K) // 4))  # 4 K steps where K allows
    num_stages = 4

    def smem():
        return _smem_bytes(block_m, block_n, block_k, num_stages, elem_bytes)
    while block_k > 64 and smem() > budget:
        block_k //= 2
    while num_stages > 2 and smem() > budget:
        num_stages -= 1
    num_stages = max(2, min(num_stages, triton.cdiv(K, block_k)))
    return {"block_m": block_m, "block_n": block_n, "block_k": block_k, "num_warps": 4,
            "num_stages": num_stages}


def _check_block(name: str, value: int | None, lo: int, hi: int) -> None:
    if value is not None and (not isinstance(value, int) or value < lo or value > hi
                              or value & (value - 1)):
        raise ValueError(f"{name} must be a power of two in [{lo}, {hi}], got {value!r}")


def small_m_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                   *, block_m: int | None = None, block_n: int | None = None,
                   block_k: int | None = None, num_warps: int | None = None,
                   num_stages: int | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for at most ``MAX_M`` rows: one weight stream on
    tensor cores, no split-K (one launch, no reduction kernel, no memset).

    Args:
        x: ``[M, K]`` activations, M <= MAX_M, last dim contiguous (any row stride).
        weight: ``[N, K]`` (an ``nn.Linear`` weight), last dim contiguous, x's dtype.
        bias: optional ``[N]``, contiguous, x's dtype.
        block_m, block_n, block_k: tile overrides (powers of two, 16 at least).
        num_warps, num_stages: launch overrides (ignored by the interpreter).

    Returns:
        ``[M, N]`` in x's dtype (fp32 accumulation).
    """
    check_linear_args("small_m_linear", x, weight, MAX_M)
    M, K = x.shape
    N = weight.shape[0]
    if weight.dtype != x.dtype or weight.device != x.device:
        raise ValueError(f"small_m_linear needs weight on x's device and dtype, got "
                         f"{weight.dtype}/{weight.device} vs {x.dtype}/{x.device}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"small_m_linear takes fp32, bf16 or fp16 x, got {x.dtype}")
    if bias is not None and (bias.shape != (N,) or bias.stride(0) != 1
                             or bias.dtype != x.dtype or bias.device != x.device):
        raise ValueError(f"small_m_linear needs bias [N] = [{N}], contiguous, x's dtype and "
                         f"device, got {tuple(bias.shape)} {bias.dtype} {bias.device}")
    for name, value in (("block_m", block_m), ("block_n", block_n), ("block_k", block_k)):
        _check_block(name, value, 16, 1024)
    _check_block("num_warps", num_warps, 1, 16)
    if num_stages is not None and (not isinstance(num_stages, int) or num_stages < 1):
        raise ValueError(f"num_stages must be a positive int, got {num_stages!r}")
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return out
    if K == 0:
        return out.zero_() if bias is None else out.copy_(bias.expand(M, N))
    cfg = _launch(M, N, K, x.element_size())
    for name, value in (("block_m", block_m), ("block_n", block_n), ("block_k", block_k),
                        ("num_warps", num_warps), ("num_stages", num_stages)):
        if value is not None:
            cfg[name] = value
    bm, bn, bk = cfg["block_m"], cfg["block_n"], cfg["block_k"]
    grid = (triton.cdiv(N, bn), triton.cdiv(M, bm))
    opts = ({} if TRITON_INTERPRET else
            {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]})
    _small_m_gemm_kernel[grid](
        x, weight, bias if bias is not None else weight, out, M, N, K,
        x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32, BLOCK_M=bm, BLOCK_N=bn,
        BLOCK_K=bk, EVEN_K=K % bk == 0, **opts)
    return out
