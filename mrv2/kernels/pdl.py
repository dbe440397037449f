"""Programmatic dependent launch (PDL): a kernel's prologue overlaps the previous kernel's tail.

At batch 1 every decode kernel pays a fixed ramp (launch, first loads in flight) that the
previous kernel's tail does not hide (``../shared/PLATFORM.md``, decode-sized GEMMs). On
Hopper (sm_90+) a kernel launched with the PDL attribute may start while the kernel before
it in the stream is still running: it issues loads that cannot depend on that kernel (its
weights), then blocks in ``griddepcontrol.wait`` until the previous grid has COMPLETED and
its writes are visible, then reads its activations. The previous kernel lets it start early
with ``griddepcontrol.launch_dependents``.

What Triton 3.6.0 (the H200 machine's) offers, read in its wheel:

* ``triton/language/extra/cuda/gdc.py``: ``gdc_wait()`` and ``gdc_launch_dependents()``,
  inline PTX (``griddepcontrol.wait`` / ``.launch_dependents``), both harmless in a kernel
  launched without PDL. The same names and module in Triton 3.9.
* ``triton/backends/nvidia/compiler.py``: ``CUDAOptions.launch_pdl`` (default False), so
  ``kernel[grid](..., launch_pdl=True)`` is a compile option (its own cache entry, recorded
  in the kernel's metadata); no ``num_ctas`` or other option needed.
* ``triton/backends/nvidia/driver.py``: the launcher calls ``cuLaunchKernelEx`` with
  ``CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 1`` when ``metadata.launch_pdl``.
  That is an ordinary stream launch, so torch's CUDA-graph stream capture records it: since
  CUDA 12.3 capture turns the attribute into a programmatic graph edge
  (``CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC``), and Triton's tutorial 11 times PDL under
  ``do_bench_cudagraph``. Measured here (job X): the replayed decode graph got faster with it
  (batch 1, ``bench decode``: wall 1.088 -> 0.940 ms a step), so capture keeps the overlap; the
  GPU tests check that the outputs are bitwise those without it.
* ``triton/runtime/interpreter.py``: inline asm raises NotImplementedError and unknown launch
  kwargs are dropped, so kernels take a ``PDL: tl.constexpr`` and skip the calls when False
  (and when ``GDC_CALLS`` is False: under the interpreter).

The contract every kernel launched with PDL keeps: before ``gdc_wait`` it reads only what no
earlier kernel writes (weights) and writes nothing; every program calls ``gdc_wait`` (before
any early return), so waits chain: kernel i+2's wait covers kernel i too. A kernel launched WITHOUT the
attribute needs nothing: the stream serialises it as always.
NOTE: reading weights before the wait assumes no kernel right before writes them: true of
the model (weights are written once, at load); a caller that updates a weight in place and
then launches one of these kernels at once must leave PDL off.
NOTE: ``decode_attention.PREFETCH`` (opt-in, unmeasured) widens the contract by one step: its
loads before the wait are the step's metadata and the cached keys, written by kernels at
least two launches back. Those have completed when it starts (the kernel right before it
passed its own wait first, or was launched without PDL), so L2 holds their writes; the
loads bypass L1 (``.cg``), which could still hold a line of the previous step's metadata.

The kernels that take it, so that every pair of neighbours in a decode layer overlaps:
``skinny_fused`` (its first weight tile, norm weight and bias are loaded before the wait),
``skinny_stream`` (ALL of a program's weights before the wait: the shape PDL rewards),
``rotary.qk_norm_rope``, ``attention.paged_attention`` and its split merge (all their inputs
come from earlier kernels: they wait at the start and gain the launch overlap only). With
``PDL=False`` each compiles to the same PTX and SASS as before (Triton 3.6, sm_90, checked
through the JIT's own specialisation without a GPU); PDL=True costs registers only in
``skinny_fused`` (M = 1: qkv 40 -> 62, o / down 40 -> 48, gate_up 54 -> 66; M = 2: qkv 64 ->
80, gate_up 90 -> 111); attention (112), merge (25) and RoPE (40) are unchanged.

On by default since job X (session 6, H200, Qwen3-0.6B shape): TPOT at batch 1 went 1.059 ->
0.893 ms with it, batch 8 1.320 -> 1.293, batch 32 1.505 -> 1.502 (at batch 32 the products are
cuBLAS's, launched without the attribute, so only attention and its merge overlap). The GEMM-only
chain (``scripts/bench_skinny_fused.py --pdl``, 28 layers) is *not* faster with it at M = 1
(654 vs 619 us, job Y; 715 vs 729 at M = 2): back-to-back weight streams whose grids fill every
SM leave the next kernel no room to start early. The gain is at the small kernels between the
products (RoPE, attention, the merge), whose launches now hide behind their neighbours.
``MRV2_PDL=0`` turns it off (read at import); never under the interpreter, and only on
devices of compute capability 9.0 or newer (``griddepcontrol`` is sm_90 PTX).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping

import torch
import triton.language as tl

from mrv2.platform import TRITON_INTERPRET, env_switch


def pdl_switch(environ: Mapping[str, str], interpret: bool) -> bool:
    """Whether PDL is on: ``MRV2_PDL`` unset or ``1`` (``0`` turns it off) and Triton
    compiles (not ``interpret``).

    Raises:
        ValueError: ``MRV2_PDL`` is set to anything but ``0`` or ``1``.
    """
    return env_switch("MRV2_PDL", True, environ) and not interpret


#: On unless ``MRV2_PDL=0``, on a compiling Triton; tests set it to force PDL on or off.
PDL_ENABLED: bool = pdl_switch(os.environ, TRITON_INTERPRET)

#: Kernels guard their ``gdc_*`` calls with this global constexpr as well as their ``PDL``
#: one, so the interpreter (tests, with ``use_pdl`` forced) runs the PDL path's prefetch and
#: peeled first step without the inline asm it cannot run.
GDC_CALLS = tl.constexpr(not TRITON_INTERPRET)


@functools.cache
def _sm90_or_newer(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def sm90_or_newer(device: torch.device) -> bool:
    """Whether ``device`` is a CUDA device of compute capability >= 9.0 (Hopper's PTX:
    ``griddepcontrol``, the persistent layer tail); asked once per device, so graph- and sync-safe."""
    return device.type == "cuda" and _sm90_or_newer(
        device.index if device.index is not None else torch.cuda.current_device())


def use_pdl(device: torch.device) -> bool:
    """Whether a launch on ``device`` takes PDL: ``PDL_ENABLED`` and a CUDA device of compute
    capability >= 9.0 (asked once per device, so graph- and sync-safe).

    Args:
        device: the device of the launch's tensors.

    Returns:
        The value for the kernel's ``PDL`` constexpr and its ``launch_pdl`` option.
    """
    return PDL_ENABLED and sm90_or_newer(device)


def launch_kwargs(use: bool) -> dict:
    """The launch option that sets the PDL attribute: ``{"launch_pdl": True}`` when ``use``
    (and Triton compiles), else nothing, so a launch without PDL is the same as before."""
    return {"launch_pdl": True} if use and not TRITON_INTERPRET else {}
