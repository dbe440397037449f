"""Time the 28-layer decode GEMM chain through ``mrv2.kernels.small_m_resident`` (GPU).

The chain of ``scripts/bench_skinny_fused.py`` (each layer: norm + qkv, o_proj + add, norm +
gate_up + SiLU * up, down + add, on distinct Qwen3-0.6B-shaped bf16 weights, one CUDA graph,
attention left out) at the rows given, three runners in one process:

* ``cublas``: the model's unfused layers (norm kernels, ``F.linear``, ``silu_and_mul``);
* ``fused_pdl``: ``small_m_fused``'s tensor-core kernels with PDL (weights tile by tile
  after the wait);
* ``resident_pdl``: the same entry points routed to ``small_m_resident`` (each program's
  weights loaded into the MMA's registers before the wait), with ``max_abs_diff_vs_fused``;
* ``resident``: the same without PDL (each kernel starts when the one before has ended);
* ``staged_pdl``: the same entry points routed to ``small_m_staged`` (each program's weights
  copied into shared memory before the wait, up to its MAX_M rows), with
  ``max_abs_diff_vs_fused``; ``staged``: the same without PDL;
* ``staged32_pdl`` / ``staged32_walk_pdl``: ``staged_pdl`` up to 32 rows (``MAX_M`` 32), a
  program a 16-row block (``SPLIT_ROWS``) or one walking both (``--runners`` picks some).

``--sweep 16,32`` then walks (at those rows) ``small_m_resident.LAUNCH`` (``LAUNCH_OVER_16``
above 16 rows; with ``--sweep-runner staged_pdl`` small_m_staged's tables, on its chain) per
op kind (BLOCK_N x warps, and above 16 rows the resident's BLOCK_M 16 / 32), the other kinds at their
default, on the resident chain. Prints one line per figure; ``--out`` JSON.

    python scripts/bench_resident_chain.py --rows 4,8,16,24,32,48,64 --sweep 32 --out r.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import mrv2  # noqa: F401, I001  (before Triton: the interpreter switch)
import torch
import torch.nn.functional as F

import bench_skinny_fused as chain_bench
from mrv2.bench.report import environment
from mrv2.kernels import small_m_fused, small_m_resident, small_m_staged

KINDS = ("norm", "add", "gate_up")
SWEEP = list(itertools.product((8, 16, 32), (4, 8, 16)))
#: Over 16 rows, each launch also at 32 rows a pass of the row loop (BLOCK_M).
SWEEP_BLOCK_M = (16, 32)


def _resident(run, on: bool):
    """``run`` with ``small_m_resident.ENABLED`` forced on or off, and small_m_staged off
    (on by default it takes up to 16 rows; the staged runners turn it on
    inside)."""
    return chain_bench._forcing(small_m_resident, "ENABLED", on,
                                chain_bench._forcing(small_m_staged, "ENABLED", False, run))


def _fused(pdl_on: bool):
    """small_m_fused's entry points over the chain, unsplit, with PDL on or off."""
    return chain_bench._with_split(chain_bench._with_pdl(
        chain_bench._fused_with(small_m_fused.SMALL_M_OPS), pdl_on), False)


def _runners() -> dict:
    return {"cublas": _resident(chain_bench._with_pdl(chain_bench._unfused(F.linear), False),
                                False),
            "fused_pdl": _resident(_fused(True), False),
            "resident_pdl": _resident(_fused(True), True),
            # the same launches without PDL: what the weight loads before the wait buy
            "resident": _resident(_fused(False), True),
            # the weights staged in shared memory (small_m_staged), with PDL
            "staged_pdl": _resident(chain_bench._forcing(small_m_staged, "ENABLED", True,
                                                         _fused(True)), True),
            # ... and without PDL: what the copies before the wait buy
            "staged": _resident(chain_bench._forcing(small_m_staged, "ENABLED", True,
                                                     _fused(False)), True),
            # staged up to 32 rows (MAX_M 32): a program a 16-row block (SPLIT_ROWS) ...
            "staged32_pdl": _resident(_staged_to_32(True), True),
            # ... or one program walking both blocks
            "staged32_walk_pdl": _resident(_staged_to_32(False), True)}


def _staged_to_32(split_rows: bool):
    """The staged runner with ``small_m_staged.MAX_M`` 32 and ``SPLIT_ROWS`` all
    ``split_rows``."""
    table = dict.fromkeys(small_m_staged.SPLIT_ROWS, split_rows)
    return chain_bench._forcing(small_m_staged, "ENABLED", True, chain_bench._forcing(
        small_m_staged, "MAX_M", 32, chain_bench._forcing(small_m_staged, "SPLIT_ROWS", table,
                                                          _fused(True))))


def run(rows: list[int], layers: int, sweep_rows: list[int],
        sweep_runner: str = "resident_pdl", only: tuple[str, ...] = ()) -> dict:
    """The chain per runner at each row count, then the sweep at ``sweep_rows`` of
    ``sweep_runner``'s launch tables (``resident_pdl``: small_m_resident's, ``staged_pdl``:
    small_m_staged's; ``only``: these runners, else all): ``{"chain", "sweep", ...}``."""
    module = small_m_staged if sweep_runner.startswith("staged") else small_m_resident
    ws = chain_bench._weights(layers, 1, "cuda", torch.bfloat16)
    mb = sum(w.numel() * w.element_size() for lw in ws for w in lw.values()) / 1e6
    out = {"chain": [], "sweep": [], "weight_mb": mb, "layers": layers,
           "launch_default": dict(small_m_resident.LAUNCH),
           "launch_over_16_default": dict(small_m_resident.LAUNCH_OVER_16),
           "staged_launch_default": dict(small_m_staged.LAUNCH),
           "staged_launch_over_16_default": dict(small_m_staged.LAUNCH_OVER_16),
           "sweep_runner": sweep_runner}
    runners = {k: v for k, v in _runners().items() if not only or k in only}
    for m in rows:
        h = torch.randn(m, chain_bench.HIDDEN, device="cuda", dtype=torch.bfloat16)
        attn = torch.randn(m, chain_bench.ATTN, device="cuda", dtype=torch.bfloat16)
        got = {}
        for label, fn in runners.items():
            got[label] = fn(h, attn, ws).float()           # compiles, and the numbers
            us = chain_bench._graph_us(fn, (h, attn, ws), False)
            row = {"M": m, "runner": label, "us_per_step": us}
            if label != "fused_pdl" and "fused_pdl" in got and label != "cublas":
                row["max_abs_diff_vs_fused"] = (got[label] - got["fused_pdl"]).abs().max().item()
                row["max_abs_fused"] = got["fused_pdl"].abs().max().item()
            out["chain"].append(row)
        print(f"chain M={m} ({layers} layers, {mb:.0f} MB): " + "  ".join(
            f"{r['runner']} {r['us_per_step']:7.1f} us" for r in out["chain"][-len(runners):]),
            flush=True)
        if m not in sweep_rows:
            continue
        base = next(r["us_per_step"] for r in out["chain"][-len(runners):]
                    if r["runner"] == sweep_runner)
        # NOTE: the table ``launch`` reads at m rows.
        table = module.LAUNCH if m <= 16 else module.LAUNCH_OVER_16
        for kind in KINDS:
            for block_n, warps, block_m in [(*bw, bm) for bw in SWEEP
                                            for bm in (SWEEP_BLOCK_M if m > 16 and module
                                                       is small_m_resident else (16,))]:
                saved = table[kind]
                table[kind] = (block_n, warps, block_m)
                try:
                    runners[sweep_runner](h, attn, ws)
                    us = chain_bench._graph_us(runners[sweep_runner], (h, attn, ws), False)
                except Exception as e:  # noqa: BLE001  (a launch that does not fit: recorded)
                    us = None
                    print(f"  {kind} {block_n}x{warps}x{block_m}: {type(e).__name__}: {str(e)[:80]}")
                finally:
                    table[kind] = saved
                out["sweep"].append({"M": m, "kind": kind, "block_n": block_n,
                                     "num_warps": warps, "block_m": block_m, "us_per_step": us})
                print(f"  sweep M={m} {kind:>7} block_n={block_n:2d} warps={warps:2d} "
                      f"block_m={block_m}: "
                      f"{'failed' if us is None else f'{us:7.1f} us'} (default {base:7.1f})",
                      flush=True)
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="4,8,16,24,32,48,64")
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--sweep", default="", help="rows to sweep LAUNCH per op kind at, e.g. 32")
    ap.add_argument("--sweep-runner", default="resident_pdl",
                    choices=("resident_pdl", "staged_pdl", "staged32_pdl"),
                    help="whose launch table to sweep")
    ap.add_argument("--runners", default="", help="comma-separated runners (default: all)")
    ap.add_argument("--out", default=None, help="JSON path")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_resident_chain needs a CUDA GPU (Gluon has no interpreter)")
    result = {"benchmark": "resident_chain", **environment(),
              **run([int(r) for r in args.rows.split(",")], args.layers,
                     [int(r) for r in args.sweep.split(",") if r], args.sweep_runner,
                     tuple(r for r in args.runners.split(",") if r))}
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
