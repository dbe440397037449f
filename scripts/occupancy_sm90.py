"""What a launch costs an H200's SMs, without a GPU: registers, spills, shared memory, waves.

A short decode kernel is often bound not by bytes but by how many of its programs an SM holds
at once: a program that needs 64 KB of shared memory or 200 registers a thread leaves the
SMs half empty, and a grid of more programs than fit runs in waves, each paying the program's
whole latency. This compiles the model's decode attention launches for ``cuda:90`` exactly as
``scripts/check_pdl_sm90.py`` does (the Triton JIT's own binder, on CPU tensors), runs ptxas
on each, and prints per launch::

    grid programs, warps, registers a thread, spill bytes, shared memory, programs an SM
    holds (the tightest of registers, shared memory, warps and the 32-block cap), waves

Launches: the fused decode kernel (``decode_rope_attention``) at the ``bench latency`` shape
(max_model_len 256: a CUDA graph bakes ``max_seq_len`` in) for the batch sizes asked, with
the launch the package picks and the ``--variants`` given; ``paged_attention`` at batch 256 as
the throughput workloads launch it (max_model_len 160 and 2,176). Use Triton 3.6 (the
H200's) unpacked from its wheel, as check_pdl_sm90's docstring says::

    TRITON_INTERPRET=0 PYTHONPATH=/tmp/t36:. python scripts/occupancy_sm90.py --batches 8,32 \\
        --variants '{"num_stages": 1}' '{"num_warps": 2}' --out /tmp/occ.json

Occupancy is the hardware's arithmetic (sm_90: 65,536 registers, allocated per warp in
256-register units; 228 KB of shared memory, 1 KB reserved a block; 64 warps; 32 blocks),
not a measurement: it says which launches CAN keep an SM busy, the GPU says which do.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "scripts"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))
# NOTE: compile, do not interpret: set before mrv2 (which would default it to 1 on the CPU).
os.environ["TRITON_INTERPRET"] = "0"

import mrv2  # noqa: F401, I001
import torch
import triton
from check_pdl_sm90 import _compile

from mrv2.forward_context import AttentionMetadata
from mrv2.kernels import attention, decode_attention, pdl

NUM_SMS, REGS_PER_SM, SMEM_PER_SM, SMEM_RESERVED, WARPS_PER_SM, BLOCKS_PER_SM = \
    132, 65536, 233472, 1024, 64, 32


def regs_per_program(regs: int, num_warps: int) -> int:
    """Registers one program takes from its SM's 65,536 (allocated per warp in 256s)."""
    return -(-max(regs, 1) * 32 // 256) * 256 * num_warps


def programs_per_sm(regs: int, num_warps: int, smem: int) -> dict:
    """How many programs of a kernel one sm_90 SM holds, and which resource decides."""
    limits = {"registers": REGS_PER_SM // regs_per_program(regs, num_warps),
              "shared memory": SMEM_PER_SM // (smem + SMEM_RESERVED),
              "warps": WARPS_PER_SM // num_warps, "blocks": BLOCKS_PER_SM}
    bound = min(limits, key=limits.get)
    return {"programs_per_sm": limits[bound], "bound_by": bound}


class _Capture:
    """Stands in for a kernel: ``kernel[grid](*args, **kwargs)`` records the call and grid."""

    def __init__(self, fn):
        self.fn, self.calls = fn, []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((grid, args, kwargs))


def _ptxas(kernel, stem: pathlib.Path) -> tuple[int, int]:
    """(registers a thread, spill bytes stored + loaded) from ``ptxas -v`` on the PTX."""
    stem.with_suffix(".ptx").write_text(kernel.asm["ptx"])
    proc = subprocess.run([str(triton.knobs.nvidia.ptxas.path), "-v", "-arch=sm_90a",
                           str(stem) + ".ptx", "-o", str(stem) + ".cubin"],
                          capture_output=True, text=True, check=False)
    regs = re.search(r"Used (\d+) registers", proc.stderr)
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", proc.stderr)]
    if regs is None:
        raise RuntimeError(f"ptxas said: {proc.stderr[-400:]}")
    return int(regs.group(1)), sum(spills)


def _decode_md(batch: int, context: int, max_seq_len: int, pages: int) -> AttentionMetadata:
    return AttentionMetadata(torch.arange(batch + 1, dtype=torch.int32),
                             torch.full((batch,), context, dtype=torch.int32),
                             torch.zeros(batch, pages, dtype=torch.int32),
                             torch.arange(batch, dtype=torch.int64) * 16, 1, max_seq_len)


@contextlib.contextmanager
def _captured(module, name: str):
    """``module.name`` (a kernel) replaced by a ``_Capture`` for the block, then put back."""
    cap = _Capture(getattr(module, name))
    setattr(module, name, cap)
    try:
        yield cap
    finally:
        setattr(module, name, cap.fn)


def launches(batches: list[int], variants: list[dict]) -> list[tuple[str, dict, object, tuple]]:
    """``(label, launch config, kernel, captured call)`` for every decode attention launch."""
    bf = torch.bfloat16
    out = []
    with _captured(decode_attention, "_decode_rope_attention_kernel") as fused, \
            _captured(attention, "_paged_attention_kernel") as paged, \
            _captured(attention, "_merge_splits_kernel"):         # launched, not compiled here
        kv = torch.zeros(2, 64, 16, 8, 128, dtype=bf)
        for b in batches:
            md = _decode_md(b, 192, 256, 16)
            base = decode_attention.pick_config(b, 8, 2, 1, 256, 128)
            for v in [{}, *variants]:
                prefetch = v.get("prefetch", b <= decode_attention.PREFETCH_MAX_REQS)
                decode_attention.PREFETCH, keep = prefetch, decode_attention.PREFETCH
                try:
                    cfg = {k: x for k, x in v.items() if k != "prefetch"}
                    decode_attention.decode_rope_attention(
                        torch.randn(b, 4096, dtype=bf), torch.full((b,), 191),
                        torch.randn(4096, 128), torch.randn(128, dtype=bf),
                        torch.randn(128, dtype=bf), 1e-6, kv, md, 128 ** -0.5, 16, 8,
                        config=cfg)
                finally:
                    decode_attention.PREFETCH = keep
                out.append((f"decode_rope_attention b{b} ctx192 max256",
                            {**base, **cfg, "prefetch": prefetch}, fused.fn, fused.calls[-1]))
        q = torch.randn(256, 16, 128, dtype=bf)
        for max_len in (160, 2176):
            md = _decode_md(256, min(96, max_len), max_len, max_len // 16)
            base = attention._pick_config(256, 8, 2, 1, max_len, 128)
            for v in [{}, *variants]:
                if "prefetch" in v:
                    continue
                cfg = {k: x for k, x in v.items() if k != "decode_one_loop"}
                one_loop = v.get("decode_one_loop", attention.DECODE_ONE_LOOP)
                keep, attention.DECODE_ONE_LOOP = attention.DECODE_ONE_LOOP, one_loop
                try:
                    attention.paged_attention(q, kv, md, 128 ** -0.5, config=cfg)
                finally:
                    attention.DECODE_ONE_LOOP = keep
                out.append((f"paged_attention b256 max{max_len}",
                            {**base, **cfg, "decode_one_loop": one_loop}, paged.fn,
                            paged.calls[-1]))
    return out


GEMM_KINDS = ("qkv", "o_proj", "gate_up", "down")


def gemm_launches(rows_list: list[int]) -> list[tuple[str, dict, object, tuple]]:
    """The four small_m_fused GEMMs of a decode layer (Qwen3-0.6B, bf16) at each row count,
    unsplit and with ``split_k_for``'s split (``small_m_fused.SPLIT_K`` off / on)."""
    from check_pdl_sm90 import _gemm_launches

    from mrv2.kernels import small_m_fused
    keep = small_m_fused.SPLIT_K
    out = []
    with _captured(small_m_fused, "_small_m_fused_kernel") as cap:
        try:
            for rows in rows_list:
                for split in (False, True):
                    small_m_fused.SPLIT_K = split
                    start = len(cap.calls)
                    _gemm_launches(rows, small_m_fused.SMALL_M_OPS)
                    for kind, call in zip(GEMM_KINDS, cap.calls[start:], strict=True):
                        kw = call[2]
                        cfg = {"split_k": kw["SPLIT_K"], "block_m": kw["BLOCK_M"],
                               "block_n": kw["BLOCK_N"], "block_k": kw["BLOCK_K"],
                               "num_warps": kw.get("num_warps"),
                               "num_stages": kw.get("num_stages")}
                        out.append((f"small_m_fused {kind} M{rows}", cfg, cap.fn, call))
        finally:
            small_m_fused.SPLIT_K = keep
    return out


#: The decode layer's resident GEMMs in launch order (Qwen3-0.6B): op -> (kind, N, K).
RESIDENT_OPS = {"qkv": ("norm", 4096, 1024), "o_proj": ("add", 1024, 2048),
                "gate_up": ("gate_up", 3072, 1024), "down": ("add", 1024, 3072)}


def fits_beside(a: dict, b: dict) -> bool:
    """Whether one program of launch ``a`` and one of ``b`` fit on one SM together (rows
    with ``regs_per_program``, ``shared_bytes``, ``num_warps``)."""
    return (a["regs_per_program"] + b["regs_per_program"] <= REGS_PER_SM
            and a["shared_bytes"] + b["shared_bytes"] + 2 * SMEM_RESERVED <= SMEM_PER_SM
            and a["num_warps"] + b["num_warps"] <= WARPS_PER_SM)


def resident_rows(rows_list: list[int], ptx_dir: pathlib.Path, module=None) -> list[dict]:
    """small_m_resident's four GEMMs at each row count (the package's launches), and whether
    one program of each fits on an SM BESIDE one of the kernel before it (the previous op of
    the layer; o_proj's is attention's, left out). PDL lets kernel i+1's programs start their
    weight loads while kernel i drains only where they fit beside it."""
    from mrv2.kernels import small_m_resident
    module = module or small_m_resident          # or small_m_staged: the same contract
    name = module.__name__.rsplit(".", 1)[-1]
    ptx_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for m in rows_list:
        layer = []
        for op, (kind, n, k) in RESIDENT_OPS.items():
            kernel, block_n, warps = module.sm90_kernel(m, n, k, kind)
            regs, spill = _ptxas(kernel, ptx_dir / f"{name}_{op}_M{m}")
            smem = kernel.metadata.shared
            row = {"launch": f"{name} {op} M{m}", "op": op, "rows": m,
                   "config": {"block_n": block_n, "num_warps": warps,
                              "block_m": module.launch(kind, k, m)[2]},
                   "grid_programs": -(-n // block_n), "num_warps": warps, "registers": regs,
                   "spill_bytes": spill, "shared_bytes": smem,
                   "regs_per_program": regs_per_program(regs, warps),
                   **programs_per_sm(regs, warps, smem)}
            layer.append(row)
        for prev, row in zip(layer[-1:] + layer[:-1], layer, strict=True):
            if row["op"] != "o_proj":        # qkv's previous is the last layer's down
                row["fits_beside_previous"] = fits_beside(prev, row)
        rows += layer
    return rows


def heads_launches(heads_list: list[int], variants: list[dict]
                   ) -> list[tuple[str, dict, object, tuple]]:
    """``decode_heads``' launch at batch 256 (Qwen3-0.6B, bf16, 96 keys) for each heads a
    program, at ``LAUNCH`` and with each of ``variants`` (block_n / num_warps / num_stages)."""
    from mrv2.kernels import decode_heads
    bf = torch.bfloat16
    kv = torch.zeros(2, 64, 16, 8, 128, dtype=bf)
    q = torch.randn(256, 16, 128, dtype=bf)
    md = _decode_md(256, 96, 160, 10)
    out = []
    with _captured(decode_heads, "_decode_heads_kernel") as cap:
        for heads in heads_list:
            for v in [{}, *(x for x in variants if set(x) <= set(decode_heads.LAUNCH))]:
                decode_heads.decode_heads_attention(q, kv, md, 128 ** -0.5, torch.zeros_like(q),
                                                    heads=heads, config=v)
                out.append((f"decode_heads b256 heads{heads}",
                            {**decode_heads.LAUNCH, **v, "heads": heads}, cap.fn,
                            cap.calls[-1]))
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    """Compile every launch; returns (and writes, with ``--out``) one row per launch."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8,32", help="decode batch sizes (fused kernel)")
    ap.add_argument("--variants", nargs="*", type=json.loads, default=[],
                    help="launch overrides (JSON), each tried beside the package's choice; "
                         '"prefetch": true/false for the fused kernel, "decode_one_loop": '
                         "true/false for paged attention")
    ap.add_argument("--gemm-rows", default="",
                    help="also small_m_fused's four GEMMs at these rows (e.g. 4,8,16,32), "
                         "unsplit and split (SPLIT_K's rule)")
    ap.add_argument("--heads", default="",
                    help="also decode_heads' batch-256 launch at these KV heads a program "
                         "(e.g. 2,4,8), with the --variants that set its launch knobs")
    ap.add_argument("--resident-rows", default="",
                    help="also small_m_resident's four GEMMs at these rows (e.g. 16,32), "
                         "and whether each fits beside the kernel before it")
    ap.add_argument("--staged-rows", default="",
                    help="the same for small_m_staged (weights staged in shared memory)")
    ap.add_argument("--out", default=None, help="JSON of the rows")
    ap.add_argument("--ptx-dir", default="/tmp/occupancy_sm90")
    args = ap.parse_args(argv)
    pdl.use_pdl = lambda device: True                      # CPU tensors: the H200's choice
    pdl.launch_kwargs = lambda use: {"launch_pdl": True} if use else {}
    attention._num_sms = lambda: NUM_SMS
    ptx_dir = pathlib.Path(args.ptx_dir)
    ptx_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    todo = launches([int(b) for b in args.batches.split(",") if b], args.variants)
    if args.gemm_rows:
        todo += gemm_launches([int(r) for r in args.gemm_rows.split(",")])
    if args.heads:
        todo += heads_launches([int(h) for h in args.heads.split(",")], args.variants)
    for i, (label, cfg, fn, (grid, a, kw)) in enumerate(todo):
        kernel = _compile(fn, a, kw)
        regs, spill = _ptxas(kernel, ptx_dir / f"launch_{i}")
        warps, smem = kernel.metadata.num_warps, kernel.metadata.shared
        occ = programs_per_sm(regs, warps, smem)
        programs = 1
        for g in grid:
            programs *= g
        rows.append({"launch": label, "config": cfg, "grid_programs": programs,
                     "num_warps": warps, "registers": regs, "spill_bytes": spill,
                     "shared_bytes": smem, **occ,
                     "waves": -(-programs // (NUM_SMS * max(occ["programs_per_sm"], 1)))})
        r = rows[-1]
        short = {k: v for k, v in cfg.items() if k in ("num_splits", "block_n", "num_warps",
                                                        "num_stages", "prefetch",
                                                        "decode_one_loop", "split_k",
                                                        "block_k", "heads")}
        print(f"{label:36s} {json.dumps(short):78s} {programs:5d} progs {warps:2d} warps "
              f"{regs:3d} regs {spill:4d} B spill {smem // 1024:3d} KB smem -> "
              f"{r['programs_per_sm']:2d}/SM ({r['bound_by']}), {r['waves']} wave(s)")
    from mrv2.kernels import small_m_resident, small_m_staged
    gemm_rows = [(small_m_resident, args.resident_rows), (small_m_staged, args.staged_rows)]
    for module, r_rows in gemm_rows:
        if not r_rows:
            continue
        for r in resident_rows([int(m) for m in r_rows.split(",")], ptx_dir, module):
            rows.append(r)
            print(f"{r['launch']:36s} {json.dumps(r['config']):40s} {r['grid_programs']:5d} "
                  f"progs {r['num_warps']:2d} warps {r['registers']:3d} regs "
                  f"{r['spill_bytes']:4d} B spill {r['shared_bytes'] // 1024:3d} KB smem, "
                  f"{r['regs_per_program'] / REGS_PER_SM:4.0%} of an SM's registers; fits "
                  f"beside the kernel before: {r.get('fits_beside_previous', 'n/a (attention)')}")
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
