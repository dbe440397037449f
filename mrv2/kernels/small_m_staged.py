"""``small_m_resident`` with each program's weights staged in SHARED memory, not registers.

``small_m_resident`` loads a program's weights into the MMA's operand registers before the
PDL wait, so kernel i+1's weight stream can overlap kernel i's tail. ptxas gives qkv and
gate_up every register of their SM (``scripts/occupancy_sm90.py --resident-rows``): no
program of the next kernel fits BESIDE one of them, so its early loads start only on the SMs
a kernel leaves free, or as its programs end (chapter 10, session 23).

Here the weights go to shared memory with ``cp.async`` (Ampere's asynchronous copy: no
register holds them in flight) before the wait. What a thread keeps in registers after it is
then the accumulators and one piece (``PIECE`` keys) of x and of W at a time, W's read back
from shared memory. The hope: programs small enough that kernel i+1's sit
beside kernel i's on one SM, and its whole weight slice arrives while kernel i computes.

Same arguments, operations and roundings as ``small_m_resident``; a warp multiplies its
K-slice ``PIECE`` keys at a time and sums the mean square piece by piece, so the two agree
within fp32 rounding, not bit for bit. bf16 / fp16, CUDA only
(Gluon has no interpreter): the CPU tests compile it for sm_90 and check the PTX (every
``cp.async`` before the wait); the GPU tests check the numbers.

Measured (H100; the H200 kind was not lent). ptxas (Triton 3.6) gives the launches 48-50% of
an SM's registers and 83-148 KB of shared memory, against 41-100% for the resident kernel's
(``scripts/occupancy_sm90.py --staged-rows``). The 28-layer chain (``scripts/
bench_resident_chain.py``, job 24W) took 546 / 555 / 589 us at 4 / 8 / 16 rows against the
resident's 568 / 584 / 610, and 792 / 794 / 824 without PDL: the copies before the wait buy
~250 us where the resident's loads bought ~170. In the model (``bench decode``, 192 keys, job
24Y) the decode step's GPU time went 0.967 -> 0.903 ms at batch 4, 1.014 -> 0.958 at 8,
1.131 -> 1.087 at 16, and TPOT over fresh processes agreed where a process was not host-bound
(b4 0.955 / 0.967 -> 0.899 / 0.899 / 0.926 ms). On by default since session 25 (job 25X, H100:
the model's GPU tests against transformers, the kernel tests and the sync-debug loop pass with
it; TPOT over fresh processes, 2 rounds, job 25R: b4 0.957 -> 0.898 ms, b8 1.010 -> 0.949, b16
1.137 -> 1.098, b32 unchanged 1.419, which keeps the resident kernel). Over 16 rows it lost
(first launches, job 24V: 1,020 / 1,108 us against 762 / 782 at 24 / 32 rows): every 16-row
block reads x twice, in pieces, so the resident kernel keeps 17-32 rows (``MAX_M``). A program
a 16-row block (``SPLIT_ROWS``) lost too (job 25X: the chain 810 / 839 us at 24 / 32 rows, one
program walking both 834 / 863, the resident 754 / 772; TPOT b24 / b32 1.378 / 1.504 against
1.334 / 1.416 ms). Taking 32 rows a pass (``BLOCK_M`` 32) would read x once, but ptxas then
gives qkv and gate_up 200-255 registers a thread (offline, Triton 3.6). Yet in the model qkv
alone at 17-32 rows (``KIND_MAX_M``, one program walking both blocks) pays: half an SM lets
attention's programs start beside it and load their first key tile before the wait (TPOT b24 /
b32 -1.0 / -1.7%, H100 job 26EM3), so that is the default since session 26.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

from mrv2.kernels import pdl, small_m_resident
from mrv2.kernels.small_m_resident import (
    RED_INTERVAL,
    RED_PAD,
    _barrier,
    _columns_and_bias,
    _dims3,
    _gdc_wait,
    _normed,
    _sum,
    _sum_and_store,
    kind_of,
)
from mrv2.platform import TRITON_INTERPRET, env_switch

#: Route ``small_m_resident``'s calls of up to ``MAX_M`` rows here where they ``fit``: on by
#: default on the GPU (``MRV2_STAGED_GEMM=0`` turns it off; never under the interpreter).
ENABLED: bool = env_switch("MRV2_STAGED_GEMM", True) and not TRITON_INTERPRET


def takes(x: torch.Tensor) -> bool:
    """Whether calls on ``x``'s rows may come here (on, and a Hopper GPU: graph-safe). NOTE:
    sm_90+ only, where it was measured and a program's up to 148 KB of shared memory fit (an
    sm_86 / sm_89 GPU gives a program at most ~100 KB)."""
    return ENABLED and pdl.sm90_or_newer(x.device)


# Global -> shared cp.async (Triton 3.6 calls it async_copy_global_to_shared, 3.9 async_load).
_async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared


def swizzle(ks: int) -> tuple[int, int]:
    """``(per_phase, max_phase)`` of the weight buffer's swizzle for rows of ``ks`` bf16 keys:
    16-byte vectors XOR-ed within a row (rows of 128 bytes or more: 8 phases; shorter rows
    share a phase, ``per_phase`` of them a 128-byte line), so the 8 lanes of an MMA operand
    that read one key range of 8 different columns hit 8 different bank groups."""
    row_bytes = ks * 2
    return max(1, 128 // row_bytes), max(1, min(8, row_bytes // 16))


@gluon.jit
def _copy_chunk(smem, w_ptr, n0, row0, N, stride_wn, col0, S: gl.constexpr,
                BLOCK_N: gl.constexpr, KS: gl.constexpr, CL: gl.constexpr):
    # W[n, col0 + s * KS + k] -> smem[s, n, k] for this program's columns: cp.async, 16 B a
    # thread and copy, no register holds the data.
    s = gl.arange(0, S, layout=gl.SliceLayout(1, gl.SliceLayout(2, CL)))
    n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, gl.SliceLayout(2, CL)))
    k = gl.arange(0, KS, layout=gl.SliceLayout(0, gl.SliceLayout(1, CL)))
    s3 = gl.expand_dims(gl.expand_dims(s, 1), 2)                            # [S, 1, 1]
    n3 = gl.expand_dims(gl.expand_dims(n, 0), 2)                            # [1, BN, 1]
    k3 = gl.expand_dims(gl.expand_dims(k, 0), 1)                            # [1, 1, KS]
    rows = row0 + (n0 + n3) % N                                             # [1, BN, 1]
    ptrs = w_ptr + rows.to(gl.int64) * stride_wn + col0 + s3 * KS + k3      # [S, BN, KS]
    _async_load(smem, ptrs)


@gluon.jit
def _stage(w_ptr, n0, row0, N, stride_wn, S: gl.constexpr, BLOCK_N: gl.constexpr,
           KS: gl.constexpr, KCH: gl.constexpr, NCH: gl.constexpr, CL: gl.constexpr,
           WS: gl.constexpr):
    # Rows row0 + (n0 .. n0 + BLOCK_N) % N of W, all of K, copied into one [S, BN, KS] buffer a
    # chunk (chunk c at K offset c * KCH; unused buffers alias the first). NOTE: the last column
    # block wraps onto real rows of W (n % N), as in small_m_resident.
    b0 = gl.allocate_shared_memory(w_ptr.dtype.element_ty, [S, BLOCK_N, KS], WS)
    b1 = b0
    b2 = b0
    b3 = b0
    _copy_chunk(b0, w_ptr, n0, row0, N, stride_wn, 0, S, BLOCK_N, KS, CL)
    if NCH > 1:
        b1 = gl.allocate_shared_memory(w_ptr.dtype.element_ty, [S, BLOCK_N, KS], WS)
        _copy_chunk(b1, w_ptr, n0, row0, N, stride_wn, KCH, S, BLOCK_N, KS, CL)
    if NCH > 2:
        b2 = gl.allocate_shared_memory(w_ptr.dtype.element_ty, [S, BLOCK_N, KS], WS)
        _copy_chunk(b2, w_ptr, n0, row0, N, stride_wn, 2 * KCH, S, BLOCK_N, KS, CL)
    if NCH > 3:
        b3 = gl.allocate_shared_memory(w_ptr.dtype.element_ty, [S, BLOCK_N, KS], WS)
        _copy_chunk(b3, w_ptr, n0, row0, N, stride_wn, 3 * KCH, S, BLOCK_N, KS, CL)
    return b0, b1, b2, b3


@gluon.jit
def _mma_chunk(acc, acc_up, wbuf, ubuf, x_ptrs, nw_ptrs, row_ok, rstd3, c: gl.constexpr,
               KCH: gl.constexpr, KS: gl.constexpr, P: gl.constexpr, NORM: gl.constexpr,
               GATE_UP: gl.constexpr, WL: gl.constexpr):
    # Chunk c's products, P keys a warp at a time: x's piece (normed), W^T's piece
    # [S, P, BN] read from the chunk's [S, BN, KS] buffer in the B-operand layout.
    for j in gl.static_range(KS // P):
        xp = gl.load(x_ptrs + c * KCH + j * P, mask=row_ok, other=0.0)    # [S, BM, P]
        x = _normed(xp, nw_ptrs + j * P, rstd3, c, KCH, NORM)
        acc = mma_v2(x, wbuf.slice(j * P, P, dim=2).permute([0, 2, 1]).load(WL), acc)
        if GATE_UP:
            acc_up = mma_v2(x, ubuf.slice(j * P, P, dim=2).permute([0, 2, 1]).load(WL),
                            acc_up)
    return acc, acc_up


@gluon.jit(do_not_specialize=["M"])
def _staged_kernel(
    x_ptr, norm_w_ptr, w_ptr, bias_ptr, residual_ptr,   # inputs: x [M, K], W [N or 2N, K]
    out_ptr,                                            # output [M, N] (may BE residual)
    M, N, K, eps,
    stride_xm, stride_wn, stride_rm, stride_om,         # strides (last dims contiguous)
    NORM: gl.constexpr, GATE_UP: gl.constexpr, ADD_RESIDUAL: gl.constexpr,
    HAS_BIAS: gl.constexpr, BLOCK_N: gl.constexpr, KCH: gl.constexpr, NCH: gl.constexpr,
    BLOCK_M: gl.constexpr, PDL: gl.constexpr, PER_PHASE: gl.constexpr,
    MAX_PHASE: gl.constexpr, P: gl.constexpr, SPLIT_ROWS: gl.constexpr = False,
):
    S: gl.constexpr = gl.num_warps()
    KS: gl.constexpr = KCH // S                 # a warp's K-slice of a chunk, read P at a time
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[S, 1, 1],
                                                  instr_shape=[1, 16, 8])
    XL: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=8)
    WL: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=8)
    RED: gl.constexpr = gl.PaddedSharedLayout.with_identity_for([[RED_INTERVAL, RED_PAD]],
                                                                 [S, BLOCK_M, BLOCK_N], [2, 1, 0])
    TN: gl.constexpr = min(32, BLOCK_N)
    RL: gl.constexpr = gl.BlockedLayout([S, 1, 1], [1, 32 // TN, TN], [1, S, 1], [2, 1, 0])
    OL: gl.constexpr = gl.SliceLayout(0, RL)                                # [BM, BN]
    # The copy: warp s copies its K-slice [BN, KS], 8 keys (16 B) a lane.
    TK: gl.constexpr = min(32, KS // 8)
    CL: gl.constexpr = gl.BlockedLayout([1, 1, 8], [1, 32 // TK, TK], [S, 1, 1], [2, 1, 0])
    # The weights, one [S, BN, KS] buffer a chunk (warp s's K-slice at s), K innermost,
    # swizzled. NOTE: not one [NCH * S, ...] buffer: shapes must be powers of two (NCH = 3).
    WS: gl.constexpr = gl.SwizzledSharedLayout(8, PER_PHASE, MAX_PHASE, [2, 1, 0])

    # 1. This program's weights into shared memory, all of K, before the wait.
    n0 = gl.program_id(0) * BLOCK_N
    w0, w1, w2, w3 = _stage(w_ptr, n0, 0, N, stride_wn, S, BLOCK_N, KS, KCH, NCH, CL, WS)
    u0, u1, u2, u3 = w0, w1, w2, w3
    if GATE_UP:                                                             # the up rows
        u0, u1, u2, u3 = _stage(w_ptr, n0, N, N, stride_wn, S, BLOCK_N, KS, KCH, NCH, CL, WS)
    red = gl.allocate_shared_memory(gl.float32, [S, BLOCK_M, BLOCK_N], RED)
    red_up = red
    if GATE_UP:
        red_up = gl.allocate_shared_memory(gl.float32, [S, BLOCK_M, BLOCK_N], RED)
    async_copy.commit_group()
    # 2. Only now wait for the kernel that wrote x (and the residual).
    if PDL:
        _gdc_wait()

    xs, xm, xk = _dims3(XL, S, BLOCK_M, P)
    x_k = xs * KS + xk                                                      # [S, 1, P]
    nw_ptrs = norm_w_ptr + x_k
    om = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, OL))
    on, n_ok, bias, bias_up = _columns_and_bias(bias_ptr, n0, N, BLOCK_N, OL, HAS_BIAS,
                                                GATE_UP)
    async_copy.wait_group(0)
    _barrier()                           # every lane's copies visible to every warp

    # 3. BLOCK_M rows at a time: every row block, or with SPLIT_ROWS only block program_id(1)
    # (a program a row block; its W slice is then a second read, mostly from L2). NOTE: a
    # constexpr, not a strided loop over program_id(1): that loop cost o_proj / down 14 more
    # registers a thread (ptxas, Triton 3.6: 62% of an SM, so qkv no longer fit beside down).
    # NOTE: x is read in pieces of P keys a warp (from L2, twice where there is a norm: once
    # for the mean square, once for the product), so that no thread holds more than a piece
    # of x and of W at a time: registers, not bytes, decide whether the next kernel's
    # programs fit beside this one's.
    m_lo = gl.program_id(1) * BLOCK_M if SPLIT_ROWS else 0
    m_hi = m_lo + BLOCK_M if SPLIT_ROWS else M          # rows past M: masked (row_ok)
    for m0 in range(m_lo, m_hi, BLOCK_M):
        rows = m0 + xm                                                      # [1, BM, 1]
        row_ok = rows < M
        x_ptrs = x_ptr + rows.to(gl.int64) * stride_xm + x_k                # [S, BM, P]
        rstd3 = gl.full([1, BLOCK_M, 1], 1.0, gl.float32, layout=XL)
        if NORM:  # each row's inverse RMS over ALL of K: every chunk, every warp's slice
            ss = gl.zeros([S, BLOCK_M], gl.float32, layout=gl.SliceLayout(2, XL))
            for j in gl.static_range(NCH * KS // P):
                xp = gl.load(x_ptrs + (j // (KS // P)) * KCH + (j % (KS // P)) * P,
                             mask=row_ok, other=0.0).to(gl.float32)
                ss += _sum(xp * xp, 2)                                      # [S, BM]
            rstd = gl.rsqrt(_sum(ss, 0) / K + eps)                          # [BM]
            rstd3 = gl.expand_dims(gl.expand_dims(rstd, 0), 2)              # [1, BM, 1]
        acc = gl.zeros([S, BLOCK_M, BLOCK_N], gl.float32, layout=MMA)      # [S, BM, BN]
        acc_up = acc
        acc, acc_up = _mma_chunk(acc, acc_up, w0, u0, x_ptrs, nw_ptrs, row_ok, rstd3, 0, KCH,
                                 KS, P, NORM, GATE_UP, WL)
        if NCH > 1:
            acc, acc_up = _mma_chunk(acc, acc_up, w1, u1, x_ptrs, nw_ptrs, row_ok, rstd3, 1,
                                     KCH, KS, P, NORM, GATE_UP, WL)
        if NCH > 2:
            acc, acc_up = _mma_chunk(acc, acc_up, w2, u2, x_ptrs, nw_ptrs, row_ok, rstd3, 2,
                                     KCH, KS, P, NORM, GATE_UP, WL)
        if NCH > 3:
            acc, acc_up = _mma_chunk(acc, acc_up, w3, u3, x_ptrs, nw_ptrs, row_ok, rstd3, 3,
                                     KCH, KS, P, NORM, GATE_UP, WL)
        _sum_and_store(acc, acc_up, red, red_up, bias, bias_up, m0 + om, on, n_ok, M,
                       residual_ptr, stride_rm, out_ptr, stride_om, RL, GATE_UP, ADD_RESIDUAL)


#: Keys of a warp's K-slice multiplied at a time (>= small_m_resident.MIN_SLICE).
PIECE = 32
#: Launch per op kind, as ``small_m_resident.LAUNCH`` (BLOCK_N, warps, BLOCK_M). Compiled for
#: sm_90 (Triton 3.6's ptxas, ``scripts/occupancy_sm90.py --staged-rows``) each takes about half
#: an SM's registers: qkv (32, 8) 128 a thread and 84 KB of shared memory (it fits beside the
#: down before it), o_proj / down (16, 16) 64 and 83 / 115 KB, gate_up (32, 4) 248 and 148 KB
#: (these do not fit beside the kernel before: shared memory; at 64 / 96 programs they leave
#: 68 / 36 SMs free). The per-op sweep on the chain chose them (H100, jobs 24V-W: 16 rows add
#: (8, 8) 705 -> (16, 16) 591 us, gate_up (16, 8) -> (32, 4) 675; at 4 rows all within 2% of
#: each other). NOTE: ptxas gives ~90 registers a thread at 16 warps whatever the tile:
#: fewer warps, not smaller tiles, bring a program under half an SM.
LAUNCH = {"norm": (32, 8, 16), "add": (16, 16, 16), "gate_up": (32, 4, 16)}
#: Over 16 rows (with ``SPLIT_ROWS``, a program a 16-row block: twice the programs) gate_up
#: takes 16 columns a program: (32, 4)'s 96 x 2 programs of 148 KB hold one an SM, two waves on
#: 132 SMs; (16, 4)'s 192 x 2 of 76 KB (174 registers a thread) hold three, one wave.
LAUNCH_OVER_16 = {**LAUNCH, "gate_up": (16, 4, 16)}
#: The most rows routed here (``small_m_fused._run``): over 16 the chain lost to the resident
#: kernel's (H100, job 24V: 1,020 / 1,108 against 762 / 782 us at 24 / 32 rows).
MAX_M = 16
#: Per op kind, a row cap that replaces ``MAX_M``: qkv (``norm``) staged at 17-32 rows too, one
#: program walking both row blocks (half an SM's registers), so attention's programs fit beside
#: it before the wait (the resident qkv takes every register) and its first key tile is loaded
#: there (``decode_attention.PREFETCH_MAX_REQS`` 32). H100, job 26EM3, TPOT over 2 rounds of
#: fresh processes, b24 / b32: 1.346 / 1.434 ms -> 1.333 / 1.409 (qkv staged alone: neutral,
#: job 26QKV).
KIND_MAX_M: dict[str, int] = {"norm": 32}
#: Over ``BLOCK_M`` rows, whether each row block gets its own program (grid ``(N / BLOCK_N,
#: row blocks)``) instead of one program walking them in turn: a row block after the first
#: cost ~4.6 us a launch on the critical path (two L2 reads of x, three barriers, the sum
#: through shared memory; H100, job 24V), a second program costs a second read of its W
#: slice, mostly from L2. Only matters past ``MAX_M`` = 16 rows (qkv's 17-32 rows, the kernel
#: called directly, or ``MAX_M`` raised); on the chain both lost to the resident kernel (job
#: 25X, above); ``split_rows`` in ``run``'s config overrides it.
SPLIT_ROWS = {"norm": False, "add": True, "gate_up": True}   # qkv over 16 rows: one walks
#: The most weight bytes a program stages (a column block over all of K, x 2 for gate_up):
#: beyond it the call stays on small_m_resident (K = 4,096 at 32 columns would need 256 KB).
MAX_SLICE_BYTES = 128 * 1024


def fits(x, K: int, kind: str) -> bool:
    """Whether a call ``small_m_resident.fits`` also fits here (rows, shared memory).

    Args:
        x: the rows ``[M, K]``.
        K: the reduction length.
        kind: ``"norm"``, ``"add"`` or ``"gate_up"`` (``run`` derives it from its arguments).
    """
    block_n = launch(kind, K, x.shape[0])[0]
    slice_bytes = block_n * K * x.element_size() * (2 if kind == "gate_up" else 1)
    return x.shape[0] <= KIND_MAX_M.get(kind, MAX_M) and slice_bytes <= MAX_SLICE_BYTES


def launch(kind: str, K: int, M: int = 16) -> tuple[int, int, int]:
    """``(BLOCK_N, num_warps, BLOCK_M)``: ``small_m_resident.launch`` on this module's
    ``LAUNCH`` / ``LAUNCH_OVER_16``."""
    return small_m_resident.launch(kind, K, M, (LAUNCH, LAUNCH_OVER_16))


def _kernel_args(x, norm_weight, eps, weight, bias, residual, out, N, gate_up, cfg):
    # small_m_resident's arguments, plus the weight buffer's swizzle and the piece width.
    args, kwargs = small_m_resident.kernel_args(x, norm_weight, eps, weight, bias, residual,
                                                out, N, gate_up, cfg)
    ks = kwargs["KCH"] // cfg["num_warps"]
    per_phase, max_phase = swizzle(ks)
    return args, {**kwargs, "PER_PHASE": per_phase, "MAX_PHASE": max_phase,
                  "P": min(PIECE, ks)}


def row_programs(M: int, block_m: int, split_rows: bool) -> int:
    """Programs a column block's rows are shared among: one (it walks every ``block_m``-row
    block), or with ``split_rows`` one a row block."""
    return max(1, triton.cdiv(M, block_m)) if split_rows else 1


def run(x, norm_weight, eps, weight, bias, residual, out, N, *, gate_up: bool,
        config: dict | None = None):
    """One fused GEMM (``small_m_resident.run``'s arguments and result); ``config`` may
    override ``block_n``, ``num_warps``, ``block_m`` and ``split_rows``."""
    kind = kind_of(gate_up, residual)
    block_n, warps, block_m = launch(kind, x.shape[1], x.shape[0])
    cfg = {"block_n": block_n, "num_warps": warps, "block_m": block_m,
           "split_rows": SPLIT_ROWS[kind], **(config or {})}
    use_pdl = pdl.use_pdl(x.device)
    args, kwargs = _kernel_args(x, norm_weight, eps, weight, bias, residual, out, N, gate_up,
                                cfg)
    rows = row_programs(x.shape[0], cfg["block_m"], cfg["split_rows"])
    _staged_kernel[(triton.cdiv(N, cfg["block_n"]), rows)](
        *args, PDL=use_pdl, SPLIT_ROWS=rows > 1, **kwargs, **pdl.launch_kwargs(use_pdl))
    return out


def sm90_kernel(M: int, N: int, K: int, kind: str):
    """``(kernel, block_n, num_warps)``: one launch compiled for sm_90 (bf16, PDL), no GPU
    needed (``small_m_resident.sm90_kernel``'s contract)."""
    return small_m_resident.compile_call_sm90(_staged_kernel, _kernel_args, launch, M, N, K,
                                              kind)
