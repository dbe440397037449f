"""Time decode-sized GEMMs: cuBLAS (``F.linear``) vs ``mrv2.kernels.skinny_gemm`` (GPU).

Two views, Qwen3-0.6B shapes (qkv 4096 x 1024, o 1024 x 2048, gate_up 6144 x 1024,
down 1024 x 3072), bf16, M = 1, 2, 4, 8 rows:

1. one product alone (``triton.testing.do_bench``, L2 flushed), cuBLAS vs the kernel's
   default launch and a sweep of (block_n, block_k, num_warps);
2. a decode step's chain: 28 layers x the four products on distinct weights (880 MB, no
   L2 reuse), captured in one CUDA graph and replayed, cuBLAS vs the kernel: what the
   launch boundaries inside a graph cost, the figure that matters for TPOT.

    python scripts/bench_skinny_gemm.py --out benchmarks/results/skinny_gemm.json
    python scripts/bench_skinny_gemm.py --smoke --out /tmp/s.json      # CPU, tiny
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# NOTE: mrv2 first: it switches Triton to its interpreter on a machine without CUDA.
from mrv2.platform import HAS_CUDA  # noqa: I001

import torch
import torch.nn.functional as F
import triton

from mrv2.kernels.skinny_gemm import skinny_linear

SHAPES = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)}


def _time_us(fn, smoke: bool) -> float:
    if smoke:
        fn()
        return 0.0
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median") * 1e3


def alone(ms: list[int], smoke: bool, sweep: bool) -> list[dict]:
    """Each product alone: cuBLAS, the default launch, and (``sweep``) every config."""
    dev, dt = ("cpu", torch.float32) if smoke else ("cuda", torch.bfloat16)
    rows = []
    for (name, (n, k)), m in itertools.product(SHAPES.items(), ms):
        if smoke:
            n, k = n // 64, k // 64
        w = torch.randn(n, k, device=dev, dtype=dt) * 0.05
        x = torch.randn(m, k, device=dev, dtype=dt)
        row = {"shape": name, "N": n, "K": k, "M": m, "mb": n * k * w.element_size() / 1e6,
               "cublas_us": _time_us(lambda x=x, w=w: F.linear(x, w), smoke),
               "skinny_us": _time_us(lambda x=x, w=w: skinny_linear(x, w), smoke)}
        if sweep:
            best = None
            cfgs = ([(4, 16, 4)] if smoke else
                    itertools.product((4, 8, 16), (256, 512, 1024), (2, 4, 8)))
            for bn, bk, nw in cfgs:
                if bk > triton.next_power_of_2(k) or bn * bk * max(m, 2) > 32768:
                    continue
                us = _time_us(lambda x=x, w=w, bn=bn, bk=bk, nw=nw: skinny_linear(
                    x, w, block_n=bn, block_k=bk, num_warps=nw), smoke)
                if best is None or us < best[0]:
                    best = (us, {"block_n": bn, "block_k": bk, "num_warps": nw})
            row["best_us"], row["best_config"] = best
        rows.append(row)
        print(f"{name:>8} M={m}  cuBLAS {row['cublas_us']:7.2f} us   skinny {row['skinny_us']:7.2f}"
              + (f"   best {row['best_us']:7.2f} {row['best_config']}" if sweep else ""))
    return rows


def chain(ms: list[int], smoke: bool, layers: int) -> list[dict]:
    """``layers`` x (qkv, o, gate_up, down) on distinct weights in one CUDA graph."""
    if smoke:
        return []
    ws = [{name: torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.05
           for name, (n, k) in SHAPES.items()} for _ in range(layers)]
    rows = []
    for m in ms:
        xs = {name: torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
              for name, (_, k) in SHAPES.items()}
        out = {}
        for label, fn in (("cublas", F.linear), ("skinny", skinny_linear)):
            def step(fn=fn, xs=xs, out=out):
                for layer in ws:
                    for name, w in layer.items():
                        out[name] = fn(xs[name], w)
            step()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            us = _time_us(graph.replay, smoke)
            rows.append({"M": m, "runner": label, "us_per_step": us,
                         "weight_mb": sum(w.numel() * 2 for lw in ws for w in lw.values()) / 1e6})
        c, s = rows[-2]["us_per_step"], rows[-1]["us_per_step"]
        print(f"chain M={m}: cuBLAS {c:8.1f} us  skinny {s:8.1f} us  ratio {s / c:.3f}  "
              f"({rows[-1]['weight_mb']:.0f} MB: {rows[-1]['weight_mb'] / s * 1e-3:.2f} TB/s)")
    return rows


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark; returns the JSON it wrote."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU, no timing")
    ap.add_argument("--sweep", action="store_true", help="also every (block_n, block_k, warps)")
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "skinny_gemm.json"))
    args = ap.parse_args(argv)
    if not HAS_CUDA and not args.smoke:
        raise SystemExit("bench_skinny_gemm times the GPU; use --smoke on the CPU")
    ms = [1, 2] if args.smoke else [1, 2, 4, 8]
    report = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
              "hardware": torch.cuda.get_device_name() if HAS_CUDA else "cpu",
              "versions": {"torch": torch.__version__, "triton": triton.__version__},
              "smoke": args.smoke, "alone": alone(ms, args.smoke, args.sweep),
              "chain": chain(ms, args.smoke, args.layers)}
    pathlib.Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
