"""A decode layer's tail in ONE persistent kernel: o_proj + add, gate_up + SiLU, down + add, next qkv.

At batch 1 the fused decode layer (``mrv2.kernels.skinny_fused``) still pays a kernel
boundary per weight stream, ~4 us each beyond its bytes (28 layers x 4 GEMMs: 654 us for
881 MB with PDL, job Y): a grid must drain, complete and flush before the next one's
``gdc_wait`` lets it read, and the next grid cannot be resident early because the weight
stream's grid fills the SMs. This kernel runs the four GEMMs that follow attention as four
STAGES of one launch whose programs all stay resident (the grid is sized from the compiled
kernel's occupancy) and meet at a grid barrier between stages:

    stage A   h   += attn @ W_o.T                        (o_proj, residual add)
    stage B   act  = silu(g) * u, [g | u] = rms_norm(h) @ W_gu.T      (post-attention norm)
    stage C   h   += act @ W_down.T                      (down_proj, residual add)
    stage D   qkv' = rms_norm'(h) @ W_qkv'.T             (the NEXT layer's input norm + qkv)

so a layer is two launches (attention, this) instead of five. Each program walks column
blocks ``pid, pid + G, ...`` of a stage; the stage code is ``skinny_fused``'s weight stream
and rounds where the unfused path rounds (the normed x, each product, SiLU, the sums), so
the result equals the per-GEMM kernels' (bitwise on the H200 at 1 and 2 rows, job C).

The grid barrier: every program's threads finish their stores (``debug_barrier``), one
thread adds 1 to its slot's counter (``BARRIER["slots"]`` counters on their own 128-byte
lines: same-address atomics serialise at one L2 slice), the slot's last arrival adds 1 to
the master counter with release semantics, and one thread a program polls the master
with acquire loads until every slot arrived (barrier b waits for ``b * slots``).
Activations written by other programs are read with ``.cg`` (L2, not a stale L1 line). On
the way out each program arrives once more; the last of a slot resets the slot, the last
of all the master, for the next launch. NOTE: a barrier needs every program resident at
once: ``_grid`` sizes G from the compiled kernel's registers, shared memory and warps, and
the kernel lets the next launch start (PDL) only after its last barrier (PDL starts a
dependent grid only once every program of this one has asked for it), so no waiting grid
takes a slot it needs.

Measured, and why it is OFF by default (H200, Qwen3-0.6B shapes, bf16, M = 1,
``scripts/bench_skinny_fused.py --persistent --persistent-sweep``, 28 layers' 881 MB):
the per-GEMM PDL chain 654 us, this kernel 745-779 us at its best grid (1,056 programs,
8 a SM; 132 programs: 1,210 us, 528: 812), 808 us with one counter instead of 32 slots,
no gain from sleeping in the poll. In the model (``bench latency``) TPOT at batch 1 went
0.914 -> 1.035 ms and batch 2 1.030 -> 1.085. A grid barrier over a full grid costs about
what a PDL kernel boundary costs (~3-4 us), and the stages lose PDL's trick of loading the
first weight tile before the wait. Asking the next stage's weights into L2
(``cp.async.bulk.prefetch.L2``) before each barrier made it slower still (779 vs 745 us),
as it made the per-GEMM chain (685 vs 654 us; TPOT b1 0.918 -> 0.955 ms): at batch 1 the
boundary, not DRAM, is the cost. Beating the per-kernel chain needs fewer sync points a
layer or warp-specialised weight streaming that does not stop at them.
NOTE (session 14, job 14D, ``bench_latency_persistent*_job14D.json``): loading each stage's
first weight tile into registers BEFORE the barrier that opens it (PDL's trick, one
``[4, 1024]`` tile a program, used for the stage's first K step) made it slower again: TPOT b1
1.020 -> 1.067 ms, b2 1.093 -> 1.164 (per-GEMM kernels 0.891-0.934 / 1.022-1.028, one job).
Not examined further; a likely cause is the held tiles' registers: the grid is sized from the
registers, so fewer programs are resident and more of them walk a second column block.

Under the interpreter (programs run one after another, a barrier would never open), off
sm_90+ CUDA devices and with ``STAGED`` set (tests) the same kernel runs one stage per
launch (``STAGE`` = 0-3): the GPU test checks the persistent launch is bitwise that. For 1-2 rows (``skinny_fused``'s
range), on sm_90+ GPUs; the torch reference is the chain of skinny_fused references.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from mrv2.kernels import attention, pdl, skinny_fused
from mrv2.kernels.fused_epilogue import _round_product_body
from mrv2.kernels.layernorm import row_sum
from mrv2.kernels.pdl import GDC_CALLS
from mrv2.platform import TRITON_INTERPRET, env_switch, interpreter_body

#: The model's 1-2-row decode takes it (GPU) with ``MRV2_PERSISTENT_DECODE=1``: OFF by
#: default, it is slower than the per-GEMM kernels (above). Tests set it under the
#: interpreter, where ``layer_tail`` runs its stages one launch each.
ENABLED: bool = env_switch("MRV2_PERSISTENT_DECODE", False) and not TRITON_INTERPRET
#: Tests set it to run the stages one launch each on the GPU too (the persistent launch's
#: bitwise reference).
STAGED: bool = False
#: The most rows: skinny_fused's (the activation rows live in registers).
MAX_M = skinny_fused.MODEL_MAX_M


def layer_tail_ref(attn, h, wo, ln2_w, eps, w_gate_up, w_down, next_ln1_w=None,
                   next_eps=0.0, next_w_qkv=None):
    """Reference of :func:`layer_tail`: the four fused GEMMs' references, in order."""
    skinny_fused.skinny_linear_add_ref(attn, wo, h)
    act = skinny_fused.skinny_norm_gate_up_silu_ref(h, ln2_w, eps, w_gate_up)
    skinny_fused.skinny_linear_add_ref(act, w_down, h)
    if next_w_qkv is None:
        return None
    return skinny_fused.skinny_norm_linear_ref(h, next_ln1_w, next_eps, next_w_qkv)


@triton.jit
def _gemm_stage(x_ptr, stride_xm, norm_w_ptr, w_ptr, stride_wn, out_ptr, stride_om, M, N, K,
                eps, pid, G, NORM: tl.constexpr, GATE_UP: tl.constexpr, ADD: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # out[:, blocks pid, pid + G, ...] = (norm(x) @ W.T) (+ out, SiLU * up): skinny_fused's
    # numerics. x / out are read .cg: other programs wrote them before the last barrier.
    m = tl.arange(0, BLOCK_M)                                                # [BM]
    kk = tl.arange(0, BLOCK_K)                                               # [BK]
    m_mask = m < M
    dt = out_ptr.dtype.element_ty
    rstd = tl.full([BLOCK_M], 1.0, tl.float32)                               # [BM]
    if NORM:  # each row's inverse RMS over all of K (x is <= 2 x hidden: cheap to repeat)
        sq = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + kk
            x = tl.load(x_ptr + m[:, None] * stride_xm + k[None, :], cache_modifier=".cg",
                        mask=m_mask[:, None] & (k < K)[None, :], other=0.0).to(tl.float32)
            sq += x * x
        rstd = tl.math.rsqrt(row_sum(sq, axis=1) / K + eps)                  # [BM]
    for blk in range(pid, tl.cdiv(N, BLOCK_N), G):
        n = blk * BLOCK_N + tl.arange(0, BLOCK_N)                            # [BN]
        n_mask = n < N
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + kk
            x = tl.load(x_ptr + m[:, None] * stride_xm + k[None, :], cache_modifier=".cg",
                        mask=m_mask[:, None] & (k < K)[None, :], other=0.0).to(tl.float32)
            if NORM:  # NOTE: rounded to x's dtype, as the unfused rms_norm writes it
                nw = tl.load(norm_w_ptr + k, mask=k < K, other=0.0).to(tl.float32)
                x = ((x * rstd[:, None]) * nw[None, :]).to(dt).to(tl.float32)
            w_offs = n[:, None].to(tl.int64) * stride_wn + k[None, :]        # [BN, BK]
            w_mask = n_mask[:, None] & (k < K)[None, :]
            w = tl.load(w_ptr + w_offs, mask=w_mask, other=0.0).to(tl.float32)
            acc += row_sum(w[None, :, :] * x[:, None, :], axis=2)            # [BM, BN]
            if GATE_UP:  # the up rows of the same columns: rows N + n of the packed weight
                wu = tl.load(w_ptr + w_offs + N * stride_wn, mask=w_mask, other=0.0)
                acc_up += row_sum(wu.to(tl.float32)[None, :, :] * x[:, None, :], axis=2)
        y = _round_product_body(acc, acc_up, dt, GATE_UP)                    # [BM, BN]
        o_offs = m[:, None] * stride_om + n[None, :]
        o_mask = m_mask[:, None] & n_mask[None, :]
        if ADD:  # NOTE: in place, race-free: each element is read and written by one program
            y += tl.load(out_ptr + o_offs, mask=o_mask, other=0.0,
                         cache_modifier=".cg").to(tl.float32)
        tl.store(out_ptr + o_offs, y.to(dt), mask=o_mask)


@triton.jit
def _nanosleep(ns: tl.constexpr):
    tl.inline_asm_elementwise(f"nanosleep.u32 {ns}; mov.u32 $0, 0;", "=r", [], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _arrive(cnt_ptr, count, pid, G, SLOTS: tl.constexpr):
    # One arrival of this program (its ``count``-th), counted on its slot's counter; the
    # slot's last arrival of that round carries the slot's to the master counter. Slots
    # spread the same-address atomics (serialised at one L2 slice) over SLOTS lines.
    if SLOTS == 1:
        tl.atomic_add(cnt_ptr, 1, sem="release", scope="gpu")
    else:
        s = pid % SLOTS
        n_s = (G - s + SLOTS - 1) // SLOTS                  # the programs of slot s
        if tl.atomic_add(cnt_ptr + 32 * (1 + s), 1, sem="acq_rel", scope="gpu") == \
                count * n_s - 1:
            tl.atomic_add(cnt_ptr, 1, sem="release", scope="gpu")


@triton.jit
def _grid_barrier(cnt_ptr, b, pid, G, SLOTS: tl.constexpr, SLEEP: tl.constexpr):
    # The b-th barrier: all of this program's stores issued, one release arrival (through
    # its slot), then ONE thread polls the master counter with acquire loads.
    tl.debug_barrier()
    _arrive(cnt_ptr, b, pid, G, SLOTS)
    target = b * (G if SLOTS == 1 else tl.minimum(G, SLOTS))
    # NOTE: an acquire atomic add of 0 lowers to one thread's ld.acquire, broadcast.
    while tl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu") < target:
        if SLEEP > 0:
            _nanosleep(SLEEP)
    tl.debug_barrier()


_stage_body = interpreter_body(_gemm_stage)


@triton.jit
def _layer_tail_kernel(
    attn_ptr, h_ptr, act_ptr, qkv_ptr,                  # activations [M, A] [M, H] [M, I] [M, Q]
    wo_ptr, ln2_ptr, wgu_ptr, wd_ptr, ln1n_ptr, wqkv_ptr,  # weights [H, A] [H] [2I, H] ...
    cnt_ptr,                                            # the grid barrier's counter (int32)
    M, H, A, I, Q, eps, eps_next,                       # sizes; the two norms' eps
    s_attn, s_h, s_act, s_qkv,                          # activation row strides
    s_wo, s_wgu, s_wd, s_wqkv,                          # weight row strides
    STAGE: tl.constexpr, HAS_NEXT: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
    SLOTS: tl.constexpr = 1, SLEEP: tl.constexpr = 0,
):
    # STAGE -1: all stages with grid barriers between them; 0-3: only that one (no barrier).
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    ALL: tl.constexpr = STAGE < 0
    if ALL and PDL and GDC_CALLS:
        gdc_wait()  # NOTE: dependents are let go only after the last barrier (see above)
    if ALL or STAGE == 0:
        _stage_body(attn_ptr, s_attn, ln2_ptr, wo_ptr, s_wo, h_ptr, s_h, M, H, A, eps, pid, G,
                    False, False, True, BLOCK_M, BLOCK_N, BLOCK_K)
    if ALL:
        _grid_barrier(cnt_ptr, 1, pid, G, SLOTS, SLEEP)
    if ALL or STAGE == 1:
        _stage_body(h_ptr, s_h, ln2_ptr, wgu_ptr, s_wgu, act_ptr, s_act, M, I, H, eps, pid, G,
                    True, True, False, BLOCK_M, BLOCK_N, BLOCK_K)
    if ALL:
        _grid_barrier(cnt_ptr, 2, pid, G, SLOTS, SLEEP)
    if ALL or STAGE == 2:
        _stage_body(act_ptr, s_act, ln2_ptr, wd_ptr, s_wd, h_ptr, s_h, M, H, I, eps, pid, G,
                    False, False, True, BLOCK_M, BLOCK_N, BLOCK_K)
    if HAS_NEXT:
        if ALL:
            _grid_barrier(cnt_ptr, 3, pid, G, SLOTS, SLEEP)
        if ALL or STAGE == 3:
            _stage_body(h_ptr, s_h, ln1n_ptr, wqkv_ptr, s_wqkv, qkv_ptr, s_qkv, M, Q, H,
                        eps_next, pid, G, True, False, False, BLOCK_M, BLOCK_N, BLOCK_K)
    if ALL:
        if PDL and GDC_CALLS:
            gdc_launch_dependents()   # every program has passed every barrier: safe now
        # The way out: one more round of arrivals; the last of each slot resets its slot's
        # counter, the last of all the master, for the next launch (no one reads them now).
        N_BARRIERS: tl.constexpr = 3 if HAS_NEXT else 2
        if SLOTS > 1:
            s = pid % SLOTS
            slot = cnt_ptr + 32 * (1 + s)
            if tl.atomic_add(slot, 1, sem="acq_rel", scope="gpu") == \
                    (N_BARRIERS + 1) * ((G - s + SLOTS - 1) // SLOTS) - 1:
                tl.atomic_xchg(slot, 0, sem="relaxed", scope="gpu")
                if tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu") == \
                        (N_BARRIERS + 1) * tl.minimum(G, SLOTS) - 1:
                    tl.atomic_xchg(cnt_ptr, 0, sem="relaxed", scope="gpu")
        else:
            if tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu") == \
                    (N_BARRIERS + 1) * G - 1:
                tl.atomic_xchg(cnt_ptr, 0, sem="relaxed", scope="gpu")


# ------------------------------------------------------------------ launch

#: (BLOCK_N, BLOCK_K, num_warps): skinny_fused's M = 1 launch (4 columns, 1024-wide K steps).
LAUNCH = (4, 1024, 4)
#: The most programs a SM runs (the occupancy cap; more programs = fewer blocks each).
MAX_PROGRAMS_PER_SM = 8
#: The grid barrier: arrivals spread over ``slots`` counters (1: one counter for all), and
#: the poll's ``sleep`` (ns, 0: none) between reads.
BARRIER = {"slots": 32, "sleep": 0}
MAX_SLOTS = 64

_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _counter(device: torch.device) -> torch.Tensor:
    """The zeroed barrier counter every launch leaves zeroed (allocated outside capture)."""
    buf = _COUNTERS.get(device)
    if buf is None:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("layer_tail's barrier counter must be allocated before "
                               "CUDA-graph capture (run one eager step first)")
        # the master counter at 0, slot s at 32 * (1 + s): each on its own 128-byte line
        buf = _COUNTERS[device] = torch.zeros(32 * (1 + MAX_SLOTS), dtype=torch.int32,
                                              device=device)
    return buf


def programs_per_sm(n_regs: int, shared: int, num_warps: int) -> int:
    """How many programs of a kernel one H100/H200 SM holds at once (sm_90 limits: 64K
    registers allocated 256 a warp, 2048 threads, 32 blocks, 227 KB shared + 1 KB each).

    Args:
        n_regs: registers a thread (ptxas); shared: bytes a program; num_warps: a program's.

    Returns:
        The resident programs a SM, capped at ``MAX_PROGRAMS_PER_SM``.
    """
    regs_per_warp = triton.cdiv(max(n_regs, 1) * 32, 256) * 256
    by_regs = 65536 // (regs_per_warp * num_warps)
    by_threads = 2048 // (32 * num_warps)
    by_smem = (233472 // (shared + 1024)) if shared else 32
    return max(0, min(by_regs, by_threads, by_smem, 32, MAX_PROGRAMS_PER_SM))


def layer_tail(attn: torch.Tensor, h: torch.Tensor, wo: torch.Tensor, ln2_w: torch.Tensor,
               eps: float, w_gate_up: torch.Tensor, w_down: torch.Tensor,
               next_ln1_w: torch.Tensor | None = None, next_eps: float = 0.0,
               next_w_qkv: torch.Tensor | None = None) -> torch.Tensor | None:
    """o_proj + add, norm + gate_up + SiLU * up, down + add (and the next layer's norm + qkv)
    for 1-2 decode rows, as one persistent launch (stage by stage where it cannot be).

    Args:
        attn: ``[M, A]`` attention output (M <= 2); h: ``[M, H]`` the residual stream,
            UPDATED IN PLACE; wo: ``[H, A]``; ln2_w: ``[H]`` the post-attention norm,
            eps its epsilon; w_gate_up: ``[2I, H]`` packed; w_down: ``[H, I]``.
        next_ln1_w, next_eps, next_w_qkv: the next layer's input norm and packed
            ``[Q, H]`` qkv weight, or None for the last layer.

    Returns:
        The next layer's ``[M, Q]`` qkv, or None without ``next_w_qkv``.

    Raises:
        ValueError: shapes, dtypes or layouts the kernel does not take.
    """
    M, A = attn.shape
    H = h.shape[1]
    inter = w_gate_up.shape[0] // 2
    has_next = next_w_qkv is not None
    for name, t, shape in (("attn", attn, (M, A)), ("h", h, (M, H)), ("wo", wo, (H, A)),
                           ("ln2_w", ln2_w, (H,)), ("w_gate_up", w_gate_up, (2 * inter, H)),
                           ("w_down", w_down, (H, inter))) + (
            (("next_ln1_w", next_ln1_w, (H,)), ("next_w_qkv", next_w_qkv,
                                                (next_w_qkv.shape[0], H))) if has_next else ()):
        if t is None or tuple(t.shape) != shape or t.dtype != h.dtype or t.stride(-1) != 1:
            got = None if t is None else (tuple(t.shape), t.dtype)
            raise ValueError(f"layer_tail: {name} must be {shape} in {h.dtype}, last dim "
                             f"contiguous; got {got}")
    if not 1 <= M <= MAX_M:
        raise ValueError(f"layer_tail takes 1-{MAX_M} rows, got {M}")
    if not 1 <= BARRIER["slots"] <= MAX_SLOTS or BARRIER["sleep"] < 0:
        raise ValueError(f"persistent_layer.BARRIER needs 1-{MAX_SLOTS} slots and a sleep "
                         f">= 0 ns, got {BARRIER}")
    act = torch.empty(M, inter, dtype=h.dtype, device=h.device)
    Q = next_w_qkv.shape[0] if has_next else 1
    qkv = torch.empty(M, Q, dtype=h.dtype, device=h.device)
    bn, bk, nw = LAUNCH
    if TRITON_INTERPRET:
        bn, bk, nw = 64, 128, 1             # NOTE: the interpreter pays per program
    persistent = not STAGED and h.is_cuda and pdl.sm90_or_newer(h.device)
    wq = next_w_qkv if has_next else wo
    args = [attn, h, act, qkv, wo, ln2_w, w_gate_up, w_down,
            next_ln1_w if has_next else ln2_w, wq, _counter(h.device) if persistent else h,
            M, H, A, inter, Q, float(eps), float(next_eps),
            attn.stride(0), h.stride(0), act.stride(0), qkv.stride(0),
            wo.stride(0), w_gate_up.stride(0), w_down.stride(0), wq.stride(0)]
    const = {"HAS_NEXT": has_next, "BLOCK_M": max(1, triton.next_power_of_2(M)),
             "BLOCK_N": bn, "BLOCK_K": bk}
    opts = {} if TRITON_INTERPRET else {"num_warps": nw}
    if not persistent:
        for stage in range(3 + has_next):
            _layer_tail_kernel[(triton.cdiv([H, inter, H, Q][stage], bn),)](
                *args, STAGE=stage, PDL=False, **const, **opts)
        return qkv if has_next else None
    use_pdl = pdl.use_pdl(h.device)
    grid = _grid(h.device, nw, args, const, use_pdl)
    _layer_tail_kernel[(grid,)](*args, STAGE=-1, PDL=use_pdl, SLOTS=BARRIER["slots"],
                                SLEEP=BARRIER["sleep"], **const, **opts,
                                **pdl.launch_kwargs(use_pdl))
    return qkv if has_next else None


_GRIDS: dict[tuple, int] = {}


def _grid(device, nw, args, const, use_pdl) -> int:
    """The persistent grid: every program resident at once (from the compiled kernel)."""
    key = (device, nw, use_pdl, tuple(sorted(const.items())), args[1].dtype,
           tuple(BARRIER.items()))
    if key not in _GRIDS:
        kernel = _layer_tail_kernel.warmup(
            *args, STAGE=-1, PDL=use_pdl, SLOTS=BARRIER["slots"], SLEEP=BARRIER["sleep"],
            **const, num_warps=nw, grid=(1,),
            **pdl.launch_kwargs(use_pdl))
        kernel.run  # noqa: B018  (loads the binary: n_regs is known only then)
        per_sm = programs_per_sm(kernel.n_regs, kernel.metadata.shared, nw)
        if per_sm < 1:
            raise RuntimeError(f"layer_tail: {kernel.n_regs} registers a thread leave no "
                               "room for one program a SM")
        _GRIDS[key] = per_sm * attention._num_sms()
    return _GRIDS[key]
