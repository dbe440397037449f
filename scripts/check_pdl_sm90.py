"""Compile the decode kernels for sm_90 without a GPU, with PDL off or on (mrv2.kernels.pdl).

The launchers (``qk_norm_rope``, ``paged_attention``, the fused GEMMs) run on CPU tensors at
the Qwen3-0.6B decode shapes (bf16, 1 and 2 rows, ~1000 tokens of context); each kernel
launch is captured and compiled through the Triton JIT's own binder (the specialisation,
constexprs and divisibility attributes a GPU launch would get), for ``cuda:90``. Prints per
launch the ``griddepcontrol`` counts, ``launch_pdl`` and ptxas' registers, and writes the
PTX and cubin to ``--out`` so two runs (another tree, another Triton) can be diffed.

    # with Triton 3.6 (the H200's) unpacked from its wheel, ptxas from the wheel:
    pip download triton==3.6.0 --no-deps -d /tmp/whl && python -m zipfile -e /tmp/whl/*.whl /tmp/t36
    chmod +x /tmp/t36/triton/backends/nvidia/bin/*
    TRITON_INTERPRET=0 PYTHONPATH=/tmp/t36:. python scripts/check_pdl_sm90.py --out /tmp/off
    TRITON_INTERPRET=0 PYTHONPATH=/tmp/t36:. python scripts/check_pdl_sm90.py --pdl --out /tmp/on
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
# NOTE: compile, do not interpret: set before mrv2 (which would default it to 1 on the CPU).
os.environ["TRITON_INTERPRET"] = "0"

import mrv2  # noqa: F401, I001
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import create_function_from_signature

from mrv2.forward_context import AttentionMetadata
from mrv2.kernels import (
    attention,
    decode_attention,
    decode_heads,
    pdl,
    rotary,
    skinny_fused,
    skinny_stream,
    small_m_fused,
)

TARGET = GPUTarget("cuda", 90, 32)
KERNELS = ((attention, "_paged_attention_kernel"), (attention, "_merge_splits_kernel"),
           (rotary, "_qk_norm_rope_kernel"), (skinny_fused, "_skinny_fused_kernel"),
           (skinny_stream, "_skinny_stream_kernel"),
           (small_m_fused, "_small_m_fused_kernel"),
           (decode_attention, "_decode_rope_attention_kernel"),
           (decode_heads, "_decode_heads_kernel"))


class _Capture:
    """Stands in for a kernel: ``kernel[grid](*args, **kwargs)`` records the call."""

    def __init__(self, fn):
        self.fn, self.calls = fn, []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((args, kwargs))


def _compile(fn, args, kwargs):
    """``fn`` compiled for ``TARGET`` as ``JITFunction.run`` would for these arguments."""
    backend = make_backend(TARGET)
    kwargs = dict(kwargs, debug=False, instrumentation_mode="")
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, spec, opts = binder(*args, **kwargs)
    options, sig, constexprs, attrs = fn._pack_args(backend, kwargs, bound, spec, opts)
    return triton.compile(ASTSource(fn, sig, constexprs, attrs), target=TARGET,
                          options=options.__dict__)


def _decode_launches(rows: int) -> None:
    """One decode layer's kernels at ``rows`` tokens (Qwen3-0.6B shapes, bf16)."""
    bf = torch.bfloat16
    q, k, v = (torch.randn(rows, h, 128, dtype=bf) for h in (16, 8, 8))
    kv = torch.zeros(2, 64, 16, 8, 128, dtype=bf)
    slots = torch.arange(rows, dtype=torch.int64) * 16
    rotary.qk_norm_rope(q, k, torch.full((rows,), 999), torch.randn(4096, 128),
                        torch.randn(128, dtype=bf), torch.randn(128, dtype=bf), 1e-6,
                        v=v, kv_cache=kv, slot_mapping=slots)
    md = AttentionMetadata(torch.arange(rows + 1, dtype=torch.int32),
                           torch.full((rows,), 1000, dtype=torch.int32),
                           torch.zeros(rows, 64, dtype=torch.int32), slots, 1, 1000)
    attention.paged_attention(q, kv, md, 128 ** -0.5)
    decode_attention.decode_rope_attention(                # the fused alternative to both
        torch.randn(rows, 4096, dtype=bf), torch.full((rows,), 999), torch.randn(4096, 128),
        torch.randn(128, dtype=bf), torch.randn(128, dtype=bf), 1e-6, kv, md, 128 ** -0.5,
        16, 8)
    _gemm_launches(rows, small_m_fused.SKINNY_OPS)


def _gemm_launches(rows: int, ops) -> None:
    """A decode layer's four fused GEMMs, ``ops = (norm_linear, linear_add,
    norm_gate_up_silu)`` (skinny_fused's or small_m_fused's), at ``rows`` tokens."""
    bf = torch.bfloat16
    norm_linear, linear_add, norm_gate_up_silu = ops
    h, nw = torch.randn(rows, 1024, dtype=bf), torch.randn(1024, dtype=bf)
    norm_linear(h, nw, 1e-6, torch.randn(4096, 1024, dtype=bf))
    linear_add(torch.randn(rows, 2048, dtype=bf), torch.randn(1024, 2048, dtype=bf), h)
    norm_gate_up_silu(h, nw, 1e-6, torch.randn(6144, 1024, dtype=bf))
    linear_add(torch.randn(rows, 3072, dtype=bf), torch.randn(1024, 3072, dtype=bf), h)


def _decode_heads_launch(reqs: int) -> None:
    """decode_heads' launch (its decode steps of 33+ requests) at ~100 keys."""
    bf = torch.bfloat16
    q = torch.randn(reqs, 16, 128, dtype=bf)
    kv = torch.zeros(2, 64, 16, 8, 128, dtype=bf)
    md = AttentionMetadata(torch.arange(reqs + 1, dtype=torch.int32),
                           torch.full((reqs,), 100, dtype=torch.int32),
                           torch.zeros(reqs, 16, dtype=torch.int32),
                           torch.arange(reqs, dtype=torch.int64) * 16, 1, 256)
    decode_heads.decode_heads_attention(q, kv, md, 128 ** -0.5, torch.zeros_like(q))


@contextlib.contextmanager
def _capturing(pdl_on: bool):
    """Every kernel of ``KERNELS`` replaced by a ``_Capture`` (yielded, by name) and PDL forced
    on or off for CPU tensors inside the block; all put back after it."""
    caps = {name: _Capture(getattr(mod, name)) for mod, name in KERNELS}
    saved = [(mod, name, getattr(mod, name)) for mod, name in KERNELS]
    saved += [(pdl, "use_pdl", pdl.use_pdl), (pdl, "launch_kwargs", pdl.launch_kwargs)]
    try:
        for mod, name in KERNELS:
            setattr(mod, name, caps[name])
        pdl.use_pdl = lambda device: pdl_on
        pdl.launch_kwargs = lambda use: {"launch_pdl": True} if use else {}
        yield caps
    finally:
        for mod, name, value in saved:
            setattr(mod, name, value)


def decode_attention_ptx(reqs: int, prefetch_l2: bool, keys: int = 200,
                         early_meta: bool | None = None) -> str:
    """The PTX of ``decode_rope_attention``'s kernel for a decode step of ``reqs`` requests at
    ``keys`` keys (PDL on; ``decode_attention.PREFETCH_L2`` forced, ``attention.EARLY_META``
    too unless None: then the package's rule for ``reqs``), compiled for sm_90."""
    bf = torch.bfloat16
    md = AttentionMetadata(torch.arange(reqs + 1, dtype=torch.int32),
                           torch.full((reqs,), keys, dtype=torch.int32),
                           torch.zeros(reqs, 64, dtype=torch.int32),
                           torch.arange(reqs, dtype=torch.int64) * 16, 1, keys)
    before, meta_before = decode_attention.PREFETCH_L2, attention.EARLY_META
    try:
        decode_attention.PREFETCH_L2 = prefetch_l2
        attention.EARLY_META = meta_before if early_meta is None else early_meta
        with _capturing(True) as caps:
            decode_attention.decode_rope_attention(
                torch.randn(reqs, 4096, dtype=bf), torch.full((reqs,), keys - 1),
                torch.randn(4096, 128), torch.randn(128, dtype=bf), torch.randn(128, dtype=bf),
                1e-6, torch.zeros(2, 64, 16, 8, 128, dtype=bf), md, 128 ** -0.5, 16, 8)
    finally:
        decode_attention.PREFETCH_L2, attention.EARLY_META = before, meta_before
    cap = caps["_decode_rope_attention_kernel"]
    args, kwargs = cap.calls[0]
    return _compile(cap.fn, args, kwargs).asm["ptx"]


def main(argv: list[str] | None = None) -> list[dict]:
    """Compile every launch; returns one row per launch."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pdl", action="store_true", help="launch with PDL (PDL=True)")
    ap.add_argument("--out", required=True, help="folder for the PTX and cubin files")
    args = ap.parse_args(argv)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    attention._num_sms = lambda: 132                       # the H200's picker
    torch.manual_seed(0)
    with _capturing(args.pdl) as caps:                     # CPU tensors: force the choice
        for rows in (1, 2):
            _decode_launches(rows)
        for rows in (4, 32):
            _gemm_launches(rows, small_m_fused.SMALL_M_OPS)
        _decode_heads_launch(64)
    ptxas = triton.knobs.nvidia.ptxas.path                 # the ptxas this Triton compiles with
    rows = []
    for name, cap in caps.items():
        for i, (a, kw) in enumerate(cap.calls):
            kernel = _compile(cap.fn, a, kw)
            ptx = kernel.asm["ptx"]
            stem = out / f"{name}_{i}"
            stem.with_suffix(".ptx").write_text(ptx)
            proc = subprocess.run([str(ptxas), "-v", "-arch=sm_90a", str(stem) + ".ptx", "-o",
                                   str(stem) + ".cubin"], capture_output=True, text=True,
                                  check=False)
            regs = [ln.split(":")[-1].strip() for ln in proc.stderr.splitlines()
                    if "registers" in ln]
            rows.append({"launch": f"{name}_{i}", "wait": ptx.count("griddepcontrol.wait"),
                         "launch_dependents": ptx.count("griddepcontrol.launch_dependents"),
                         "launch_pdl": kernel.metadata.launch_pdl,
                         "ptxas": regs[0] if regs else proc.stderr[-200:]})
            r = rows[-1]
            print(f"{r['launch']:28s} wait {r['wait']} launch_dependents "
                  f"{r['launch_dependents']} launch_pdl {r['launch_pdl']!s:5s} {r['ptxas']}")
    return rows


if __name__ == "__main__":
    main()
