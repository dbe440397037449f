"""The decode layer's fused GEMMs for 3 to 256 rows, on tensor cores (``small_m_gemm``'s stream).

``skinny_fused`` runs a decode layer as four weight streams with RMSNorm, the residual adds
and SiLU * up folded in, but only for 1-2 rows: it multiplies on CUDA cores, re-reading each
weight tile once per row from registers, which loses from 4 rows on. From 3 rows the model
falls back to cuBLAS, and with it to the kernels around the products: at batch 32 (H200, job
Y) 57 ``_rms_norm_kernel`` and 28 ``_silu_and_mul_kernel`` launches a step (0.13 ms), and
products that programmatic dependent launch cannot overlap (cuBLAS is launched without the
attribute). This module is the same three fused entry points on ``small_m_gemm``'s
tensor-core stream (``tl.dot`` on ``[BLOCK_M, BLOCK_K] x [BLOCK_K, BLOCK_N]``, M padded to
tl.dot's 16 rows, no split-K):

* ``small_m_norm_linear``: RMSNorm in the prologue (each program takes its rows' inverse RMS
  over all of K first; x is at most 64 x hidden);
* ``small_m_linear_add``: ``residual += x @ W.T`` in the epilogue, in place;
* ``small_m_norm_gate_up_silu``: RMSNorm in the prologue, a program streams its gate rows
  AND the matching up rows into two accumulators, SiLU * up in the epilogue.

``SPLIT_K`` (opt-in, ``MRV2_SMALL_M_SPLIT_K=1``; measured slower, job 18A): each tile's K cut into ranges,
one program each; ``mrv2.kernels.split_k`` says why and holds the host side.

Numerics are the unfused path's, as in ``skinny_fused``: fp32 accumulation, and every value
the unfused path writes (the normed x, each product, SiLU's result) rounded to the
activation dtype before use. The torch references are ``skinny_fused``'s. With PDL (Hopper,
``mrv2.kernels.pdl``) a program loads its first weight tile(s) before ``gdc_wait``.

On by default since job AB (session 7, H200, Qwen3-0.6B shape, ``bench latency``, one job),
for ``MODEL_MIN_M``-``MODEL_MAX_M`` = 3-16 rows; ``MRV2_SMALL_M_FUSED=0`` turns it off. TPOT
with it off / on:

=====  ========  ========
batch  off (ms)  on (ms)
=====  ========  ========
4      1.311     1.145
8      1.293     1.211
16     1.412     1.201
32     1.502     1.642
=====  ========  ========

At 32 rows it loses (the 28-layer GEMM chain, ``scripts/bench_skinny_fused.py --rows``: 1,013
us with PDL against cuBLAS's 873; at 4 and 8 rows 732 and 718 against 951 and 838), so from 17
rows the model keeps cuBLAS. The kernel itself takes up to ``MAX_M`` = 256 rows (blocks of at
most 64), and loses more the more rows it gets (job 18A, with PDL: 995 / 1,008 / 1,247 /
1,670 / 1,985 us at 24 / 32 / 64 / 128 / 256 rows against cuBLAS's 871 / 872 / 898 / 939 /
1,009), so the fused layers stay a small-batch path.

NOTE: ``skinny_stream``'s lesson (each program's whole weight slice loaded before the PDL
wait) lost here (session 16, commit 131a7ef, reverted): a kernel holding its W^T slice as up
to four ``[1024, BLOCK_N]`` register chunks, all rows in one ``tl.dot`` program, took the
28-layer chain (PDL) to 1,259 / 1,270 / 1,295 / 1,447 us at 4 / 8 / 16 / 32 rows against this
kernel's 702 / 715 / 731 / 1,005 and cuBLAS's 1,033 / 839 / 855 / 871; TPOT at batch 4 1.01 ->
1.50 ms (job 16B, ``*_job16B-131a7ef.json``). Triton converts each register-resident chunk
to the MMA operand layout through shared memory after the wait (wider launches ran out of
it), and the x tiles compete for the same registers. Resident weights on tensor cores need
them in shared memory from the start (TMA or cp.async issued before the wait), which plain
``tl.load`` does not express.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from mrv2.kernels import pdl, skinny_fused, small_m_resident, small_m_staged
from mrv2.kernels.fused_epilogue import _round_product_body, _store_body
from mrv2.kernels.layernorm import row_sum
from mrv2.kernels.pdl import GDC_CALLS
from mrv2.kernels.small_m_gemm import MAX_M as _SMALL_M_MAX
from mrv2.kernels.small_m_gemm import _launch as _small_m_launch
from mrv2.kernels.split_k import split_buffers as _split_buffers
from mrv2.kernels.split_k import split_k_for, split_launch
from mrv2.platform import TRITON_INTERPRET, env_switch, interpreter_body

#: The most rows a call takes (row blocks of at most 64: ``small_m_gemm._launch``).
MAX_M = 256
#: The launch beyond ``small_m_gemm``'s 64 rows (its planner streams one column block of W
#: per SM): square 64 x 64 tiles, wgmma-sized, three of them an SM (64 KB of stages each).
#: Measured once (job 18A, the chain above): about 2x cuBLAS at 128-256 rows; not tuned.
LARGE_M_LAUNCH = {"block_m": 64, "block_n": 64, "block_k": 64, "num_warps": 4,
                  "num_stages": 4}
#: The rows the model's decode path sends here (from skinny_fused's last row + 1).
MODEL_MIN_M = skinny_fused.MODEL_MAX_M + 1
#: The most rows the model sends here: at 32 cuBLAS wins (job AB, above); where
#: ``small_m_resident.takes`` the rows (bf16 / fp16 on the GPU), up to its ``MODEL_MAX_M``.
MODEL_MAX_M = 16
#: On a GPU unless ``MRV2_SMALL_M_FUSED=0``; never under the interpreter (tests set it True).
ENABLED: bool = (not TRITON_INTERPRET and torch.cuda.is_available()
                 and env_switch("MRV2_SMALL_M_FUSED", True))


#: Split K over several programs per output tile (``split_k_for``): OFF, measured slower
#: (H200, job 18A, ``*_job18A-*.json``). The launch grid is 64 (o_proj, down: N = 1024 at
#: block_n 16) to 192 programs on 132 SMs; split, 192-256. The 28-layer chain with PDL took
#: 832 / 846 / 862 us at 4 / 8 / 16 rows against 732 / 715 / 729 unsplit, and TPOT over fresh
#: processes 1.17 / 1.22 ms at 4 / 8 requests against 1.02 / 1.08: more programs streaming
#: did not pay for the partials' round trip and the last program's pass (session 9's folded
#: split merge lost the same way). ``MRV2_SMALL_M_SPLIT_K=1`` turns it on.
SPLIT_K: bool = env_switch("MRV2_SMALL_M_SPLIT_K", False)


def use_small_m_fused(x: torch.Tensor) -> bool:
    """Whether a forward over ``x [T, hidden]`` takes this path (shapes, dtype, device only:
    graph-safe): 3-16 rows, and up to ``small_m_resident.MODEL_MAX_M`` where the resident
    kernel takes them."""
    if not (ENABLED and x.dim() == 2 and x.stride(1) == 1 and (x.is_cuda or TRITON_INTERPRET)):
        return False
    rows = x.shape[0]
    return MODEL_MIN_M <= rows and (rows <= MODEL_MAX_M or (
        rows <= small_m_resident.MODEL_MAX_M and small_m_resident.takes(x)))


@triton.jit
def _dot(acc, x, w, IEEE: tl.constexpr):
    if IEEE:  # fp32 inputs: exact fp32 products, as F.linear (no TF32)
        return tl.dot(x, w, acc, input_precision="ieee")
    return tl.dot(x, w, acc)


@triton.jit
def _x_tile(x_ptrs, norm_w_ptr, rstd, k0, K, m_mask, kk, NORM: tl.constexpr,
            EVEN_K: tl.constexpr):
    # The [BM, BK] activation tile at k0 (rows past M and columns past K read as 0), normed.
    if EVEN_K:
        x = tl.load(x_ptrs + k0, mask=m_mask[:, None], other=0.0)
    else:
        x = tl.load(x_ptrs + k0, mask=m_mask[:, None] & (k0 + kk < K)[None, :], other=0.0)
    if NORM:
        nw = tl.load(norm_w_ptr + k0 + kk, mask=k0 + kk < K, other=0.0).to(tl.float32)
        # NOTE: rounded to x's dtype, as the unfused rms_norm writes it for the GEMM.
        x = ((x.to(tl.float32) * rstd[:, None]) * nw[None, :]).to(x.dtype)
    return x


@triton.jit
def _w_tiles(w_ptrs, k0, K, kk, up_off, GATE_UP: tl.constexpr, EVEN_K: tl.constexpr):
    # The [BK, BN] W^T tile at k0 and, for gate_up, the up rows' tile (else the same tile).
    if EVEN_K:
        w = tl.load(w_ptrs + k0)
    else:
        w = tl.load(w_ptrs + k0, mask=(k0 + kk < K)[:, None], other=0.0)
    wu = w
    if GATE_UP:  # the up rows of the same columns: rows N + n of the packed weight
        wu = tl.load(w_ptrs + k0 + up_off, mask=(k0 + kk < K)[:, None], other=0.0)
    return w, wu


@triton.jit
def _epilogue(acc, acc_up, bias_ptr, residual_ptr, out_ptr, m, n, m_mask, N, stride_rm,
              stride_om, GATE_UP: tl.constexpr, ADD_RESIDUAL: tl.constexpr,
              HAS_BIAS: tl.constexpr):
    # Bias, then SiLU * up or the residual add, rounding where the unfused path does.
    n_mask = n < N
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        if GATE_UP:
            acc_up += tl.load(bias_ptr + N + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    y = _round_product_body(acc, acc_up, out_ptr.dtype.element_ty, GATE_UP)  # [BM, BN]
    _store_body(y, out_ptr, residual_ptr, m, n, m_mask[:, None] & n_mask[None, :], stride_rm,
                stride_om, ADD_RESIDUAL)


# NOTE: under the interpreter every call of a @triton.jit helper re-patches
# triton.language (~1.6 ms a call); the kernel calls the helpers' plain Python bodies there.
_dot_body = interpreter_body(_dot)
_x_tile_body = interpreter_body(_x_tile)
_w_tiles_body = interpreter_body(_w_tiles)
_epilogue_body = interpreter_body(_epilogue)


@triton.jit(do_not_specialize=["M"])
def _small_m_fused_kernel(
    x_ptr, norm_w_ptr, w_ptr, bias_ptr, residual_ptr,   # inputs: x [M, K], W [N or 2N, K]
    out_ptr,                                            # output [M, N] (may BE residual)
    part_ptr, count_ptr,                                # split-K: fp32 partials, tile counters
    M, N, K, k_per, eps,                                # sizes (N: output columns; k_per:
                                                        # the K range of one split)
    stride_xm, stride_wn, stride_rm, stride_om,         # strides (last dims contiguous)
    NORM: tl.constexpr, GATE_UP: tl.constexpr, ADD_RESIDUAL: tl.constexpr,
    HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    SPLIT_K: tl.constexpr = 1, PDL: tl.constexpr = False,
):
    # One program: BLOCK_N output columns x BLOCK_M rows x one K range of k_per;
    # grid (column blocks, row blocks, SPLIT_K).
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)                   # [BN]
    m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)                   # [BM]
    # This program's K range; unsplit, the constant 0..K (as before the split existed: the
    # compiler folds the peeled first step's offsets into constants).
    if SPLIT_K == 1:
        k_lo = 0
        k_end = K
    else:
        k_lo = tl.program_id(2) * k_per
        k_end = k_lo + k_per
    kk = tl.arange(0, BLOCK_K)                                               # [BK]
    m_mask = m < M
    # NOTE: the last column block wraps onto real rows of W (n % N): unmasked weight loads.
    w_ptrs = w_ptr + (n % N)[None, :].to(tl.int64) * stride_wn + kk[:, None]  # [BK, BN]: W^T
    x_ptrs = x_ptr + m[:, None].to(tl.int64) * stride_xm + kk[None, :]      # [BM, BK]

    up_off = N * stride_wn                                                   # gate -> up rows
    if PDL:
        # Before the wait, only weights (no earlier kernel writes them): the first tile(s).
        w0, wu0 = _w_tiles_body(w_ptrs, k_lo, K, kk, up_off, GATE_UP, EVEN_K)
        if GDC_CALLS:  # NOTE: every program waits; the contract of mrv2/kernels/pdl.py
            gdc_wait()
            gdc_launch_dependents()

    # Prologue: each row's inverse RMS over ALL of K (every program repeats it; x is small).
    rstd = tl.full([BLOCK_M], 1.0, tl.float32)                               # [BM]
    if NORM:
        # NOTE: summed per K step into [BM] (skinny_fused keeps [BM, BK]: here that tile
        # would hold 64 registers a thread at 32 rows).
        ss = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            xs = tl.load(x_ptrs + k0, mask=m_mask[:, None] & (k0 + kk < K)[None, :],
                         other=0.0).to(tl.float32)
            ss += row_sum(xs * xs, axis=1)
        rstd = tl.math.rsqrt(ss / K + eps)                                   # [BM]

    # Main loop: the weight tile(s) of this program's columns along K, through tensor cores.
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)                     # gate (or all)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)                  # up (GATE_UP)
    k_start = k_lo
    if PDL:  # the first K step with the prefetched tile(s): the loop's body, peeled
        x = _x_tile_body(x_ptrs, norm_w_ptr, rstd, k_lo, K, m_mask, kk, NORM, EVEN_K)
        acc = _dot_body(acc, x, w0, IEEE)
        if GATE_UP:
            acc_up = _dot_body(acc_up, x, wu0, IEEE)
        k_start = k_lo + BLOCK_K
    for k0 in range(k_start, k_end, BLOCK_K):
        x = _x_tile_body(x_ptrs, norm_w_ptr, rstd, k0, K, m_mask, kk, NORM, EVEN_K)
        w, wu = _w_tiles_body(w_ptrs, k0, K, kk, up_off, GATE_UP, EVEN_K)
        acc = _dot_body(acc, x, w, IEEE)                                     # [BM, BN]
        if GATE_UP:
            acc_up = _dot_body(acc_up, x, wu, IEEE)

    if SPLIT_K == 1:
        _epilogue_body(acc, acc_up, bias_ptr, residual_ptr, out_ptr, m, n, m_mask, N,
                       stride_rm, stride_om, GATE_UP, ADD_RESIDUAL, HAS_BIAS)
    else:
        # Split-K: park this split's fp32 product(s) in the tile's slot of the partials
        # [SPLIT_K, 2, M_pad, N_pad], then count the split in; the tile's LAST program to
        # arrive (any split) sums the partials in split order 0, 1, ... (the same sum on
        # every run, whatever the arrival order) and runs the epilogue.
        n_pad = tl.num_programs(0) * BLOCK_N
        plane = tl.num_programs(1) * BLOCK_M * n_pad                         # one [M_pad, N_pad]
        slot = part_ptr + m[:, None] * n_pad + n[None, :]                    # [BM, BN] ptrs
        tl.store(slot + (2 * tl.program_id(2)) * plane, acc)
        if GATE_UP:
            tl.store(slot + (2 * tl.program_id(2) + 1) * plane, acc_up)
        # NOTE: the barrier puts every thread's stores before the counter's release (one
        # thread does the atomic); the last program's loads bypass L1 (.cg).
        tl.debug_barrier()
        tile = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
        arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            tl.debug_barrier()
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for s in range(SPLIT_K):
                acc += tl.load(slot + (2 * s) * plane, cache_modifier=".cg")
                if GATE_UP:
                    acc_up += tl.load(slot + (2 * s + 1) * plane, cache_modifier=".cg")
            tl.store(count_ptr + tile, 0)        # ready for the next launch (and replay)
            _epilogue_body(acc, acc_up, bias_ptr, residual_ptr, out_ptr, m, n, m_mask, N,
                           stride_rm, stride_om, GATE_UP, ADD_RESIDUAL, HAS_BIAS)


def _run(name, x, norm_weight, eps, weight, bias, residual, out, N, *, gate_up, config):
    if weight.dtype != x.dtype or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"{name} takes fp32, bf16 or fp16 x and a weight of x's dtype, got "
                         f"{x.dtype} and {weight.dtype}")
    M, K = x.shape
    if M == 0 or N == 0:
        return out
    if small_m_resident.ENABLED and config is None and small_m_resident.fits(x, weight, K):
        # the weights staged in shared memory instead of registers (MRV2_STAGED_GEMM=0: off)
        staged = (small_m_staged.takes(x)
                  and small_m_staged.fits(x, K, small_m_staged.kind_of(gate_up, residual)))
        resident = small_m_staged if staged else small_m_resident
        return resident.run(x, norm_weight, eps, weight, bias, residual, out, N,
                            gate_up=gate_up)
    cfg = (_small_m_launch(M, N, K, x.element_size()) if M <= _SMALL_M_MAX
           else dict(LARGE_M_LAUNCH))
    if gate_up:  # NOTE: two weight tiles in flight per stage: one stage less
        cfg["num_stages"] = max(2, cfg["num_stages"] - 1)
    cfg.update(config or {})
    grid_n, grid_m = triton.cdiv(N, cfg["block_n"]), triton.cdiv(M, cfg["block_m"])
    split = cfg.get("split_k")
    if split is None:
        split = split_k_for(grid_n * grid_m, K) if SPLIT_K else 1
        if split > 1:
            cfg = {**split_launch(cfg, grid_n * grid_m * split, K // split,
                                  x.element_size(), 2 if gate_up else 1), **(config or {})}
    if split not in (1, 2, 4, 8) or (split > 1 and K % (split * cfg["block_k"])):
        raise ValueError(f"{name}: split_k must be 1, 2, 4 or 8 with split_k x block_k "
                         f"dividing K = {K}, got split_k={split!r}, block_k={cfg['block_k']}")
    bm, bn, bk = cfg["block_m"], cfg["block_n"], cfg["block_k"]
    # NOTE: PDL only when BLOCK_K divides K (every model shape). Job D (H200, fp32, M = 5,
    # N = 64) hit "misaligned address" with PDL on, K = 296 and 300, block 32 x 32 x 32, in
    # norm_linear and linear_add alike; PDL off, or block_k 64/128, ran clean. Not understood.
    even_k = K % bk == 0
    parts = counts = x                                           # unused without a split
    if split > 1:
        buffers = _split_buffers(x.device, split * 2 * grid_m * bm * grid_n * bn,
                                 grid_n * grid_m)
        if buffers is None:   # a capture found no room: the unsplit kernel, same result
            split = 1
        else:
            parts, counts = buffers
    use_pdl = pdl.use_pdl(x.device) and even_k
    opts = ({} if TRITON_INTERPRET else
            {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]})
    opts.update(pdl.launch_kwargs(use_pdl))
    r = residual if residual is not None else out                # unused without the add
    _small_m_fused_kernel[(grid_n, grid_m, split)](
        x, norm_weight if norm_weight is not None else x, weight,
        bias if bias is not None else weight, r, out, parts, counts,
        M, N, K, K // split, float(eps),
        x.stride(0), weight.stride(0), r.stride(0), out.stride(0),
        NORM=norm_weight is not None, GATE_UP=gate_up, ADD_RESIDUAL=residual is not None,
        HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32, BLOCK_M=bm, BLOCK_N=bn,
        BLOCK_K=bk, EVEN_K=even_k, SPLIT_K=split, PDL=use_pdl, **opts)
    return out


def small_m_norm_linear(x: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                        weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                        config: dict | None = None) -> torch.Tensor:
    """``F.linear(rms_norm(x, norm_weight, eps), weight, bias)`` for <= 256 rows.

    Args:
        x: ``[M, K]`` the residual stream (M <= 256), last dim contiguous.
        norm_weight: ``[K]`` the RMSNorm scale; eps: added to the mean square.
        weight: ``[N, K]``, last dim contiguous, x's dtype; bias: optional ``[N]``.
        config: launch overrides (``block_m``, ``block_n``, ``block_k``, ``num_warps``,
            ``num_stages``; the GPU sweep's knobs).

    Returns:
        A new ``[M, N]`` tensor in x's dtype.
    """
    skinny_fused._check("small_m_norm_linear", x, weight, bias, weight.shape[0], norm_weight,
                        max_m=MAX_M)
    out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    return _run("small_m_norm_linear", x, norm_weight, eps, weight, bias, None, out,
                weight.shape[0], gate_up=False, config=config)


def small_m_linear_add(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor,
                       bias: torch.Tensor | None = None, *, config: dict | None = None
                       ) -> torch.Tensor:
    """``residual += F.linear(x, weight, bias)``, in place, for <= 256 rows.

    Args:
        x: ``[M, K]`` (M <= 256), last dim contiguous, not sharing memory with residual.
        weight: ``[N, K]``, last dim contiguous; bias: optional ``[N]``.
        residual: ``[M, N]`` in x's dtype, last dim contiguous: overwritten with the sum.
        config: launch overrides.

    Returns:
        ``residual`` itself (the product is rounded to the dtype, then added: as torch).
    """
    skinny_fused._check("small_m_linear_add", x, weight, bias, weight.shape[0],
                        residual=residual, max_m=MAX_M)
    return _run("small_m_linear_add", x, None, 0.0, weight, bias, residual, residual,
                weight.shape[0], gate_up=False, config=config)


def small_m_norm_gate_up_silu(x: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                              gate_up_weight: torch.Tensor, bias: torch.Tensor | None = None,
                              *, config: dict | None = None) -> torch.Tensor:
    """``silu(g) * u`` of ``[g | u] = F.linear(rms_norm(x), gate_up_weight, bias)``, <= 256 rows.

    Args:
        x: ``[M, K]`` the residual stream (M <= 256), last dim contiguous.
        norm_weight: ``[K]`` the RMSNorm scale; eps: added to the mean square.
        gate_up_weight: ``[2I, K]`` packed (rows ``0..I-1`` gate_proj, ``I..2I-1`` up_proj);
            bias: optional ``[2I]`` packed the same way.
        config: launch overrides.

    Returns:
        A new ``[M, I]`` tensor in x's dtype (the MLP's activation, down_proj's input).
    """
    if gate_up_weight.dim() == 2 and gate_up_weight.shape[0] % 2:
        raise ValueError(f"small_m_norm_gate_up_silu: gate_up_weight needs an even number of "
                         f"rows [2I, K], got {tuple(gate_up_weight.shape)}")
    skinny_fused._check("small_m_norm_gate_up_silu", x, gate_up_weight, bias,
                        gate_up_weight.shape[0], norm_weight, max_m=MAX_M)
    inter = gate_up_weight.shape[0] // 2
    out = torch.empty(x.shape[0], inter, dtype=x.dtype, device=x.device)
    return _run("small_m_norm_gate_up_silu", x, norm_weight, eps, gate_up_weight, bias, None,
                out, inter, gate_up=True, config=config)


#: The fused decode GEMMs ``(norm_linear, linear_add, norm_gate_up_silu)`` per row range.
SKINNY_OPS = (skinny_fused.skinny_norm_linear, skinny_fused.skinny_linear_add,
              skinny_fused.skinny_norm_gate_up_silu)
SMALL_M_OPS = (small_m_norm_linear, small_m_linear_add, small_m_norm_gate_up_silu)


def fused_decode_ops(h: torch.Tensor) -> tuple | None:
    """The fused decode GEMMs a forward over ``h [T, hidden]`` takes, or ``None`` (the
    unfused layers): skinny_fused's for 1-2 rows, this module's for 3-16 (3-32 where
    small_m_resident takes them) when it is on.
    Reads only shapes: graph- and sync-safe."""
    if skinny_fused.use_fused_decode(h):
        return SKINNY_OPS
    if use_small_m_fused(h):
        return SMALL_M_OPS
    return None
