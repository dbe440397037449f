"""Time decode-sized GEMMs at 4-64 rows: cuBLAS vs ``mrv2.kernels.small_m_gemm`` (GPU).

Qwen3-0.6B shapes (qkv 4096 x 1024, o 1024 x 2048, gate_up 6144 x 1024, down 1024 x 3072),
bf16, M = 4, 8, 16, 32, 64 rows, everything inside CUDA graphs (where cuBLAS's split-K
reductions and memsets are extra launches), timed with CUDA events over ``--replays``
replays, L2 not flushed (the weights of a chain, 117-880 MB, do not fit the 50 MB L2):

1. ``--sweep``: per shape and M, a graph of ``--layers`` products of that shape on distinct
   weights, cuBLAS vs the kernel's default launch and a two-pass search (tiles
   block_m x block_n x block_k at 4 warps, then 2/4/8 warps x 2-5 stages for the best
   tile; ~550 configs, ~150 compiles: estimated at about a minute); us per product;
2. the chain: ``--layers`` x (qkv, o, gate_up, down) in one graph, cuBLAS vs the default
   launch (and ``skinny_linear`` at M <= 8; with ``--sweep`` also the best launch per shape
   and a hybrid taking cuBLAS where it won): the figure that matters for TPOT.

    python scripts/bench_small_m_gemm.py --sweep --out benchmarks/results/small_m_gemm.json
    python scripts/bench_small_m_gemm.py --smoke --out /tmp/s.json     # CPU, tiny, no timing
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# NOTE: mrv2 first: it switches Triton to its interpreter on a machine without CUDA.
from mrv2.platform import DEVICE, HAS_CUDA  # noqa: I001

import torch
import torch.nn.functional as F
import triton

from mrv2.bench.report import git_commit
from mrv2.kernels.skinny_gemm import MAX_M as SKINNY_MAX_M, skinny_linear
from mrv2.kernels.small_m_gemm import _SMEM_BYTES, _launch, _smem_bytes, small_m_linear

SHAPES = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)}
KNOBS = ("block_m", "block_n", "block_k", "num_warps", "num_stages")


class Bench:
    """Device, dtype and timing for one run (``smoke``: fp32, tiny, one call, no timing; on
    mrv2's device, so the interpreter on the CPU and compiled kernels on a GPU)."""

    def __init__(self, smoke: bool, replays: int):
        self.smoke, self.replays = smoke, replays
        self.dev, self.dt = (DEVICE, torch.float32) if smoke else ("cuda", torch.bfloat16)

    def shapes(self) -> dict[str, tuple[int, int]]:
        return {k: (n // 64, k_ // 64) for k, (n, k_) in SHAPES.items()} if self.smoke else SHAPES

    def weights(self, n: int, k: int, layers: int) -> list[torch.Tensor]:
        return [torch.randn(n, k, device=self.dev, dtype=self.dt) * 0.05 for _ in range(layers)]

    def graph_us(self, step) -> float:
        """us per call of ``step`` (eager once, then captured and replayed ``replays`` x)."""
        step()
        if self.smoke:
            return 0.0
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        for _ in range(3):
            graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(self.replays):
            graph.replay()
        end.record()
        end.synchronize()
        del graph
        return start.elapsed_time(end) * 1e3 / self.replays


def _error(bench: Bench, fn, x: torch.Tensor, w: torch.Tensor) -> float:
    """Max |fn(x, w) - fp32 reference| over cuBLAS's own error (<= ~2 is bf16 rounding).
    Smoke (fp32): ``fn`` must equal ``F.linear`` to fp32 rounding, or this raises."""
    ref = F.linear(x.float(), w.float())
    if bench.smoke:
        torch.testing.assert_close(fn(x, w), ref, rtol=1e-4, atol=1e-4)
        return 1.0
    base = (F.linear(x, w).float() - ref).abs().max().item() + 1e-6
    return (fn(x, w).float() - ref).abs().max().item() / base


def _grid(bench: Bench, m: int, n: int, k: int):
    """The sweep's two passes: tiles at 4 warps (4 stages or as many as fit), then warps x
    stages for the best tile."""
    if bench.smoke:
        return [{"block_m": 16, "block_n": 16, "block_k": 16, "num_warps": 4, "num_stages": 2}], []
    bm0 = _launch(m, n, k)["block_m"]
    tiles = []
    for bm, bn, bk in itertools.product((16, 32, 64), (16, 32, 64), (128, 256, 512)):
        fits = [s for s in (4, 3, 2) if _smem_bytes(bm, bn, bk, s) <= _SMEM_BYTES]
        if bm <= bm0 and bk <= triton.next_power_of_2(k) and fits:
            tiles.append({"block_m": bm, "block_n": bn, "block_k": bk, "num_warps": 4,
                          "num_stages": fits[0]})
    refine = [{"num_warps": nw, "num_stages": ns}
              for nw, ns in itertools.product((2, 4, 8), (2, 3, 4, 5))]
    return tiles, refine


class _Case:
    """One shape at one M: ``len(ws)`` products on distinct weights per graph replay."""

    def __init__(self, bench: Bench, x: torch.Tensor, ws: list[torch.Tensor]):
        self.bench, self.x, self.ws, self.tried = bench, x, ws, []

    def per_product_us(self, fn) -> float:
        outs = [None] * len(self.ws)

        def step():
            for i, w in enumerate(self.ws):
                outs[i] = fn(self.x, w)
        return self.bench.graph_us(step) / len(self.ws)

    def run(self, cfg: dict) -> float | None:
        """us per product of ``cfg``; None if it does not fit or computes wrongly."""
        if _smem_bytes(cfg["block_m"], cfg["block_n"], cfg["block_k"],
                       cfg["num_stages"]) > _SMEM_BYTES:
            return None

        def fn(x, w):
            return small_m_linear(x, w, **cfg)
        try:
            err = _error(self.bench, fn, self.x, self.ws[0])
            us = self.per_product_us(fn)
        except triton.runtime.errors.OutOfResources:
            return None
        self.tried.append({**cfg, "us": us, "err_vs_cublas": err})
        return us if err <= 4.0 else None  # NOTE: a wrong config never "wins"


def sweep(bench: Bench, ms: list[int], layers: int) -> list[dict]:
    """Per shape and M: cuBLAS, the default launch and the best found, us per product."""
    rows = []
    for name, (n, k) in bench.shapes().items():
        ws = bench.weights(n, k, layers)
        for m in ms:
            case = _Case(bench, torch.randn(m, k, device=bench.dev, dtype=bench.dt), ws)
            default = _launch(m, n, k)
            row = {"shape": name, "N": n, "K": k, "M": m, "mb": n * k * ws[0].element_size() / 1e6,
                   "cublas_us": case.per_product_us(F.linear), "default_config": default,
                   "default_us": case.run(default)}
            best_us, best = row["default_us"], default
            tiles, refine = _grid(bench, m, n, k)
            for cfg in tiles:
                if (us := case.run(cfg)) is not None and (best_us is None or us < best_us):
                    best_us, best = us, cfg
            for knobs in refine:
                cfg = {**best, **knobs}
                if cfg != best and (us := case.run(cfg)) is not None and us < best_us:
                    best_us, best = us, cfg
            row.update(best_config=best, best_us=best_us, tried=case.tried)
            rows.append(row)
            dflt = "   -   " if row["default_us"] is None else f"{row['default_us']:7.2f}"
            print(f"{name:>8} M={m:<3} cuBLAS {row['cublas_us']:7.2f}  default {dflt}  best "
                  f"{best_us:7.2f} us  {[best[k] for k in KNOBS]}  ({len(case.tried)} configs)",
                  flush=True)
    return rows


def chain(bench: Bench, ms: list[int], layers: int, swept: list[dict]) -> list[dict]:
    """``layers`` x (qkv, o, gate_up, down) on distinct weights in one CUDA graph."""
    shapes = bench.shapes()
    ws = [{name: bench.weights(n, k, 1)[0] for name, (n, k) in shapes.items()}
          for _ in range(layers)]
    mb = sum(w.numel() * w.element_size() for lw in ws for w in lw.values()) / 1e6
    rows = []
    for m in ms:
        xs = {name: torch.randn(m, k, device=bench.dev, dtype=bench.dt)
              for name, (_, k) in shapes.items()}
        fns = {"cublas": {s: F.linear for s in shapes},
               "small_m": {s: small_m_linear for s in shapes}}
        if m <= SKINNY_MAX_M:
            fns["skinny"] = {s: skinny_linear for s in shapes}
        best = {r["shape"]: r for r in swept if r["M"] == m}
        if len(best) == len(shapes):
            fns["small_m_best"] = {s: (lambda x, w, c=best[s]["best_config"]:
                                       small_m_linear(x, w, **c)) for s in shapes}
            fns["hybrid"] = {s: (fns["small_m_best"][s] if (best[s]["best_us"] or 1e30)
                                 < best[s]["cublas_us"] else F.linear) for s in shapes}
        out = {}
        line = f"chain M={m:<3}"
        for label, fn in fns.items():
            def step(fn=fn, xs=xs, out=out):
                for layer in ws:
                    for name, w in layer.items():
                        out[name] = fn[name](xs[name], w)
            us = bench.graph_us(step)
            err = max(_error(bench, lambda x, w, f=fn[name]: f(x, w), xs[name], w)
                      for name, w in ws[-1].items())  # the last layer's products vs fp32
            rows.append({"M": m, "runner": label, "us_per_step": us, "weight_mb": mb,
                         "tb_s": mb / us * 1e-6 if us else None, "err_vs_cublas": err})
            line += f"  {label} {us:8.1f}"
        print(line + f" us  ({mb:.0f} MB)", flush=True)
    return rows


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark; returns the JSON it wrote."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny fp32 sizes, no timing (CPU)")
    ap.add_argument("--sweep", action="store_true", help="also search launches per shape and M")
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--replays", type=int, default=150)
    ap.add_argument("--ms", default=None, help="comma-separated row counts (4,8,16,32,64)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "small_m_gemm.json"))
    args = ap.parse_args(argv)
    if not HAS_CUDA and not args.smoke:
        raise SystemExit("bench_small_m_gemm times the GPU; use --smoke on the CPU")
    bench = Bench(args.smoke, args.replays)
    layers = 2 if args.smoke else args.layers
    ms = ([int(v) for v in args.ms.split(",")] if args.ms else
          [4, 17] if args.smoke else [4, 8, 16, 32, 64])
    t0 = time.time()
    swept = sweep(bench, ms, layers) if args.sweep else []
    t_sweep = time.time() - t0
    rows = chain(bench, ms, layers, swept)
    totals = {}
    for m in ms:
        per = {r["runner"]: r["us_per_step"] for r in rows if r["M"] == m}
        totals[str(m)] = {**per, "ratio_small_m": per["small_m"] / per["cublas"]
                          if per["cublas"] else None}
    report = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
              "commit": git_commit(), "smoke": args.smoke,
              "hardware": torch.cuda.get_device_name() if HAS_CUDA else "cpu",
              "versions": {"torch": torch.__version__, "triton": triton.__version__},
              "layers": layers, "replays": args.replays, "sweep_wall_s": t_sweep,
              "sweep": swept, "chain": rows, "totals": totals}
    pathlib.Path(args.out).write_text(json.dumps(report, indent=1))
    print("\nchain totals, us per step (ratio_small_m = small_m / cublas):")
    for m in ms:
        print(f"  M={m:<3}" + "".join(f"  {r} {v:.3f}" for r, v in totals[str(m)].items()
                                    if v is not None))
    print(f"sweep {t_sweep:.0f} s; wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
