"""L2 prefetch of the NEXT kernel's weights: keep the DRAM stream busy across kernel boundaries.

At batch 1 a decode layer is four weight streams (qkv, o_proj, gate_up, down: 31.5 MB at
Qwen3-0.6B's shape, ~7.5 us at the H200's 4.2 TB/s) with small kernels between them, and
the chain of them ran at ~35% of the bandwidth (``scripts/bench_skinny_fused.py``: 619 us
for 28 layers' 881 MB). A skinny GEMM program holds its registers while its weight tile is
in flight, the grid fills the SMs, so the next kernel cannot start until this one drains
(``mrv2.kernels.pdl``): each boundary is a ramp where DRAM idles.

The weights do not depend on anything a kernel computes, so a kernel can ask for the next
one's weights as soon as it starts: ``cp.async.bulk.prefetch.L2.global [addr], size``
(sm_90, PTX 8.0) is fire-and-forget, holds no register and no shared memory, and moves
``size`` bytes from DRAM into L2 (50 MB on the H200; the largest weight a decode layer reads
is gate_up's 12.6 MB). Kernel i then runs from L2 while DRAM streams kernel i+1's weights.

The layout of the work: every thread of every program of the CURRENT kernel issues at most
one bulk prefetch of ``chunk`` bytes; thread ``j`` of program ``p`` takes bytes
``[(p * threads + j) * chunk, ... + chunk)`` of the next weight (``plan`` picks ``chunk`` so
the grid covers all of it; the last chunk is cut at the end and rounded down to 16 bytes).

A prefetch is only a hint: results are bit-identical with it on or off (GPU test), and it
reads only weights, so it may be issued before a PDL kernel's ``gdc_wait``. Under the
interpreter (no inline asm) and without a CUDA sm_90 device it is compiled out
(``PREFETCH=False``). ``MRV2_L2_PREFETCH=0`` turns it off.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mrv2.kernels import pdl
from mrv2.platform import TRITON_INTERPRET, env_switch

#: On unless ``MRV2_L2_PREFETCH=0`` (and never under the interpreter).
ENABLED: bool = env_switch("MRV2_L2_PREFETCH", True) and not TRITON_INTERPRET

#: The smallest chunk one thread asks for: two 128-byte L2 lines (a power of two >= 16).
MIN_CHUNK = 256


def plan(nbytes: int, programs: int, threads: int) -> int:
    """The chunk (bytes, a power of two >= ``MIN_CHUNK``) each of ``programs * threads``
    threads prefetches so that together they cover ``nbytes``.

    Args:
        nbytes: the size of the tensor to prefetch; programs: the current kernel's grid
            size (all its programs, over every grid axis); threads: its threads a program (``32 * num_warps``).

    Returns:
        ``chunk`` with ``programs * threads * chunk >= nbytes``.
    """
    if nbytes < 0 or programs <= 0 or threads <= 0:
        raise ValueError(f"plan needs nbytes >= 0 and programs, threads > 0, got "
                         f"{nbytes}, {programs}, {threads}")
    return max(MIN_CHUNK, triton.next_power_of_2(triton.cdiv(nbytes, programs * threads)))


def chunks_ref(nbytes: int, programs: int, threads: int) -> list[tuple[int, int]]:
    """What :func:`prefetch_next` issues, as ``(offset, size)`` pairs in issue order (the
    reference the tests check coverage on): one a thread, empty ones dropped."""
    chunk = plan(nbytes, programs, threads)
    out = []
    for t in range(programs * threads):
        off = t * chunk
        size = min(nbytes - off, chunk) // 16 * 16
        if size > 0:
            out.append((off, size))
    return out


def prefetch_args(weight: torch.Tensor | None, programs: int, num_warps: int,
                  unused: torch.Tensor) -> dict:
    """The kernel arguments for prefetching ``weight`` from a launch of ``programs``
    programs of ``num_warps`` warps: ``pf_ptr``, ``PF_BYTES``, ``PF_CHUNK``, ``PREFETCH``.

    Off (``PREFETCH=False``, ``pf_ptr`` = ``unused``, any tensor of the launch) when
    ``weight`` is None, prefetch is disabled, the device is not CUDA sm_90+, or the weight
    is not one contiguous 16-byte-aligned block. Reads only metadata: graph-safe.
    """
    on = (ENABLED and weight is not None and weight.is_contiguous()
          and weight.numel() > 0 and weight.data_ptr() % 16 == 0 and pdl.sm90_or_newer(weight.device))
    if not on:
        return {"pf_ptr": unused, "PF_BYTES": 0, "PF_CHUNK": MIN_CHUNK, "PREFETCH": False}
    nbytes = weight.numel() * weight.element_size()
    return {"pf_ptr": weight, "PF_BYTES": nbytes,
            "PF_CHUNK": plan(nbytes, programs, 32 * num_warps), "PREFETCH": True}


@triton.jit
def _bulk_prefetch_l2(addr, nbytes):
    # One `cp.async.bulk.prefetch.L2` a lane, skipped (predicate) where nbytes <= 0.
    return tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; "
        "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [addr, nbytes], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def prefetch_next(pf_ptr, PF_BYTES, PF_CHUNK: tl.constexpr, THREADS: tl.constexpr):
    """Issue this program's share of the L2 prefetch of ``PF_BYTES`` bytes at ``pf_ptr``
    (``THREADS`` = the program's threads, one chunk each). Call under ``if PREFETCH:``."""
    pid = tl.program_id(0) + tl.program_id(1) * tl.num_programs(0)          # a 1-D or 2-D grid
    t = pid * THREADS + tl.arange(0, THREADS)                               # [THREADS]
    off = t.to(tl.int64) * PF_CHUNK                                         # bytes
    size = tl.minimum(PF_BYTES - off, PF_CHUNK).to(tl.int32) // 16 * 16     # <= 0: none
    _bulk_prefetch_l2(pf_ptr.to(tl.pointer_type(tl.int8)) + off, size)


