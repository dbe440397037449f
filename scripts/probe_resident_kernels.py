"""Per-launch times of ``small_m_resident`` against ``small_m_fused``, one op at a time (GPU).

The 28-layer chain (``scripts/bench_resident_chain.py``) says whether the resident kernels
win; this says which op loses and how the loss grows with the rows. For each Qwen3-0.6B op
(qkv: norm + product, K 1,024, N 4,096; o_proj + add, K 2,048; gate_up: norm + product + SiLU
* up, K 1,024, N 2 x 3,072; down + add, K 3,072) at each row count, both kernels:

* ``graph_us``: the same launch 28 times in one CUDA graph (PDL between them), per launch;
* ``eager_us``: one eager launch (the chain bench's median, launch overhead included).

A 16-row block that costs more than the weights explain shows as a step at 17 and 33 rows.
Under Nsight Compute, one launch of each case runs inside the NVTX range ``profile``:

    ncu --clock-control none --section WarpStateStats --section SourceCounters \\
        --nvtx --nvtx-include "profile/" -o prof python scripts/probe_resident_kernels.py --rows 16
    ncu -i prof.ncu-rep --page source --print-source sass --csv > sass.csv

(job 21P found the warps' ``gl.reduce`` lowered to 32-way shared-memory bank conflicts that way:
``benchmarks/results/resident_ncu_2026-12-07_job21P-3af3236.json``).

    python scripts/probe_resident_kernels.py --rows 16,32,64 --out probe.json
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import mrv2  # noqa: F401, I001  (before Triton: the interpreter switch)
import torch

import bench_skinny_fused as chain_bench
from bench_skinny_fused import ATTN, HIDDEN, INTER, QKV
from mrv2.bench.report import environment
from mrv2.kernels import small_m_fused, small_m_resident, small_m_staged

#: op -> (K, N of the product, kind of call)
OPS = {"qkv": (HIDDEN, QKV, "norm"), "o_proj": (ATTN, HIDDEN, "add"),
       "gate_up": (HIDDEN, INTER, "gate_up"), "down": (INTER, HIDDEN, "add")}
LAUNCHES = 28


def _call(op: str, m: int):
    """A no-argument launch of ``op`` at ``m`` rows on fixed random bf16 operands."""
    K, N, kind = OPS[op]
    g = torch.Generator(device="cuda").manual_seed(m)
    kw = {"device": "cuda", "dtype": torch.bfloat16}
    x = torch.randn(m, K, generator=g, **kw)
    w = torch.randn(2 * N if kind == "gate_up" else N, K, generator=g, **kw) / K ** 0.5
    nw = torch.ones(K, **kw)
    if kind == "norm":
        return lambda: small_m_fused.small_m_norm_linear(x, nw, 1e-6, w)
    if kind == "gate_up":
        return lambda: small_m_fused.small_m_norm_gate_up_silu(x, nw, 1e-6, w)
    h = torch.randn(m, N, generator=g, **kw)
    return lambda: small_m_fused.small_m_linear_add(x, w, h)


def _timed(fn, resident: bool) -> dict:
    """``fn`` with ``small_m_resident.ENABLED`` forced to ``resident``: median us eager (it
    compiles first), then per launch of ``LAUNCHES`` in one graph, then one launch in the
    NVTX range ``profile`` (ncu's filter)."""
    # NOTE: small_m_staged (on by default: up to 16 rows) would take the resident's calls.
    run = chain_bench._forcing(small_m_resident, "ENABLED", resident,
                               chain_bench._forcing(small_m_staged, "ENABLED", False, fn))

    def launches():
        for _ in range(LAUNCHES):
            run()
    eager = chain_bench._time_us(run, False)
    in_graph = chain_bench._graph_us(launches, (), False) / LAUNCHES
    torch.cuda.nvtx.range_push("profile")
    run()
    torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()
    return {"graph_us": in_graph, "eager_us": eager}


def run(rows: list[int], ops: list[str]) -> list[dict]:
    """One row a (op, rows, kernel): ``{"op", "M", "kernel", "graph_us", "eager_us"}``."""
    out = []
    for op in ops:
        for m in rows:
            fn = _call(op, m)
            for kernel, resident in (("fused", False), ("resident", True)):
                out.append({"op": op, "M": m, "kernel": kernel, **_timed(fn, resident)})
            f, r = out[-2]["graph_us"], out[-1]["graph_us"]
            print(f"{op:>8} M={m:3d}: fused {f:6.2f} us  resident {r:6.2f} us a launch "
                  f"(28 in a graph)", flush=True)
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="16,17,32,33,64")
    ap.add_argument("--ops", default=",".join(OPS))
    ap.add_argument("--out", default=None, help="JSON path")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("probe_resident_kernels needs a CUDA GPU (Gluon has no interpreter)")
    result = {"benchmark": "resident_kernels", **environment(),
              "kernels": run([int(r) for r in args.rows.split(",")], args.ops.split(","))}
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
