"""The weight-stream lesson on tensor cores: 3 to 32 rows, each program's weights in flight first.

``skinny_stream`` made batch 1's decode GEMMs a weight stream: a program loads its whole
``[BLOCK_N, K]`` slice before the PDL wait, so the bytes are in flight while the kernel
before it ends (the 28-layer chain 652 -> 414 us). It multiplies on CUDA cores, one row at a
time after the wait, which loses from 3 rows on. ``small_m_fused`` multiplies on tensor
cores but walks K in tiles after the wait (only the first tile loaded before it); from 17
rows cuBLAS takes over, and with it the separate norm and SiLU kernels. Here a program:

1. loads its weight slice as up to ``MAX_CHUNKS`` K chunks of ``[BLOCK_K, BLOCK_N]`` (W^T;
   gate and up rows for the MLP), and the bias, before the wait: only activations remain;
2. waits for the previous kernel (PDL), lets the next one launch;
3. takes the rows' inverse RMS over all of K (the norm kinds), then per chunk loads the
   ``[BLOCK_M, BLOCK_K]`` activation tile from L2, norms and rounds it, and ``tl.dot``-s it
   with the resident chunk; the epilogue (SiLU * up or the residual add) as the others.

All rows of the step are in one program (``BLOCK_M`` = 16 or 32, tl.dot's minimum of 16
padded with masked rows), so the grid is one program per ``BLOCK_N`` columns. Roundings are
``skinny_fused``'s (the normed x, each product, SiLU's result rounded to the activation
dtype); fp32 runs the products in IEEE fp32. ``ENABLED`` routes ``small_m_fused``'s entry
points here when ``fits`` (and no launch override asks for the K-stepping kernel).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from mrv2.kernels import pdl
from mrv2.kernels.fused_epilogue import _round_product_body, _store_body
from mrv2.kernels.layernorm import row_sum
from mrv2.kernels.pdl import GDC_CALLS
from mrv2.platform import TRITON_INTERPRET, env_switch, interpreter_body

#: Route ``small_m_fused``'s entry points here: on a GPU unless ``MRV2_SMALL_M_STREAM=0``
#: (read at every launch, so a bench may set it). Tests set it to run the interpreter.
ENABLED: bool = not TRITON_INTERPRET and env_switch("MRV2_SMALL_M_STREAM", True)
#: The most rows a launch takes (all in one program: the x tile is BLOCK_M x BLOCK_K).
MAX_M = 32
#: The most K chunks a program holds (one tensor each, written out in the kernel).
MAX_CHUNKS = 4
#: The widest K chunk: a [32, 1024] bf16 x tile is already 64 KB of registers a program.
MAX_BLOCK_K = 1024
#: The most weights a program holds (chunks x BLOCK_K x BLOCK_N, gate and up counted) and a
#: thread (skinny_stream's measured cap: beyond ~128 the registers spill).
MAX_WEIGHTS = 65536
MAX_WEIGHTS_PER_THREAD = 128
#: ``"kind/BLOCK_M"`` (kind: ``norm``, ``add``, ``gate_up``) -> ``[BLOCK_N, num_warps]``
#: where a measurement chose another launch than ``default_launch`` (JSON-shaped, so
#: ``scripts/bench_with.py --set`` can try one in the model).
TUNED: dict[str, list[int]] = {}


def block_k(K: int) -> int:
    """The K chunk: the whole (power-of-two padded) K up to ``MAX_BLOCK_K``, wider only when
    ``MAX_CHUNKS`` chunks of it would not cover K."""
    bk = min(triton.next_power_of_2(K), MAX_BLOCK_K)
    return max(bk, triton.next_power_of_2(triton.cdiv(K, MAX_CHUNKS)))


def _per_column(K: int, gate_up: bool) -> int:
    """Weights a program holds per output column: its chunks, twice for gate and up."""
    bk = block_k(K)
    return triton.cdiv(K, bk) * bk * (2 if gate_up else 1)


def fits(M: int, K: int, gate_up: bool) -> bool:
    """Whether ``M`` rows over ``K`` fit one launch: at most ``MAX_M`` rows, a K chunk of at
    most ``MAX_BLOCK_K`` and 16 columns (tl.dot's minimum) within ``MAX_WEIGHTS``."""
    return (1 <= M <= MAX_M and block_k(K) <= MAX_BLOCK_K
            and 16 * _per_column(K, gate_up) <= MAX_WEIGHTS)


def default_launch(K: int, gate_up: bool) -> tuple[int, int]:
    """(BLOCK_N, num_warps): 16 columns (the most programs), 8 warps, 16 when the slice
    would pass ``MAX_WEIGHTS_PER_THREAD`` a thread at 8."""
    weights = 16 * _per_column(K, gate_up)
    return 16, 8 if weights <= MAX_WEIGHTS_PER_THREAD * 32 * 8 else 16


@triton.jit
def _dot(acc, x, w, IEEE: tl.constexpr):
    if IEEE:  # fp32 inputs: exact fp32 products, as F.linear (no TF32)
        return tl.dot(x, w, acc, input_precision="ieee")
    return tl.dot(x, w, acc)


@triton.jit
def _w_chunk(w_ptr, n, n_ok, k0, K, kk, stride_wn, up_off, GATE_UP: tl.constexpr):
    # The [BK, BN] W^T chunk at k0 (past K or N: 0) and, for gate_up, the up rows' chunk.
    offs = n[None, :].to(tl.int64) * stride_wn + (k0 + kk)[:, None]             # [BK, BN]
    mask = (k0 + kk < K)[:, None] & n_ok[None, :]
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    wu = w
    if GATE_UP:  # the up rows of the same columns: rows N + n of the packed weight
        wu = tl.load(w_ptr + offs + up_off, mask=mask, other=0.0)
    return w, wu


@triton.jit
def _x_chunk(x_ptr, norm_w_ptr, rstd, m, m_ok, k0, K, kk, stride_xm, NORM: tl.constexpr):
    # The [BM, BK] activation tile at k0 (rows past M, columns past K: 0), normed and
    # rounded to x's dtype as the unfused rms_norm writes it for the GEMM.
    k_ok = k0 + kk < K
    x = tl.load(x_ptr + m[:, None].to(tl.int64) * stride_xm + (k0 + kk)[None, :],
                mask=m_ok[:, None] & k_ok[None, :], other=0.0)                  # [BM, BK]
    if NORM:
        nw = tl.load(norm_w_ptr + k0 + kk, mask=k_ok, other=0.0).to(tl.float32)
        x = ((x.to(tl.float32) * rstd[:, None]) * nw[None, :]).to(x.dtype)
    return x


@triton.jit
def _chunk_dot(acc, acc_up, w, wu, x_ptr, norm_w_ptr, rstd, m, m_ok, k0, K, kk, stride_xm,
               NORM: tl.constexpr, GATE_UP: tl.constexpr, IEEE: tl.constexpr):
    # acc (and acc_up) += the chunk at k0: x tile [BM, BK] x resident W^T chunk [BK, BN].
    x = _x_chunk_body(x_ptr, norm_w_ptr, rstd, m, m_ok, k0, K, kk, stride_xm, NORM)
    acc = _dot_body(acc, x, w, IEEE)                                         # [BM, BN]
    if GATE_UP:
        acc_up = _dot_body(acc_up, x, wu, IEEE)
    return acc, acc_up


# NOTE: the interpreter re-patches triton.language at every jit-helper call: plain bodies.
_dot_body = interpreter_body(_dot)
_w_chunk_body = interpreter_body(_w_chunk)
_x_chunk_body = interpreter_body(_x_chunk)
_chunk_dot_body = interpreter_body(_chunk_dot)


@triton.jit(do_not_specialize=["M"])
def _small_m_stream_kernel(
    x_ptr, norm_w_ptr, w_ptr, bias_ptr, residual_ptr,   # inputs: x [M, K], W [N or 2N, K]
    out_ptr,                                            # output [M, N] (may BE residual)
    M, N, K, eps,                                       # sizes (N: output columns)
    stride_xm, stride_wn, stride_rm, stride_om,         # strides (last dims contiguous)
    NORM: tl.constexpr, GATE_UP: tl.constexpr, ADD_RESIDUAL: tl.constexpr,
    HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_CHUNKS: tl.constexpr,
    PDL: tl.constexpr,
):
    # One program: BLOCK_N output columns for all M rows, K in NUM_CHUNKS chunks of BLOCK_K.
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)                   # [BN]
    m = tl.arange(0, BLOCK_M)                                                # [BM]
    kk = tl.arange(0, BLOCK_K)                                               # [BK]
    n_ok = n < N
    m_ok = m < M
    dt = out_ptr.dtype.element_ty
    up_off = N * stride_wn                                                   # gate -> up rows

    # 1. Every weight chunk and the bias: nothing an earlier kernel writes. NOTE: written
    # out, one tensor a chunk (a loop could not keep them all live past the wait).
    w0, u0 = _w_chunk_body(w_ptr, n, n_ok, 0, K, kk, stride_wn, up_off, GATE_UP)
    w1, u1 = w0, u0
    w2, u2 = w0, u0
    w3, u3 = w0, u0
    if NUM_CHUNKS > 1:
        w1, u1 = _w_chunk_body(w_ptr, n, n_ok, BLOCK_K, K, kk, stride_wn, up_off, GATE_UP)
    if NUM_CHUNKS > 2:
        w2, u2 = _w_chunk_body(w_ptr, n, n_ok, 2 * BLOCK_K, K, kk, stride_wn, up_off, GATE_UP)
    if NUM_CHUNKS > 3:
        w3, u3 = _w_chunk_body(w_ptr, n, n_ok, 3 * BLOCK_K, K, kk, stride_wn, up_off, GATE_UP)
    b = tl.zeros([BLOCK_N], dtype=tl.float32)
    bu = b
    if HAS_BIAS:
        b = tl.load(bias_ptr + n, mask=n_ok, other=0.0).to(tl.float32)       # [BN]
        if GATE_UP:
            bu = tl.load(bias_ptr + N + n, mask=n_ok, other=0.0).to(tl.float32)

    # 2. The previous kernel has completed (x, the residual are its outputs). NOTE: every
    # program waits, no early return (the contract of mrv2/kernels/pdl.py).
    if PDL and GDC_CALLS:
        gdc_wait()
        gdc_launch_dependents()

    # 3. The rows' inverse RMS over all of K, then the chunks through tensor cores.
    rstd = tl.full([BLOCK_M], 1.0, tl.float32)                               # [BM]
    if NORM:
        ss = tl.zeros([BLOCK_M], dtype=tl.float32)
        for c in tl.static_range(NUM_CHUNKS):
            k = c * BLOCK_K + kk                                             # [BK]
            xs = tl.load(x_ptr + m[:, None].to(tl.int64) * stride_xm + k[None, :],
                         mask=m_ok[:, None] & (k < K)[None, :], other=0.0).to(tl.float32)
            ss += row_sum(xs * xs, axis=1)
        rstd = tl.math.rsqrt(ss / K + eps)                                   # [BM]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)                     # gate (or all)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)                  # up (GATE_UP)
    acc, acc_up = _chunk_dot_body(acc, acc_up, w0, u0, x_ptr, norm_w_ptr, rstd, m, m_ok, 0,
                                  K, kk, stride_xm, NORM, GATE_UP, IEEE)
    if NUM_CHUNKS > 1:
        acc, acc_up = _chunk_dot_body(acc, acc_up, w1, u1, x_ptr, norm_w_ptr, rstd, m, m_ok,
                                      BLOCK_K, K, kk, stride_xm, NORM, GATE_UP, IEEE)
    if NUM_CHUNKS > 2:
        acc, acc_up = _chunk_dot_body(acc, acc_up, w2, u2, x_ptr, norm_w_ptr, rstd, m, m_ok,
                                      2 * BLOCK_K, K, kk, stride_xm, NORM, GATE_UP, IEEE)
    if NUM_CHUNKS > 3:
        acc, acc_up = _chunk_dot_body(acc, acc_up, w3, u3, x_ptr, norm_w_ptr, rstd, m, m_ok,
                                      3 * BLOCK_K, K, kk, stride_xm, NORM, GATE_UP, IEEE)

    # 4. Epilogue: bias, then SiLU * up or the residual add, rounding as the unfused path.
    acc += b[None, :]
    if GATE_UP:
        acc_up += bu[None, :]
    y = _round_product_body(acc, acc_up, dt, GATE_UP)                        # [BM, BN]
    _store_body(y, out_ptr, residual_ptr, m, n, m_ok[:, None] & n_ok[None, :], stride_rm,
                stride_om, ADD_RESIDUAL)


def pick_launch(M: int, N: int, K: int, kind: str, block_n: int | None = None,
                num_warps: int | None = None) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) of a launch: the overrides, else ``TUNED["kind/BLOCK_M"]``,
    else ``default_launch``.

    Args:
        M, N, K: rows, output columns, reduction length; kind: ``norm``, ``add`` or
            ``gate_up``; block_n, num_warps: overrides.
    """
    bm = max(16, triton.next_power_of_2(M))
    bn, nw = TUNED.get(f"{kind}/{bm}", default_launch(K, kind == "gate_up"))
    if TRITON_INTERPRET:  # NOTE: the interpreter pays per program: few wide programs
        bn = max(bn, min(64, triton.next_power_of_2(N)))
    return bm, block_n or bn, num_warps or nw


def run(x: torch.Tensor, norm_weight: torch.Tensor | None, eps: float, weight: torch.Tensor,
        bias: torch.Tensor | None, residual: torch.Tensor | None, out: torch.Tensor, N: int,
        *, gate_up: bool, block_n: int | None = None, num_warps: int | None = None
        ) -> torch.Tensor:
    """Launch the kernel for ``small_m_fused``'s three entry points (arguments checked
    there): ``out = x @ W.T`` with the norm prologue (``norm_weight``), the SiLU * up
    epilogue (``gate_up``: W packed ``[2N, K]``) or ``out = residual + x @ W.T``.

    Args:
        x: ``[M, K]`` with ``fits(M, K, gate_up)``; weight ``[N or 2N, K]``; out ``[M, N]``.
        block_n, num_warps: launch overrides (else ``TUNED``, else ``default_launch``).

    Returns:
        ``out``.
    """
    M, K = x.shape
    if M == 0 or N == 0:
        return out
    kind = "gate_up" if gate_up else "add" if residual is not None else "norm"
    bm, bn, nw = pick_launch(M, N, K, kind, block_n, num_warps)
    bk = block_k(K)
    use_pdl = pdl.use_pdl(x.device)
    opts = {} if TRITON_INTERPRET else {"num_warps": nw}
    opts.update(pdl.launch_kwargs(use_pdl))
    r = residual if residual is not None else out                # unused without the add
    _small_m_stream_kernel[(triton.cdiv(N, bn),)](
        x, norm_weight if norm_weight is not None else x, weight,
        bias if bias is not None else weight, r, out,
        M, N, K, float(eps),
        x.stride(0), weight.stride(0), r.stride(0), out.stride(0),
        NORM=norm_weight is not None, GATE_UP=gate_up, ADD_RESIDUAL=residual is not None,
        HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32, BLOCK_M=bm, BLOCK_N=bn,
        BLOCK_K=bk, NUM_CHUNKS=triton.cdiv(K, bk), PDL=use_pdl, **opts)
    return out
