"""The decode layer's weight-stream GEMMs with their neighbours fused in: norm, residual, SwiGLU.

At batch 1 a decode step is launch-bound, not byte-bound: every kernel boundary costs a
fixed ramp of a few microseconds (``../shared/PLATFORM.md``, decode-sized GEMMs), and a
layer ran ~10.5 of them (RMSNorm, qkv, q/k-norm + RoPE, attention, o_proj, add + RMSNorm,
gate_up, SiLU * up, down, ...). These kernels are ``skinny_gemm``'s weight stream (a
program owns a few output columns, walks K, keeps the <= 8 activation rows in registers)
with the small neighbour ops moved into its prologue and epilogue:

* ``skinny_norm_linear``: RMSNorm in the prologue (qkv_proj). Each program first takes
  its rows' inverse RMS over all of K (x is <= 8 x hidden, read from L1/L2), then streams
  the weight against ``x * rstd * norm_weight``.
* ``skinny_linear_add``: ``residual += x @ W.T`` in the epilogue (o_proj, down_proj).
* ``skinny_norm_gate_up_silu``: RMSNorm in the prologue, SiLU * up in the epilogue
  (gate_up_proj): a program loads the gate rows of its columns AND the matching up rows,
  so the output is ``[M, I]`` with no ``[M, 2I]`` intermediate and no activation kernel.

So a decode-sized layer (``Qwen3DecoderLayer.forward_decode``) launches 6 kernels, 7 with
attention's split merge: qkv (norm fused), q/k-norm + RoPE + KV write, attention (+ merge),
o_proj + add, gate_up + SiLU * up (norm fused), down + add; the model adds the final norm.

Numerics equal the unfused path's (rms_norm, skinny_linear, the bf16 add, silu_and_mul):
fp32 math, and every value the unfused path writes to a tensor is rounded to the
activation dtype here too (the normed x, the GEMM outputs, SiLU's result) before it is
used. Under the interpreter (fp32) a chain of fused layers equals the unfused chain bit
for bit; on the GPU (bf16) a different tile shape or warp count may reorder a sum, so the
fused path is checked by tolerance there (tests/test_skinny_fused.py; in job V the bf16
Qwen3-0.6B-shaped layers came out bitwise equal at 1 and 2 rows all the same).

Measured (H200, job V/W): 295 -> 211 kernels a decode step at batch 1; GPU time per step
1.036 -> 1.012 ms, TPOT 1.09 -> 1.05 ms. Small: the kernels that went away were short, and
the four products that stayed run at ~40% of the bandwidth.

On Hopper (``mrv2.kernels.pdl``, on by default, ``MRV2_PDL=0`` off) the kernel is launched
with programmatic dependent launch: each program issues the loads of its first weight
tile(s), the norm weight and the bias, then ``gdc_wait`` (the previous kernel has completed),
lets the next kernel launch, and only then reads x / residual. ``PDL=False`` compiles to the
same code as before (Triton 3.6, sm_90: PTX and SASS equal but for line info); PDL=True
costs registers (ptxas, M = 1: qkv 40 -> 62, gate_up 54 -> 66, o/down 40 -> 48).

Since session 15 the three entry points hand 1-2 rows to ``skinny_stream`` (each program
loads its whole weight slice before the PDL wait: TPOT at batch 1 0.89 -> 0.73 ms, the
median of 11 processes); this module's K-stepping kernel remains for 3-8 rows, for
``block_k`` overrides and with ``MRV2_STREAM_GEMV=0``.

Only for <= ``MODEL_MAX_M`` rows on the GPU, where the model's ``linear`` takes
``skinny_linear`` too (``MRV2_FUSED_DECODE=0`` turns it off; tests set ``ENABLED`` to
run it under the interpreter). The torch references below are the specification.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from mrv2.kernels import pdl, skinny_gemm, skinny_stream
from mrv2.kernels.activation import silu_and_mul_ref
from mrv2.kernels.fused_epilogue import _round_product_body, _store_body
from mrv2.kernels.layernorm import rms_norm_ref, row_sum
from mrv2.kernels.pdl import GDC_CALLS
from mrv2.kernels.skinny_gemm import MAX_M, MODEL_MAX_M
from mrv2.platform import TRITON_INTERPRET

#: The model's decode-sized layers run these kernels: on where the skinny GEMM is on
#: (GPU) unless ``MRV2_FUSED_DECODE=0``. Tests set it True to run them in the interpreter.
ENABLED: bool = skinny_gemm.ENABLED and os.environ.get("MRV2_FUSED_DECODE", "1") != "0"


def use_fused_decode(x: torch.Tensor) -> bool:
    """Whether a forward over ``x [T, hidden]`` takes the fused decode path: the
    condition ``skinny_gemm.linear`` uses. Reads only shapes: graph- and sync-safe."""
    return (ENABLED and x.dim() == 2 and x.shape[0] <= MODEL_MAX_M and x.stride(1) == 1
            and (x.is_cuda or TRITON_INTERPRET))


# ------------------------------------------------------------------ torch references

def skinny_norm_linear_ref(x, norm_weight, eps, weight, bias=None):
    """Reference of :func:`skinny_norm_linear`: ``F.linear(rms_norm(x), weight, bias)``."""
    return F.linear(rms_norm_ref(x, norm_weight, eps), weight, bias)


def skinny_linear_add_ref(x, weight, residual, bias=None):
    """Reference of :func:`skinny_linear_add`: ``residual += F.linear(x, weight, bias)``,
    in place (the product is rounded to the dtype before the add, as torch does)."""
    return residual.add_(F.linear(x, weight, bias))


def skinny_norm_gate_up_silu_ref(x, norm_weight, eps, gate_up_weight, bias=None):
    """Reference of :func:`skinny_norm_gate_up_silu`: ``silu(g) * u`` of
    ``[g | u] = F.linear(rms_norm(x), gate_up_weight, bias)``."""
    gate, up = F.linear(rms_norm_ref(x, norm_weight, eps), gate_up_weight, bias).chunk(2, -1)
    return silu_and_mul_ref(gate, up)


# ------------------------------------------------------------------ the kernel

@triton.jit
def _skinny_fused_kernel(
    x_ptr, norm_w_ptr, w_ptr, bias_ptr, residual_ptr,   # inputs: x [M, K], W [N or 2N, K]
    out_ptr,                                            # output [M, N] (may BE residual)
    M, N, K, eps,                                       # sizes (N: output columns)
    stride_xm, stride_wn, stride_rm, stride_om,         # strides (last dims contiguous)
    NORM: tl.constexpr, GATE_UP: tl.constexpr, ADD_RESIDUAL: tl.constexpr,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, PDL: tl.constexpr = False,
):
    # One program: BLOCK_N output columns for all M (<= BLOCK_M) rows.
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)                   # [BN]
    m = tl.arange(0, BLOCK_M)                                                # [BM]
    kk = tl.arange(0, BLOCK_K)                                               # [BK]
    n_mask = n < N
    m_mask = m < M
    dt = out_ptr.dtype.element_ty

    if PDL:
        # Before the wait, only what no earlier kernel writes: the first weight tile(s), the
        # norm weight's first K step, the bias. They are in flight while the wait blocks.
        w_mask0 = n_mask[:, None]                                            # [BN, 1]
        if not EVEN_K:
            w_mask0 = w_mask0 & (kk < K)[None, :]
        w_offs0 = n[:, None].to(tl.int64) * stride_wn + kk[None, :]          # [BN, BK]
        w0 = tl.load(w_ptr + w_offs0, mask=w_mask0, other=0.0)
        if GATE_UP:
            wu0 = tl.load(w_ptr + w_offs0 + N * stride_wn, mask=w_mask0, other=0.0)
        if NORM:
            nw0 = tl.load(norm_w_ptr + kk, mask=kk < K, other=0.0)           # [BK]
        if HAS_BIAS:
            b0 = tl.load(bias_ptr + n, mask=n_mask, other=0.0)               # [BN]
            if GATE_UP:
                bu0 = tl.load(bias_ptr + N + n, mask=n_mask, other=0.0)
        # NOTE: every program waits (no early return), so a later kernel's wait covers this
        # one's predecessors too. Nothing is read from x / residual or written before it.
        if GDC_CALLS:
            gdc_wait()
            # NOTE: launching dependents here is safe (their gdc_wait blocks until this
            # WHOLE grid has completed and its writes are visible) and early enough that the
            # next kernel's launch and first loads overlap this one's weight stream. Not
            # before the wait: then kernel i+2 could launch while kernel i still runs, and a
            # cascade of waiting grids would hold registers and bandwidth.
            gdc_launch_dependents()

    # Prologue: each row's inverse RMS over ALL of K (every program repeats it; x is tiny).
    rstd = tl.full([BLOCK_M], 1.0, tl.float32)                               # [BM]
    if NORM:
        sq = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + kk
            x = tl.load(x_ptr + m[:, None] * stride_xm + k[None, :],
                        mask=m_mask[:, None] & (k < K)[None, :], other=0.0).to(tl.float32)
            sq += x * x
        rstd = tl.math.rsqrt(row_sum(sq, axis=1) / K + eps)                  # [BM]

    # Main loop: stream the weight tile(s) of this program's columns along K.
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)                     # gate (or all)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)                  # up (GATE_UP)
    k_start = 0
    if PDL:  # the first K step with the prefetched tile(s): the loop's body, peeled
        x_mask0 = m_mask[:, None]                                            # [BM, 1]
        if not EVEN_K:
            x_mask0 = x_mask0 & (kk < K)[None, :]
        x = tl.load(x_ptr + m[:, None] * stride_xm + kk[None, :],
                    mask=x_mask0, other=0.0).to(tl.float32)                  # [BM, BK]
        if NORM:
            x = ((x * rstd[:, None]) * nw0.to(tl.float32)[None, :]).to(dt).to(tl.float32)
        acc += row_sum(w0.to(tl.float32)[None, :, :] * x[:, None, :], axis=2)  # [BM, BN]
        if GATE_UP:
            acc_up += row_sum(wu0.to(tl.float32)[None, :, :] * x[:, None, :], axis=2)
        k_start = BLOCK_K
    for k0 in range(k_start, K, BLOCK_K):
        k = k0 + kk
        w_mask = n_mask[:, None]                                             # [BN, 1]
        x_mask = m_mask[:, None]                                             # [BM, 1]
        if not EVEN_K:  # NOTE: a K that BLOCK_K divides needs no mask along K
            w_mask = w_mask & (k < K)[None, :]
            x_mask = x_mask & (k < K)[None, :]
        x = tl.load(x_ptr + m[:, None] * stride_xm + k[None, :],
                    mask=x_mask, other=0.0).to(tl.float32)                   # [BM, BK]
        if NORM:
            nw = tl.load(norm_w_ptr + k, mask=k < K, other=0.0).to(tl.float32)  # [BK]
            # NOTE: rounded to x's dtype, as the unfused rms_norm writes it for the GEMM.
            x = ((x * rstd[:, None]) * nw[None, :]).to(dt).to(tl.float32)
        w_offs = n[:, None].to(tl.int64) * stride_wn + k[None, :]            # [BN, BK]
        w = tl.load(w_ptr + w_offs, mask=w_mask, other=0.0).to(tl.float32)
        acc += row_sum(w[None, :, :] * x[:, None, :], axis=2)                # [BM, BN]
        if GATE_UP:  # the up rows of the same columns: rows N + n of the packed weight
            wu = tl.load(w_ptr + w_offs + N * stride_wn, mask=w_mask, other=0.0)
            acc_up += row_sum(wu.to(tl.float32)[None, :, :] * x[:, None, :], axis=2)

    # Epilogue: bias, then SiLU * up or the residual add, rounding where the unfused
    # path rounds (each GEMM output, SiLU's result, the sum).
    if HAS_BIAS:
        if PDL:
            acc += b0.to(tl.float32)[None, :]
            if GATE_UP:
                acc_up += bu0.to(tl.float32)[None, :]
        else:
            acc += tl.load(bias_ptr + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
            if GATE_UP:
                acc_up += tl.load(bias_ptr + N + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    y = _round_product_body(acc, acc_up, dt, GATE_UP)                       # [BM, BN]
    _store_body(y, out_ptr, residual_ptr, m, n, m_mask[:, None] & n_mask[None, :], stride_rm,
                stride_om, ADD_RESIDUAL)


# ------------------------------------------------------------------ launch

#: Job V's sweep (H200, bf16, Qwen3-0.6B shapes, each kernel alone in a CUDA graph,
#: ``scripts/bench_skinny_fused.py --sweep``): (kind, M) -> (BLOCK_N, num_warps), 1024-wide
#: K steps. The first defaults (4 columns, 4 warps; gate_up 2) took, at M = 1 / 2:
#: norm_qkv 9.3 / 10.4 us, o_add 8.7 / 30.7, gate_up 23.3 / 102.7, down_add 10.2 / 37.3;
#: the best launches 9.1 / 9.6, 8.3 / 8.3, 10.3 / 11.3, 9.5 / 10.7. Two rows want 2 warps.
_TUNED = {("norm", 1): (4, 4), ("add", 1): (4, 4), ("gate_up", 1): (4, 4),
          ("norm", 2): (2, 2), ("add", 2): (2, 2), ("gate_up", 2): (8, 4)}
#: Under PDL (the default on Hopper) the same table: job Y's coordinate descent with the
#: 28-layer PDL GEMM chain as the measure found launches that ran that chain 654 -> 580 us at
#: M = 1, but the model with them (qkv -> RoPE -> attention -> merge -> o_proj between them)
#: lost TPOT at batch 1 in job AA: 0.920 -> 0.943 ms, in one job. Alone-best stays.



def _launch(M: int, N: int, K: int, kind: str) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) for ``kind`` ("norm", "add" or "gate_up": a gate_up
    program streams BLOCK_N gate rows and BLOCK_N up rows) at M rows: ``_TUNED``, else
    skinny_linear's launch."""
    bn, bk, nw = skinny_gemm._launch(M, N, K)
    if TRITON_INTERPRET:  # NOTE: the interpreter pays per program: few wide programs
        return min(triton.next_power_of_2(N), 64), bk, 1
    bn, nw = _TUNED.get((kind, M), (bn, nw))
    return bn, bk, nw


def _check(name, x, weight, bias, n_rows, norm_weight=None, residual=None,
           max_m: int = MAX_M) -> None:
    """Raise ``ValueError`` naming the problem with a fused GEMM's arguments (before work)."""
    skinny_gemm.check_linear_args(name, x, weight, max_m)
    M, K = x.shape
    if K == 0:
        raise ValueError(f"{name} needs K > 0 (got x {tuple(x.shape)})")
    if norm_weight is not None and (norm_weight.shape != (K,) or norm_weight.stride(0) != 1):
        raise ValueError(f"{name}: norm_weight must be a contiguous [K] = [{K}], got "
                         f"{tuple(norm_weight.shape)}")
    if bias is not None and (bias.shape != (n_rows,) or bias.stride(0) != 1):
        raise ValueError(f"{name}: bias must be a contiguous [{n_rows}], got {tuple(bias.shape)}")
    if residual is not None:
        N = weight.shape[0]
        if residual.shape != (M, N) or residual.dtype != x.dtype or residual.stride(1) != 1:
            raise ValueError(f"{name}: residual must be [M, N] = [{M}, {N}] in {x.dtype} with "
                             f"a contiguous last dim, got {tuple(residual.shape)} "
                             f"{residual.dtype}")
        if x.numel() and residual.numel() and \
                residual.untyped_storage().data_ptr() == x.untyped_storage().data_ptr():
            raise ValueError(f"{name}: x must not share memory with residual (the kernel "
                             "reads all of x while it writes residual)")


def _run(x, norm_weight, eps, weight, bias, residual, out, N, *, gate_up, block_n,
         block_k, num_warps):
    M, K = x.shape
    if M == 0 or N == 0:
        return out
    if skinny_stream.ENABLED and block_k is None and skinny_stream.fits(M, K, gate_up):
        return skinny_stream.run(x, norm_weight, eps, weight, bias, residual, out, N,
                                 gate_up=gate_up, block_n=block_n, num_warps=num_warps)
    kind = "gate_up" if gate_up else "add" if residual is not None else "norm"
    use_pdl = pdl.use_pdl(x.device)
    bn, bk, nw = _launch(M, N, K, kind)
    bn, bk, nw = block_n or bn, block_k or bk, num_warps or nw
    opts = {} if TRITON_INTERPRET else {"num_warps": nw}
    opts.update(pdl.launch_kwargs(use_pdl))
    r = residual if residual is not None else out                # unused without the add
    _skinny_fused_kernel[(triton.cdiv(N, bn),)](
        x, norm_weight if norm_weight is not None else x, weight,
        bias if bias is not None else weight, r,
        out,
        M, N, K, float(eps),
        x.stride(0), weight.stride(0), r.stride(0), out.stride(0),
        NORM=norm_weight is not None, GATE_UP=gate_up, ADD_RESIDUAL=residual is not None,
        HAS_BIAS=bias is not None, BLOCK_M=max(1, triton.next_power_of_2(M)), BLOCK_N=bn,
        BLOCK_K=bk, EVEN_K=K % bk == 0, PDL=use_pdl, **opts)
    return out


# ------------------------------------------------------------------ public entry points

def skinny_norm_linear(x: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                       weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                       block_n: int | None = None, block_k: int | None = None,
                       num_warps: int | None = None) -> torch.Tensor:
    """``F.linear(rms_norm(x, norm_weight, eps), weight, bias)`` in one weight stream.

    Args:
        x: ``[M, K]`` the residual stream (M <= MAX_M), last dim contiguous.
        norm_weight: ``[K]`` the RMSNorm scale; eps: added to the mean square.
        weight: ``[N, K]``, last dim contiguous, x's dtype; bias: optional ``[N]``.
        block_n, block_k, num_warps: launch overrides (the sweep's knobs).

    Returns:
        A new ``[M, N]`` tensor in x's dtype.
    """
    _check("skinny_norm_linear", x, weight, bias, weight.shape[0], norm_weight)
    out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    return _run(x, norm_weight, eps, weight, bias, None, out, weight.shape[0], gate_up=False,
                block_n=block_n, block_k=block_k, num_warps=num_warps)


def skinny_linear_add(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor,
                      bias: torch.Tensor | None = None, *, block_n: int | None = None,
                      block_k: int | None = None, num_warps: int | None = None
                      ) -> torch.Tensor:
    """``residual += F.linear(x, weight, bias)``, in place, in one weight stream.

    Args:
        x: ``[M, K]`` (M <= MAX_M), last dim contiguous, not sharing memory with residual.
        weight: ``[N, K]``, last dim contiguous; bias: optional ``[N]``.
        residual: ``[M, N]`` in x's dtype, last dim contiguous: overwritten with the sum.
        block_n, block_k, num_warps: launch overrides.

    Returns:
        ``residual`` itself (the product is rounded to the dtype, then added: as torch).
    """
    _check("skinny_linear_add", x, weight, bias, weight.shape[0], residual=residual)
    return _run(x, None, 0.0, weight, bias, residual, residual, weight.shape[0],
                gate_up=False, block_n=block_n, block_k=block_k, num_warps=num_warps)


def skinny_norm_gate_up_silu(x: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                             gate_up_weight: torch.Tensor, bias: torch.Tensor | None = None,
                             *, block_n: int | None = None, block_k: int | None = None,
                             num_warps: int | None = None) -> torch.Tensor:
    """``silu(g) * u`` of ``[g | u] = F.linear(rms_norm(x), gate_up_weight, bias)``.

    Args:
        x: ``[M, K]`` the residual stream (M <= MAX_M), last dim contiguous.
        norm_weight: ``[K]`` the RMSNorm scale; eps: added to the mean square.
        gate_up_weight: ``[2I, K]`` packed (rows ``0..I-1`` gate_proj, ``I..2I-1``
            up_proj), last dim contiguous; bias: optional ``[2I]`` packed the same way.
        block_n, block_k, num_warps: launch overrides.

    Returns:
        A new ``[M, I]`` tensor in x's dtype (the MLP's activation, down_proj's input).
    """
    if gate_up_weight.dim() == 2 and gate_up_weight.shape[0] % 2:
        raise ValueError(f"skinny_norm_gate_up_silu: gate_up_weight needs an even number of "
                         f"rows [2I, K], got {tuple(gate_up_weight.shape)}")
    _check("skinny_norm_gate_up_silu", x, gate_up_weight, bias, gate_up_weight.shape[0],
           norm_weight)
    inter = gate_up_weight.shape[0] // 2
    out = torch.empty(x.shape[0], inter, dtype=x.dtype, device=x.device)
    return _run(x, norm_weight, eps, gate_up_weight, bias, None, out, inter, gate_up=True,
                block_n=block_n, block_k=block_k, num_warps=num_warps)
