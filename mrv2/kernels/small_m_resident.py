"""The fused decode GEMMs for 3 to 64 rows with each program's weights in REGISTERS before the PDL wait.

``skinny_stream`` showed what a decode GEMM needs at 1-2 rows: a program issues the loads of
ALL its weights before ``griddepcontrol.wait``, so the weight stream of kernel i+1 runs
while kernel i drains, and what is left after the wait is a short tail on activations
(the 28-layer chain 652 -> 414 us at one row, H200). From 3 rows the multiply needs tensor
cores, and ``small_m_fused`` loads its weights tile by tile after the wait: its chain takes
712-731 us at 4-16 rows and 1,005 at 32 (cuBLAS 871). A plain Triton kernel cannot hold its
weights in the MMA's operand registers: ``tl.load`` gives a blocked layout that the compiler
converts through shared memory after the wait (session 16, 131a7ef, reverted).

This module writes the kernel in **Gluon** (Triton's lower-level dialect, where the layout of
every tensor is ours to choose), so the weight tile is loaded straight into the ``mma.sync``
B-operand layout (``DotOperandLayout(1, ...)``, 8 consecutive K elements a thread: 16-byte
``ld.global.v4`` loads, no shared memory, no conversion). One program:

1. owns ``BLOCK_N`` output columns (8 to 32: ``m16n8k16``'s N is 8, so N = 1024 gets 128
   programs, about one an SM) over all of K. Its warps split K: warp ``s`` holds rows
   ``s * KS .. (s + 1) * KS`` of each ``KCH``-wide chunk of W^T, a batched ``[S, KS, BLOCK_N]``
   operand (``S`` = warps). K is ``NCH`` chunks of ``KCH`` (a power of two; up to 4 chunks,
   so K = 3,072 is three chunks of 1,024);
2. issues those loads (and, for gate_up, the up rows'), then waits for the previous kernel;
3. for each block of 16 rows: loads x in the A-operand layout (from L2), the RMSNorm's
   inverse RMS over all of K, the normed rows; one batched ``mma_v2`` per chunk gives each
   warp its K-slice's partial ``[16, BLOCK_N]``; ``sum`` over the warps (through shared memory,
   a few KB); the epilogue (bias, SiLU * up, the residual add) and the store.

Same entry points, operations and roundings as ``small_m_fused`` (whose ``_run`` routes here
when ``fits``); the sums over K run in another order, so the two agree within fp32 rounding.
bf16 / fp16 only (``mma_v2`` would take fp32 as TF32: the fp32 path stays on
``small_m_fused``); CUDA only: Gluon has no interpreter, so the CPU tests compile it for sm_90
and check the PTX (the weight loads before the wait), and the GPU tests check the numbers.
The torch references are ``skinny_fused``'s.

Measured (H100s; the H200 kind was not lent). At 5a8dd4a (job 21N) the 28-layer chain took
1,276 / 1,325 / 2,344 / 4,360 us at 4 / 16 / 32 / 64 rows against small_m_fused's 770 / 757 /
1,025 / 1,246 and cuBLAS's 818 / 906 / 920 / 951: a fixed ~265 us (the weights at the
bandwidth: the stream works) plus ~12 us a 16-row block a launch. Nsight Compute (job 21P) put
that block cost in the warps' sum: ``gl.reduce`` over the warp axis of the MMA layout lowered
to shared-memory stores and loads with 32-way bank conflicts (2.2 M wavefronts where 0.18 M
would do at qkv, 16 rows). Summed through a padded shared buffer instead (d74f75d; the bank
arithmetic is in chapter 10), the chain took **566 / 609 / 839 / 1,334 us** (job 22P, 6e251c3:
small_m_fused 766 / 754 / 1,024 / 1,253, cuBLAS 818 / 910 / 917 / 950), per op at 16 rows 3.3
(o_proj) to 4.8 us (gate_up) a launch against small_m_fused's 4.4-6.4, and TPOT over fresh
processes (one round) at batch 16 / 32 1.231 / 1.554 -> 1.137 / 1.440 ms. Hence ON by default,
and the model's decode layers send it 3-32 rows (``MODEL_MAX_M``). What stays: every program
reads all of x from L2 once per 16-row block, so the cost still grows with the rows (64 rows
lose to cuBLAS); ``BLOCK_M = 32`` takes two blocks in one pass (at 16 it compiles to the same
instructions as before it existed; its GPU tests pass, but at 32 rows the sweep's best launch
of each op reads 16 rows a pass, job 23Q). From 17 rows o_proj, gate_up and down take BLOCK_N
32 with 8 warps (``LAUNCH_OVER_16``: chain 843 -> 770-782 us at 32 rows, TPOT at batch 32
1.437 -> 1.417 ms).

Why the weight loads before the wait pay (chapter 10): on the chain without PDL the same
kernels take 740 / 782 / 1,005 us at 4 / 16 / 32 rows, with it 565 / 609 / 769 (job 23T),
although ptxas gives qkv and gate_up every register of their SM (``scripts/occupancy_sm90.py
--resident-rows``): the next kernel's programs can start only on the SMs a kernel leaves
free, or as its programs end, never beside them.
"""

from __future__ import annotations

import functools
import warnings

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from mrv2.kernels import pdl
from mrv2.platform import TRITON_INTERPRET, compiled_language, env_switch

#: Route ``small_m_fused``'s entry points here where ``fits``: on by default on the GPU since
#: job 22P (H100: the 28-layer chain 566 / 609 / 839 us at 4 / 16 / 32 rows against
#: small_m_fused's 766 / 754 / 1,024 and cuBLAS's 818 / 910 / 917); ``MRV2_RESIDENT_GEMM=0``
#: turns it off. Never under the interpreter (Gluon has none).
ENABLED: bool = env_switch("MRV2_RESIDENT_GEMM", True) and not TRITON_INTERPRET
#: The most rows the model's decode layers send here (``small_m_fused.use_small_m_fused``
#: takes 17 to this many rows only where ``takes``): at 64 cuBLAS wins (1,334 against 950 us).
MODEL_MAX_M = 32
#: The most rows a launch takes (16-row blocks, one after another, weights still resident).
MAX_M = 64
#: The widest K chunk (a power of two); K must be at most ``MAX_CHUNKS`` of them.
MAX_KCH = 1024
MAX_CHUNKS = 4
#: Launch per op kind (``"norm"``, ``"add"``, ``"gate_up"``): BLOCK_N, warps, BLOCK_M (the rows
#: a pass of the row loop takes, 16 or 32), for up to 16 rows. Compiled for sm_90 (Triton 3.6,
#: ptxas) qkv at (32, 16) takes 127 registers a thread (1 program an SM, 128 programs), o_proj
#: and down at (8, 8) 104 and 136 (128 programs), gate_up at (32, 16) 128 (96 programs): the
#: launches the GPU checked the numbers of and timed in the model (jobs 21N, 22P).
LAUNCH = {"norm": (32, 16, 16), "add": (8, 8, 16), "gate_up": (32, 16, 16)}
#: ... and from 17 rows (two or more blocks of 16 rows, each re-reading x): gate_up, o_proj and
#: down at BLOCK_N 32 with 8 warps (gate_up 96 programs, 255 registers; o_proj and down 32
#: programs, fewer reads of x; down spills 112 bytes at K = 3,072). A per-op sweep on the
#: 28-layer chain found them (H100, jobs 22A-B: 800 against 842 us at 32 rows for the add
#: kernels, 799 against 842 for gate_up); their GPU tests passed (job 23Q), the chain at 32 rows
#: took 770-782 us against 843, and TPOT over fresh processes against the launches before,
#: faster in both rounds: batch 24 1.347 -> 1.339 ms, batch 32 1.437 -> 1.417 (job 23S).
LAUNCH_OVER_16 = {"norm": (32, 16, 16), "add": (32, 8, 16), "gate_up": (32, 8, 16)}
#: Launches that passed the GPU's numeric tests (``test_gpu_bf16_qwen3_shapes_match_the_
#: references``, candidates) but are not the default: gate_up at (32, 8) up to 16 rows is
#: faster on the chain (520 / 567 against 567 / 610 us at 4 / 16 rows, job 22A) and slower in
#: the model, TPOT at batch 4 / 8 0.955 / 1.008 -> 0.971 / 1.064 ms (job 23Q, with the 17-32-row
#: launches above; both rounds). ``(table, kind) -> launch``.
LAUNCH_CANDIDATES = {("LAUNCH", "gate_up"): (32, 8, 16)}
#: The warps' sum buffer ([S, 16, BLOCK_N] fp32): RED_PAD words of padding after every
#: RED_INTERVAL, so a warp's accumulator store and the read-back hit distinct banks
#: (chapter 10 checks the arithmetic for BLOCK_N 8 / 16 / 32).
RED_INTERVAL = gl.constexpr(32)
RED_PAD = gl.constexpr(8)


@gluon.jit
def _gdc_wait():
    # griddepcontrol.wait / launch_dependents (mrv2.kernels.pdl's contract), as Gluon asm.
    gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32,
                              is_pure=False, pack=1)
    gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [],
                              dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _dims3(L: gl.constexpr, A: gl.constexpr, B: gl.constexpr, C: gl.constexpr):
    # Index vectors of a [A, B, C] tensor in layout L, as [A,1,1], [1,B,1], [1,1,C].
    a = gl.arange(0, A, layout=gl.SliceLayout(1, gl.SliceLayout(2, L)))
    b = gl.arange(0, B, layout=gl.SliceLayout(0, gl.SliceLayout(2, L)))
    c = gl.arange(0, C, layout=gl.SliceLayout(0, gl.SliceLayout(1, L)))
    return (gl.expand_dims(gl.expand_dims(a, 1), 2), gl.expand_dims(gl.expand_dims(b, 0), 2),
            gl.expand_dims(gl.expand_dims(c, 0), 1))


@gluon.jit
def _normed(x, nw_ptrs, rstd3, c: gl.constexpr, KCH: gl.constexpr, NORM: gl.constexpr):
    # Chunk c of the rows' activations [S, BLOCK_M, KS] (A-operand layout), normed.
    if NORM:
        nw = gl.load(nw_ptrs + c * KCH).to(gl.float32)                     # [S, 1, KS]
        # NOTE: rounded to x's dtype, as the unfused rms_norm writes it for the GEMM.
        x = ((x.to(gl.float32) * rstd3) * nw).to(x.dtype)
    return x


@gluon.jit
def _add(a, b):
    return a + b


# A CTA-wide barrier: Gluon leaves shared-memory ordering to the kernel (Triton 3.6 calls it
# thread_barrier, 3.9 barrier).
_barrier = getattr(gl, "thread_barrier", None) or gl.barrier


# NOTE: ``gl.sum`` wraps triton.language's sum, whose combine function is an interpreted one
# when TRITON_INTERPRET=1 (the CPU tests compile this kernel for sm_90 in that process):
# a reduce with our own combine compiles either way.
@gluon.jit
def _sum(x, axis: gl.constexpr):
    return gl.reduce(x, axis, _add)


@gluon.jit
def _sum_sq(x):
    # [S, BM, KS] -> [BM]: each row's sum of squares over this chunk, all warps' slices.
    xf = x.to(gl.float32)
    return _sum(_sum(xf * xf, 2), 0)


@gluon.jit
def _columns_and_bias(bias_ptr, n0, N, BLOCK_N: gl.constexpr, OL: gl.constexpr,
                      HAS_BIAS: gl.constexpr, GATE_UP: gl.constexpr):
    # The program's output columns n0 .. n0 + BLOCK_N in the epilogue's layout, which of them
    # exist, and their bias (fp32; gate_up: the gate's and the up half's), zeros without one.
    on = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, OL))
    n_ok = on < N
    bias = gl.zeros([BLOCK_N], gl.float32, layout=gl.SliceLayout(0, OL))
    bias_up = bias
    if HAS_BIAS:
        bias = gl.load(bias_ptr + on, mask=n_ok, other=0.0).to(gl.float32)
        if GATE_UP:
            bias_up = gl.load(bias_ptr + N + on, mask=n_ok, other=0.0).to(gl.float32)
    return on, n_ok, bias, bias_up


@gluon.jit
def _sum_and_store(acc, acc_up, red, red_up, bias, bias_up, rows, on, n_ok, M, residual_ptr,
                   stride_rm, out_ptr, stride_om, RL: gl.constexpr, GATE_UP: gl.constexpr,
                   ADD_RESIDUAL: gl.constexpr):
    # The warps' K-slices summed ([S, BM, BN] -> [BM, BN]) through the padded buffer, then the
    # unfused path's roundings (as fused_epilogue.round_product / store_output, which are
    # Triton, not Gluon), the residual add and the store of rows ``rows``, columns ``on``.
    _barrier()                           # the last block's readers are done with red
    red.store(acc)
    if GATE_UP:
        red_up.store(acc_up)
    _barrier()
    y = _sum(red.load(RL), 0) + gl.expand_dims(bias, 0)                    # [BM, BN]
    DT: gl.constexpr = out_ptr.dtype.element_ty
    y = y.to(DT).to(gl.float32)
    if GATE_UP:
        g_up = _sum(red_up.load(RL), 0) + gl.expand_dims(bias_up, 0)
        silu = (y / (1.0 + gl.exp(-y))).to(DT).to(gl.float32)
        y = (silu * g_up.to(DT).to(gl.float32)).to(DT).to(gl.float32)
    o_rows = gl.expand_dims(rows, 1)                                        # [BM, 1]
    mask = (o_rows < M) & gl.expand_dims(n_ok, 0)
    cols = gl.expand_dims(on, 0)
    if ADD_RESIDUAL:
        # NOTE: in place is race-free: a program reads and writes only its own columns.
        r = gl.load(residual_ptr + o_rows * stride_rm + cols, mask=mask, other=0.0)
        y = y + r.to(gl.float32)
    gl.store(out_ptr + o_rows * stride_om + cols, y.to(DT), mask=mask)


@gluon.jit(do_not_specialize=["M"])
def _resident_kernel(
    x_ptr, norm_w_ptr, w_ptr, bias_ptr, residual_ptr,   # inputs: x [M, K], W [N or 2N, K]
    out_ptr,                                            # output [M, N] (may BE residual)
    M, N, K, eps,
    stride_xm, stride_wn, stride_rm, stride_om,         # strides (last dims contiguous)
    NORM: gl.constexpr, GATE_UP: gl.constexpr, ADD_RESIDUAL: gl.constexpr,
    HAS_BIAS: gl.constexpr, BLOCK_N: gl.constexpr, KCH: gl.constexpr, NCH: gl.constexpr,
    BLOCK_M: gl.constexpr, PDL: gl.constexpr,
):
    S: gl.constexpr = gl.num_warps()
    KS: gl.constexpr = KCH // S                 # a warp's K rows of each chunk
    # mma.sync m16n8k16, batched over the warps: warp s owns batch s (its K-slice).
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[S, 1, 1],
                                                  instr_shape=[1, 16, 8])
    XL: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=8)
    WL: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=8)
    # The warps' partial products meet in shared memory, [S, BLOCK_M, BLOCK_N] fp32 with 8 words of
    # padding every 32: a warp's accumulator store (rows m = lane / 4, even columns) then hits
    # distinct banks. NOTE: gl.reduce over the warp axis of the MMA layout lowered to 32-way
    # bank conflicts, ~10 us a 16-row block at qkv (H100 profile, job 21P).
    RED: gl.constexpr = gl.PaddedSharedLayout.with_identity_for([[RED_INTERVAL, RED_PAD]],
                                                                 [S, BLOCK_M, BLOCK_N], [2, 1, 0])
    # ... read back with each thread holding all S partials of its (row, column): the sum
    # over the warps is in registers, and lands in the epilogue's layout (lanes across
    # columns, then rows).
    TN: gl.constexpr = min(32, BLOCK_N)
    RL: gl.constexpr = gl.BlockedLayout([S, 1, 1], [1, 32 // TN, TN], [1, S, 1], [2, 1, 0])
    OL: gl.constexpr = gl.SliceLayout(0, RL)                                # [BM, BN]
    red = gl.allocate_shared_memory(gl.float32, [S, BLOCK_M, BLOCK_N], RED)
    red_up = red
    if GATE_UP:
        red_up = gl.allocate_shared_memory(gl.float32, [S, BLOCK_M, BLOCK_N], RED)
    pid = gl.program_id(0)

    # 1. This program's weights, W^T as [S, KS, BLOCK_N] per chunk, in the B-operand layout.
    ws, wk, wn = _dims3(WL, S, KS, BLOCK_N)
    # NOTE: the last column block wraps onto real rows of W (n % N): unmasked weight loads.
    n_w = (pid * BLOCK_N + wn) % N
    w_ptrs = w_ptr + n_w.to(gl.int64) * stride_wn + ws * KS + wk            # [S, KS, BN]
    up = N * stride_wn                                                      # gate -> up rows
    w0 = gl.load(w_ptrs)
    w1 = w0
    w2 = w0
    w3 = w0
    if NCH > 1:
        w1 = gl.load(w_ptrs + KCH)
    if NCH > 2:
        w2 = gl.load(w_ptrs + 2 * KCH)
    if NCH > 3:
        w3 = gl.load(w_ptrs + 3 * KCH)
    u0 = w0
    u1 = w0
    u2 = w0
    u3 = w0
    if GATE_UP:
        u0 = gl.load(w_ptrs + up)
        if NCH > 1:
            u1 = gl.load(w_ptrs + up + KCH)
        if NCH > 2:
            u2 = gl.load(w_ptrs + up + 2 * KCH)
        if NCH > 3:
            u3 = gl.load(w_ptrs + up + 3 * KCH)
    # 2. Only now wait for the kernel that wrote x (and the residual).
    if PDL:
        _gdc_wait()

    xs, xm, xk = _dims3(XL, S, BLOCK_M, KS)
    x_k = xs * KS + xk                                                      # [S, 1, KS]
    nw_ptrs = norm_w_ptr + x_k
    om = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, OL))
    on, n_ok, bias, bias_up = _columns_and_bias(bias_ptr, pid * BLOCK_N, N, BLOCK_N, OL,
                                                HAS_BIAS, GATE_UP)

    # 3. BLOCK_M (16 or 32) rows at a time.
    for m0 in range(0, M, BLOCK_M):
        rows = m0 + xm                                                      # [1, BM, 1]
        row_ok = rows < M
        x_ptrs = x_ptr + rows.to(gl.int64) * stride_xm + x_k                # [S, BM, KS]
        # Each chunk of x loaded once: the mean square needs all of K before the products.
        x0 = gl.load(x_ptrs, mask=row_ok, other=0.0)
        x1 = x0
        x2 = x0
        x3 = x0
        if NCH > 1:
            x1 = gl.load(x_ptrs + KCH, mask=row_ok, other=0.0)
        if NCH > 2:
            x2 = gl.load(x_ptrs + 2 * KCH, mask=row_ok, other=0.0)
        if NCH > 3:
            x3 = gl.load(x_ptrs + 3 * KCH, mask=row_ok, other=0.0)
        rstd3 = gl.full([1, BLOCK_M, 1], 1.0, gl.float32, layout=XL)
        if NORM:  # each row's inverse RMS over ALL of K: every chunk, every warp's slice
            ss = _sum_sq(x0)                                                # [BM]
            if NCH > 1:
                ss += _sum_sq(x1)
            if NCH > 2:
                ss += _sum_sq(x2)
            if NCH > 3:
                ss += _sum_sq(x3)
            rstd = gl.rsqrt(ss / K + eps)
            rstd3 = gl.expand_dims(gl.expand_dims(rstd, 0), 2)              # [1, BM, 1]
        acc = gl.zeros([S, BLOCK_M, BLOCK_N], gl.float32, layout=MMA)      # [S, BM, BN]
        acc_up = acc
        x = _normed(x0, nw_ptrs, rstd3, 0, KCH, NORM)
        acc = mma_v2(x, w0, acc)
        if GATE_UP:
            acc_up = mma_v2(x, u0, acc_up)
        if NCH > 1:
            x = _normed(x1, nw_ptrs, rstd3, 1, KCH, NORM)
            acc = mma_v2(x, w1, acc)
            if GATE_UP:
                acc_up = mma_v2(x, u1, acc_up)
        if NCH > 2:
            x = _normed(x2, nw_ptrs, rstd3, 2, KCH, NORM)
            acc = mma_v2(x, w2, acc)
            if GATE_UP:
                acc_up = mma_v2(x, u2, acc_up)
        if NCH > 3:
            x = _normed(x3, nw_ptrs, rstd3, 3, KCH, NORM)
            acc = mma_v2(x, w3, acc)
            if GATE_UP:
                acc_up = mma_v2(x, u3, acc_up)
        _sum_and_store(acc, acc_up, red, red_up, bias, bias_up, m0 + om, on, n_ok, M,
                       residual_ptr, stride_rm, out_ptr, stride_om, RL, GATE_UP, ADD_RESIDUAL)


def chunks(K: int) -> tuple[int, int] | None:
    """``(KCH, NCH)``: K as NCH chunks of a power-of-two KCH <= MAX_KCH, or None if it is not
    (K = 1024 -> (1024, 1); 3072 -> (1024, 3); 1536 -> (512, 3); 5000 -> None)."""
    kch = K & -K                                     # the largest power of two dividing K
    kch = min(kch, MAX_KCH)
    nch = K // kch if kch else 0
    return (kch, nch) if kch and 1 <= nch <= MAX_CHUNKS else None


#: The fewest keys of a chunk a warp may own: the operand layouts' ``k_width=8`` gives a
#: thread 8 consecutive keys and a quad of lanes 32, two ``m16n8k16`` steps. NOTE: a slice
#: of 16 keys compiled and gave wrong numbers (GPU, job 21N: K = 64 and 96).
MIN_SLICE = 32


def launch(kind: str, K: int, M: int = 16, tables: tuple[dict, dict] | None = None
           ) -> tuple[int, int, int]:
    """``(BLOCK_N, num_warps, BLOCK_M)`` for an op kind at K and M rows: ``LAUNCH``'s (over 16
    rows ``LAUNCH_OVER_16``'s; ``tables``: another module's pair, as small_m_staged's), fewer
    warps when a warp's K-slice of a chunk would be under ``MIN_SLICE``."""
    up_to_16, over_16 = tables or (LAUNCH, LAUNCH_OVER_16)
    block_n, warps, block_m = (up_to_16 if M <= 16 else over_16)[kind]
    kch, _ = chunks(K) or (MAX_KCH, 1)
    while warps > 1 and kch // warps < MIN_SLICE:
        warps //= 2
    return block_n, warps, block_m


@functools.cache
def _has_mma_v2(index: int) -> bool:
    # mma.sync m16n8k16 in bf16 needs sm_80 or newer (a host query, cached: no sync).
    return torch.cuda.get_device_capability(index)[0] >= 8


def _half_on_mma_gpu(x: torch.Tensor) -> bool:
    # bf16 / fp16 on a GPU whose tensor cores take mma_v2 (a CUDA tensor's device has an index).
    return (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)
            and _has_mma_v2(x.device.index))


def takes(x: torch.Tensor) -> bool:
    """Whether calls on ``x``'s rows may come here (on, device, dtype: graph-safe)."""
    return ENABLED and _half_on_mma_gpu(x)


def fits(x: torch.Tensor, weight: torch.Tensor, K: int) -> bool:
    """Whether this kernel takes a call (shapes, dtypes, device only: graph-safe)."""
    return (_half_on_mma_gpu(x) and x.shape[0] <= MAX_M and chunks(K) is not None
            and chunks(K)[0] >= MIN_SLICE and weight.stride(1) == 1)


def kind_of(gate_up: bool, residual) -> str:
    """The op kind of a call: ``"gate_up"``, ``"add"`` (a residual) or ``"norm"``."""
    return "gate_up" if gate_up else ("add" if residual is not None else "norm")


def kernel_args(x, norm_weight, eps, weight, bias, residual, out, N, gate_up, cfg):
    """``(args, kwargs)`` of one launch (``run``'s arguments; ``cfg``: ``block_n``,
    ``num_warps``, ``block_m``), PDL aside: what this kernel and small_m_staged's take."""
    M, K = x.shape
    kch, nch = chunks(K)
    r = residual if residual is not None else out
    args = (x, norm_weight if norm_weight is not None else x, weight,
            bias if bias is not None else weight, r, out,
            M, N, K, float(eps), x.stride(0), weight.stride(0), r.stride(0), out.stride(0))
    kwargs = {"NORM": norm_weight is not None, "GATE_UP": gate_up,
              "ADD_RESIDUAL": residual is not None, "HAS_BIAS": bias is not None,
              "BLOCK_N": cfg["block_n"], "KCH": kch, "NCH": nch, "BLOCK_M": cfg["block_m"],
              "num_warps": cfg["num_warps"]}
    return args, kwargs


def run(x, norm_weight, eps, weight, bias, residual, out, N, *, gate_up: bool,
        config: dict | None = None) -> torch.Tensor:
    """One fused GEMM (``small_m_fused._run``'s arguments, checked there): see the module.

    Args:
        config: overrides ``{"block_n": 8 | 16 | 32, "num_warps": 1-16, "block_m": 16 | 32}``.
    """
    block_n, warps, block_m = launch(kind_of(gate_up, residual), x.shape[1], x.shape[0])
    cfg = {"block_n": block_n, "num_warps": warps, "block_m": block_m, **(config or {})}
    use_pdl = pdl.use_pdl(x.device)
    args, kwargs = kernel_args(x, norm_weight, eps, weight, bias, residual, out, N, gate_up, cfg)
    _resident_kernel[(triton.cdiv(N, cfg["block_n"]),)](
        *args, PDL=use_pdl, **kwargs, **pdl.launch_kwargs(use_pdl))
    return out


def sm90_kernel(M: int, N: int, K: int, kind: str):
    """One launch compiled for an H100 / H200 (sm_90, bf16, PDL on), no GPU needed.

    Args:
        M, N, K: rows, output columns, reduction length (``N`` per gate / up half).
        kind: ``"norm"`` (norm + product), ``"add"`` (product + residual add) or
            ``"gate_up"`` (norm + gate_up + SiLU * up).

    Returns:
        ``(kernel, block_n, num_warps)``: Triton's compiled kernel (``kernel.asm["ptx"]``,
        ``kernel.metadata.shared``) and the launch it was compiled for.
    """
    return compile_call_sm90(_resident_kernel, kernel_args, launch, M, N, K, kind)


def compile_call_sm90(fn, args_of, launch_of, M: int, N: int, K: int, kind: str):
    """``sm90_kernel``'s work for a kernel ``fn`` whose module builds its arguments with
    ``args_of`` (``kernel_args``'s contract) and picks launches with ``launch_of``
    (``launch``'s): CPU stand-ins of one call of op ``kind``, compiled with ``compile_sm90``."""
    bf = torch.bfloat16
    gate_up = kind == "gate_up"
    x = torch.empty(M, K, dtype=bf)
    w = torch.empty(2 * N if gate_up else N, K, dtype=bf)
    out = torch.empty(M, N, dtype=bf)
    block_n, warps, block_m = launch_of(kind, K, M)
    cfg = {"block_n": block_n, "num_warps": warps, "block_m": block_m}
    args, kwargs = args_of(x, torch.empty(K, dtype=bf) if kind != "add" else None, 1e-6, w,
                           None, out if kind == "add" else None, out, N, gate_up, cfg)
    return compile_sm90(fn, args, {**kwargs, "PDL": True}), block_n, warps


def compile_sm90(fn, args: tuple, kwargs: dict):
    """Triton's compiled kernel of Gluon kernel ``fn`` for sm_90 (``launch_pdl`` on), on any
    machine: what ``JITFunction.run`` does before a launch (the binder's specialisation and
    constexprs), minus the launch. NOTE: Triton internals, checked by the CPU tests."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import create_function_from_signature

    kwargs = {**kwargs, "launch_pdl": True, "debug": False, "instrumentation_mode": ""}
    target = GPUTarget("cuda", 90, 32)
    with warnings.catch_warnings(), compiled_language():   # Triton 3.9's FP-fusion notice
        warnings.filterwarnings("ignore", message=".*TRITON_DEFAULT_FP_FUSION")
        backend = make_backend(target)
        binder = create_function_from_signature(fn.signature, fn.params, backend)
        bound, spec, opts = binder(*args, **kwargs)
        options, sig, constexprs, attrs = fn._pack_args(backend, kwargs, bound, spec, opts)
        return triton.compile(GluonASTSource(fn, sig, constexprs, attrs), target=target,
                              options=options.__dict__)


def sm90_ptx(M: int, N: int, K: int, kind: str) -> tuple[str, int, int]:
    """``(ptx, block_n, num_warps)``: the PTX text of ``sm90_kernel``'s launch."""
    kernel, block_n, warps = sm90_kernel(M, N, K, kind)
    return kernel.asm["ptx"], block_n, warps
