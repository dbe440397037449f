"""The fused decode GEMMs reshaped as the weight-stream probe: a program's weights all in flight first.

``skinny_fused`` walks K in 1024-wide steps after its norm prologue, and only its first
weight tile is loaded before the PDL wait; each of its 112 launches a step takes ~5.5-5.8
us where the bytes take ~1.9 (H200, 881 MB at batch 1: 619-654 us a chain). The probe
``scripts/probe_weight_stream_chain.py`` (job 15A) timed the simplest chain of 112 weight
streams of the same bytes, each kernel truly depending on the one before: 350 us with PDL
(3.1 us a kernel, 2.5 TB/s) when each program loads 16,384 contiguous weights before its
``griddepcontrol.wait``. The boundary costs ~1.3 us a kernel, not ~4: the rest is this
kernel's shape. So here a program:

1. loads ALL its weights at once (``BLOCK_N`` output columns x the whole K, padded to a
   power of two and masked), plus the norm weight and the bias: nothing it needs from
   memory is left for later but the activations;
2. waits for the previous kernel (PDL), lets the next one launch;
3. per row (``BLOCK_M`` <= 2, unrolled): loads x (and the residual) from L2, the RMSNorm
   in registers, one multiply-and-reduce over K, the epilogue (SiLU * up or the residual
   add), the store. Everything after the wait is a short, latency-bound tail.

Same operations and roundings as ``skinny_fused`` (the normed x, each GEMM output and
SiLU's result rounded to the activation dtype); the sums over K run in another order, so
the two agree within fp32 rounding, not bit for bit. ``ENABLED`` routes
``skinny_fused``'s entry points here (1-2 rows; a ``block_k`` override keeps the
K-stepping kernel).

Measured (H200, Qwen3-0.6B shape, dummy bf16 weights, session 15): the 28-layer GEMM chain
(``scripts/bench_skinny_fused.py --pdl --stream``) 652 -> 414 us at M = 1, 708 -> 536 at
M = 2 (job 15B); in the model, ``bench latency`` TPOT stream off / on in one job: batch 1
0.898 / 0.730 and 0.890 / 0.718 ms, batch 2 1.020 / 0.911 and 1.022 / 0.908 (15B); 0.965 /
0.736 and 0.941 / 0.718 (15E). Across 11 processes with it on, batch 1 ran 0.718-0.844 ms
(median 0.730): the step is now near the bytes, and which physical pages a process's
weights land on seems to matter (each process is steady within itself). On by default on
Hopper-class GPUs; ``MRV2_STREAM_GEMV=0`` turns it off.
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
from mrv2.platform import TRITON_INTERPRET, env_switch

#: Route the fused decode GEMMs (``skinny_fused``) here: on a GPU unless
#: ``MRV2_STREAM_GEMV=0`` (read at import; ``skinny_fused`` reads this attribute at every
#: launch, so a bench may set it). Tests set it to run the kernel in the interpreter.
ENABLED: bool = not TRITON_INTERPRET and env_switch("MRV2_STREAM_GEMV", True)
#: The most rows a launch takes: skinny_fused's rows in the model. NOTE: each row adds a
#: serial x load -> reduce -> store after the wait; at 4 and 8 rows the 28-layer chain took
#: 841 / 1,509 us against small_m_fused's 712 / 724 (job 15C), and loading the rows as one
#: [M, K] tile was slower still (493 / 798 / 1,224 us at 1 / 2 / 4 rows): so 1-2 rows only.
MAX_M = 2
#: The most weights a program holds (K padded x BLOCK_N, gate and up counted): the probe's
#: best program streamed 16,384 (32 KB) with 8 warps.
MAX_WEIGHTS = 32768
#: ... and a thread: beyond 128 the registers spill (job 15B: o_proj / down at 16 columns x
#: 4 warps took 3.2 ms a chain instead of 0.41). ``max_block_n`` caps every launch by it.
MAX_WEIGHTS_PER_THREAD = 128
#: ``"kind/M"`` (kind: ``norm``, ``add``, ``gate_up``) -> ``[BLOCK_N, num_warps]`` where a
#: measurement chose another launch than ``default_launch`` (JSON-shaped, so
#: ``scripts/bench_with.py --set`` can try one in the model).
TUNED: dict[str, list[int]] = {}


def _per_column(K: int, gate_up: bool) -> int:
    """Weights a program holds per output column: K padded, twice for gate and up."""
    return triton.next_power_of_2(K) * (2 if gate_up else 1)


def default_launch(K: int, gate_up: bool) -> tuple[int, int]:
    """(BLOCK_N, num_warps): ~16,384 weights a program (the probe's best), 8 warps."""
    per_col = _per_column(K, gate_up)
    return max(1, min(64, 16384 // per_col)), 8


def max_block_n(K: int, gate_up: bool, num_warps: int) -> int:
    """The widest launch (a power of two) whose weights stay within
    ``MAX_WEIGHTS_PER_THREAD`` a thread and ``MAX_WEIGHTS`` a program."""
    per_col = _per_column(K, gate_up)
    cap = min(MAX_WEIGHTS, MAX_WEIGHTS_PER_THREAD * 32 * num_warps) // per_col
    return max(1, 1 << (max(cap, 1).bit_length() - 1))


def fits(M: int, K: int, gate_up: bool) -> bool:
    """Whether a launch of ``M`` rows over ``K`` can hold one column's weights a program."""
    return 1 <= M <= MAX_M and _per_column(K, gate_up) <= MAX_WEIGHTS


@triton.jit
def _skinny_stream_kernel(
    x_ptr, norm_w_ptr, w_ptr, bias_ptr, residual_ptr,   # inputs: x [M, K], W [N or 2N, K]
    out_ptr,                                            # output [M, N] (may BE residual)
    M, N, K, eps,                                       # sizes (N: output columns)
    stride_xm, stride_wn, stride_rm, stride_om,         # strides (last dims contiguous)
    NORM: tl.constexpr, GATE_UP: tl.constexpr, ADD_RESIDUAL: tl.constexpr,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, PDL: tl.constexpr = False,
):
    # One program: BLOCK_N output columns over all of K (BLOCK_K >= K), for every row.
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)                   # [BN]
    k = tl.arange(0, BLOCK_K)                                                # [BK]
    n_ok = n < N
    k_ok = k < K
    dt = out_ptr.dtype.element_ty

    # 1. Everything no earlier kernel writes, at once: the weight slice(s), norm w, bias.
    w_offs = n[:, None].to(tl.int64) * stride_wn + k[None, :]                # [BN, BK]
    w_mask = n_ok[:, None] & k_ok[None, :]
    w = tl.load(w_ptr + w_offs, mask=w_mask, other=0.0)                      # [BN, BK]
    wu = w
    if GATE_UP:  # the up rows of the same columns: rows N + n of the packed weight
        wu = tl.load(w_ptr + w_offs + N * stride_wn, mask=w_mask, other=0.0)
    nw = tl.zeros([BLOCK_K], dtype=tl.float32)
    if NORM:
        nw = tl.load(norm_w_ptr + k, mask=k_ok, other=0.0).to(tl.float32)  # [BK]
    b = tl.zeros([BLOCK_N], dtype=tl.float32)
    bu = b
    if HAS_BIAS:
        b = tl.load(bias_ptr + n, mask=n_ok, other=0.0).to(tl.float32)       # [BN]
        if GATE_UP:
            bu = tl.load(bias_ptr + N + n, mask=n_ok, other=0.0).to(tl.float32)

    # 2. The previous kernel has completed (x, the residual are its outputs). NOTE: every
    # program waits, no early return: a later kernel's wait covers this one's predecessors.
    if PDL and GDC_CALLS:
        gdc_wait()
        gdc_launch_dependents()

    # 3. Per row: x, the norm, one reduce over K, the epilogue.
    for row in tl.static_range(BLOCK_M):
        if row < M:
            x = tl.load(x_ptr + row * stride_xm + k, mask=k_ok, other=0.0).to(tl.float32)
            if NORM:
                rstd = tl.math.rsqrt(row_sum(x * x, axis=0) / K + eps)
                # NOTE: rounded to x's dtype, as the unfused rms_norm writes it.
                x = ((x * rstd) * nw).to(dt).to(tl.float32)              # [BK]
            acc = row_sum(w.to(tl.float32) * x[None, :], axis=1)         # [BN]
            acc_up = acc
            if GATE_UP:
                acc_up = row_sum(wu.to(tl.float32) * x[None, :], axis=1)
            if HAS_BIAS:
                acc += b
                if GATE_UP:
                    acc_up += bu
            y = _round_product_body(acc, acc_up, dt, GATE_UP)               # [BN]
            # skinny_fused's epilogue, on this row as a [1, BN] tile (+ residual, store)
            _store_body(y[None, :], out_ptr, residual_ptr, row + tl.arange(0, 1), n,
                        n_ok[None, :], stride_rm, stride_om, ADD_RESIDUAL)


def pick_launch(M: int, N: int, K: int, kind: str, block_n: int | None = None,
                num_warps: int | None = None) -> tuple[int, int]:
    """(BLOCK_N, num_warps) of a launch: the overrides, else ``TUNED["kind/M"]``, else
    ``default_launch``; on the GPU capped by ``max_block_n``.

    Args:
        M, N, K: rows, output columns, reduction length; kind: ``norm``, ``add`` or
            ``gate_up``; block_n, num_warps: overrides.
    """
    gate_up = kind == "gate_up"
    bn, nw = TUNED.get(f"{kind}/{M}", default_launch(K, gate_up))
    if TRITON_INTERPRET:  # NOTE: the interpreter pays per program: few wide programs
        bn = max(bn, min(64, triton.next_power_of_2(N)))
    bn, nw = block_n or bn, num_warps or nw
    if not TRITON_INTERPRET:
        bn = min(bn, max_block_n(K, gate_up, nw))
    return bn, nw


def run(x: torch.Tensor, norm_weight: torch.Tensor | None, eps: float, weight: torch.Tensor,
        bias: torch.Tensor | None, residual: torch.Tensor | None, out: torch.Tensor, N: int,
        *, gate_up: bool, block_n: int | None = None, num_warps: int | None = None
        ) -> torch.Tensor:
    """Launch the stream kernel for ``skinny_fused``'s three entry points (arguments checked
    there): ``out = x @ W.T`` with the norm prologue (``norm_weight``), the SiLU * up
    epilogue (``gate_up``: W packed ``[2N, K]``) or ``out = residual + x @ W.T``.

    Args:
        x: ``[M, K]``, M <= ``MAX_M``; weight ``[N or 2N, K]``; out ``[M, N]``.
        block_n, num_warps: launch overrides (else ``TUNED``, else ``default_launch``).

    Returns:
        ``out``.
    """
    M, K = x.shape
    if M == 0 or N == 0:
        return out
    kind = "gate_up" if gate_up else "add" if residual is not None else "norm"
    bn, nw = pick_launch(M, N, K, kind, block_n, num_warps)
    use_pdl = pdl.use_pdl(x.device)
    opts = {} if TRITON_INTERPRET else {"num_warps": nw}
    opts.update(pdl.launch_kwargs(use_pdl))
    r = residual if residual is not None else out                # unused without the add
    _skinny_stream_kernel[(triton.cdiv(N, bn),)](
        x, norm_weight if norm_weight is not None else x, weight,
        bias if bias is not None else weight, r,
        out,
        M, N, K, float(eps),
        x.stride(0), weight.stride(0), r.stride(0), out.stride(0),
        NORM=norm_weight is not None, GATE_UP=gate_up, ADD_RESIDUAL=residual is not None,
        HAS_BIAS=bias is not None, BLOCK_M=triton.next_power_of_2(M), BLOCK_N=bn,
        BLOCK_K=triton.next_power_of_2(K), PDL=use_pdl, **opts)
    return out
