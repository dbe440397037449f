"""Benchmark Triton Gumbel-max sampling (+ top-k/top-p) against torch's softmax + multinomial.

The torch baseline materialises ``softmax(logits / T)`` and draws with
``torch.multinomial``; with top-k/top-p it first sorts every row. The Triton path adds
hashed Gumbel noise block by block and reduces an argmax (no softmax, no sort), and
finds the top-k/top-p threshold by a pivot search over the row. Writes JSON (hardware,
versions, date, every figure) for notebooks/05_gumbel_sampling.ipynb.

    python scripts/bench_sampler.py                       # GPU: 256 x 151,936
    python scripts/bench_sampler.py --smoke --out /tmp/s.json   # tiny, runs on the CPU
    python scripts/bench_sampler.py --sweep                # + launch configs (block, warps)
    python scripts/bench_sampler.py --filter-only --out benchmarks/results/top_k_top_p.json
        # the filter alone: chunked search vs the one-program-per-row kernel vs torch's sort
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import platform as py_platform
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# NOTE: mrv2 first: it switches Triton to its interpreter on a machine without CUDA.
from mrv2.platform import DEVICE, HAS_CUDA  # noqa: I001

import torch
import triton

from mrv2.bench.report import git_commit
from mrv2.kernels.gumbel import gumbel_sample
from mrv2.kernels.top_k_top_p import apply_top_k_top_p_min_p, top_k_top_p_workspace
from mrv2.kernels.top_k_top_p import top_k_top_p_min_p_sorted as torch_top_k_top_p


def _time_us(fn) -> float:
    """Median time of fn() in microseconds (CUDA: do_bench; CPU: one warm, one timed run)."""
    if HAS_CUDA:
        fn()
        torch.cuda.synchronize()
        return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3
    fn()
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e6


def run_case(num_rows: int, vocab: int, dtype: torch.dtype, temperature: float,
             top_k: int, top_p: float) -> dict:
    """Time the Triton and the torch sampler on one shape; returns the figures."""
    g = torch.Generator(device=DEVICE).manual_seed(0)
    logits = (torch.randn(num_rows, vocab, device=DEVICE, generator=g) * 3).to(dtype)
    idx = torch.arange(num_rows, dtype=torch.int32, device=DEVICE)
    temp = torch.full((num_rows,), temperature, device=DEVICE)
    seed = torch.arange(num_rows, dtype=torch.int64, device=DEVICE)
    pos = torch.full((num_rows,), 1000, dtype=torch.int64, device=DEVICE)
    k = torch.full((num_rows,), top_k, dtype=torch.int32, device=DEVICE)
    p = torch.full((num_rows,), top_p, device=DEVICE)
    mp = torch.zeros(num_rows, device=DEVICE)
    filtered = top_k > 0 or top_p < 1.0
    work = logits.clone()

    def triton_path():
        x = logits
        if filtered:
            work.copy_(logits)  # NOTE: in place; restore so every run sees the same row
            x = apply_top_k_top_p_min_p(work, idx, temp, k, p, mp)
        return gumbel_sample(x, idx, temp, seed, pos)

    def torch_path():
        x = logits.float() / temp[:, None]
        if filtered:
            x = torch_top_k_top_p(x, k, p, mp)
        return torch.multinomial(torch.softmax(x, dim=-1), 1)

    row = {"num_rows": num_rows, "vocab": vocab, "dtype": str(dtype).replace("torch.", ""),
           "temperature": temperature, "top_k": top_k, "top_p": top_p,
           "triton_us": _time_us(triton_path), "torch_us": _time_us(torch_path)}
    if filtered:
        row["triton_top_k_top_p_only_us"] = _time_us(
            lambda: apply_top_k_top_p_min_p(work.copy_(logits), idx, temp, k, p, mp))
        row["copy_only_us"] = _time_us(lambda: work.copy_(logits))
        row["torch_top_k_top_p_only_us"] = _time_us(
            lambda: torch_top_k_top_p(logits.float() / temp[:, None], k, p, mp))
    row["speedup"] = row["torch_us"] / row["triton_us"]
    return row


def filter_case(num_rows: int, vocab: int, dtype: torch.dtype, temperature: float,
                top_k: int, top_p: float, min_p: float) -> dict:
    """Time the filter alone: chunked search, one-program-per-row search, torch's sort.

    Each Triton figure includes restoring the logits (``copy_only_us``, also reported),
    since the filter works in place. Also counts the tokens where the two searches differ.
    """
    g = torch.Generator(device=DEVICE).manual_seed(0)
    logits = (torch.randn(num_rows, vocab, device=DEVICE, generator=g) * 3).to(dtype)
    idx = torch.arange(num_rows, dtype=torch.int32, device=DEVICE)
    temp = torch.full((num_rows,), temperature, device=DEVICE)
    k = torch.full((num_rows,), top_k, dtype=torch.int32, device=DEVICE)
    p = torch.full((num_rows,), top_p, device=DEVICE)
    mp = torch.full((num_rows,), min_p, device=DEVICE)
    ws = top_k_top_p_workspace(num_rows, vocab, DEVICE)
    work = logits.clone()

    def chunked():
        return apply_top_k_top_p_min_p(work.copy_(logits), idx, temp, k, p, mp,
                                       method="chunked", workspace=ws)

    def row_kernel():
        return apply_top_k_top_p_min_p(work.copy_(logits), idx, temp, k, p, mp, method="row")

    kept_chunked = chunked() > float("-inf")
    kept_row = row_kernel() > float("-inf")
    graph_us = None
    if HAS_CUDA:
        # NOTE: the step path replays the filter inside a CUDA graph: no Python launch cost.
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            chunked()
        graph_us = _time_us(graph.replay)
    return {"num_rows": num_rows, "vocab": vocab, "dtype": str(dtype).replace("torch.", ""),
            "temperature": temperature, "top_k": top_k, "top_p": top_p, "min_p": min_p,
            "chunked_us": _time_us(chunked), "chunked_graph_us": graph_us,
            "row_us": _time_us(row_kernel),
            "torch_sort_us": _time_us(
                lambda: torch_top_k_top_p(logits.float() / temp[:, None], k, p, mp)),
            "copy_only_us": _time_us(lambda: work.copy_(logits)),
            "kept_per_row": kept_chunked.sum(1).float().mean().item(),
            "tokens_differing": (kept_chunked != kept_row).sum().item()}


def sweep(num_rows: int, vocab: int, dtype: torch.dtype, smoke: bool,
          filter_only: bool = False, gumbel_only: bool = False) -> list[dict]:
    """Time each kernel alone under a few launch configs (T = 0.6; top_k 20, top_p 0.95).

    ``filter_only``: only the chunked top-k/top-p configs (and the copy they include);
    ``gumbel_only``: only the Gumbel sampler's (and the copy).
    """
    g = torch.Generator(device=DEVICE).manual_seed(0)
    logits = (torch.randn(num_rows, vocab, device=DEVICE, generator=g) * 3).to(dtype)
    idx = torch.arange(num_rows, dtype=torch.int32, device=DEVICE)
    temp = torch.full((num_rows,), 0.6, device=DEVICE)
    seed = torch.arange(num_rows, dtype=torch.int64, device=DEVICE)
    pos = torch.full((num_rows,), 1000, dtype=torch.int64, device=DEVICE)
    k = torch.full((num_rows,), 20, dtype=torch.int32, device=DEVICE)
    p = torch.full((num_rows,), 0.95, device=DEVICE)
    mp = torch.zeros(num_rows, device=DEVICE)
    work = logits.clone()
    dt = str(dtype).replace("torch.", "")
    rows = []
    # (block_v, sub_v, warps, stages, unroll): stages pipelines the bound loop's logit loads
    # (tl.range num_stages: cp.async into shared memory), unroll unrolls it (loads issued
    # together); None leaves the loop as it is.
    g_cfgs = ([] if filter_only else [(256, 64, 4, None, None)] if smoke else
              [(bv, sv, 4, None, None) for bv in (4096, 8192) for sv in (512, 1024)]
              + [(8192, 1024, 8, None, 2), (4096, 256, 4, None, 4), (4096, 512, 4, None, 2)])
    for bv, sv, nw, st, un in g_cfgs:
        us = _time_us(lambda bv=bv, sv=sv, nw=nw, st=st, un=un: gumbel_sample(
            logits, idx, temp, seed, pos, block_v=bv, sub_v=sv, num_warps=nw, stages=st,
            unroll=un))
        rows.append({"kernel": "gumbel", "dtype": dt,
                     "config": f"block_v={bv} sub_v={sv} warps={nw} stages={st} unroll={un}",
                     "us": us})
    k_cfgs = ([] if filter_only or gumbel_only else [(256, 16, None)] if smoke else
              [(bv, np_, nw) for bv in (128, 256, 512, 1024) for np_ in (8, 16, 32)
               for nw in (4, 8)])
    for bv, np_, nw in k_cfgs:
        us = _time_us(lambda bv=bv, np_=np_, nw=nw: apply_top_k_top_p_min_p(
            work.copy_(logits), idx, temp, k, p, mp, block_v=bv, num_pivots=np_, num_warps=nw,
            method="row"))
        rows.append({"kernel": "top_k_top_p_row", "dtype": dt,
                     "config": f"block_v={bv} pivots={np_} warps={nw}", "us": us})
    c_cfgs = ([] if gumbel_only else [(64, 256, 16, None)] if smoke else
              [(bv, cv, np_, nw) for bv, cv in ((256, 2048), (128, 4096), (256, 4096),
                                                (512, 4096)) for np_ in (16, 32)
               for nw in (4, 8, 16)])
    # NOTE: 16 warps since session 9: bf16's _count_kernel takes 118 registers at 8 warps
    # (fp32: 80) and 64 at 16 (Triton 3.6, sm_90a, ptxas offline), a lead for its 2x cost.
    for bv, cv, np_, nw in c_cfgs:
        ws = top_k_top_p_workspace(num_rows, vocab, DEVICE, block_v=bv, chunk_v=cv,
                                   num_pivots=np_)
        us = _time_us(lambda bv=bv, cv=cv, np_=np_, nw=nw, ws=ws: apply_top_k_top_p_min_p(
            work.copy_(logits), idx, temp, k, p, mp, block_v=bv, chunk_v=cv, num_pivots=np_,
            num_warps=nw, workspace=ws, method="chunked"))
        rows.append({"kernel": "top_k_top_p_chunked", "dtype": dt,
                     "config": f"block_v={bv} chunk_v={cv} pivots={np_} warps={nw}", "us": us})
    rows.append({"kernel": "copy_only", "dtype": dt, "config": "-",
                 "us": _time_us(lambda: work.copy_(logits))})
    return rows


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark; returns the JSON it wrote."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (runs on the CPU)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "sampler.json"))
    ap.add_argument("--sweep", action="store_true",
                    help="also time block/warp configs of both kernels (fp32 and bf16)")
    ap.add_argument("--gumbel-only", action="store_true",
                    help="with --sweep: only the Gumbel sampler's configs")
    ap.add_argument("--filter-only", action="store_true",
                    help="only the top-k/top-p/min-p filter: chunked vs row kernel vs sort")
    args = ap.parse_args(argv)
    if not HAS_CUDA and not args.smoke:
        ap.error("the full benchmark needs a CUDA GPU; use --smoke on the CPU")
    num_rows, vocab = (4, 1000) if args.smoke else (256, 151_936)
    dtypes = [torch.float32] if not HAS_CUDA else [torch.float32, torch.bfloat16]
    if args.filter_only:
        return filter_main(num_rows, vocab, dtypes, args)
    settings = [(0.6, -1, 1.0), (0.6, 20, 0.95)]
    results = [run_case(num_rows, vocab, dt, t, k, p) for dt in dtypes for t, k, p in settings]
    report = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "hardware": torch.cuda.get_device_name() if HAS_CUDA else py_platform.processor() or "cpu",
        "versions": {"python": py_platform.python_version(), "torch": torch.__version__,
                     "triton": triton.__version__},
        "git_commit": git_commit(),  # the book's figure labels (mrv2.bench.book_plots)
        "smoke": args.smoke,
        "results": results,
    }
    if args.sweep:
        report["sweep"] = [r for dt in dtypes for r in sweep(num_rows, vocab, dt, args.smoke,
                                                             gumbel_only=args.gumbel_only)]
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"{'dtype':>8} {'T':>4} {'top_k':>5} {'top_p':>5} {'triton us':>10} {'torch us':>10} "
          f"{'speedup':>7}")
    for r in results:
        print(f"{r['dtype']:>8} {r['temperature']:>4} {r['top_k']:>5} {r['top_p']:>5} "
              f"{r['triton_us']:>10.1f} {r['torch_us']:>10.1f} {r['speedup']:>7.2f}")
    for r in report.get("sweep", []):
        print(f"sweep {r['kernel']:>12} {r['dtype']:>8} {r['config']} {r['us']:>10.1f} us")
    print(f"wrote {out}")
    return report


def filter_main(num_rows: int, vocab: int, dtypes: list, args) -> dict:
    """The --filter-only run: each filter setting, fp32 and bf16; returns the JSON it wrote."""
    settings = [(0.6, 20, 0.95, 0.0), (0.6, 20, 1.0, 0.0), (0.6, -1, 0.95, 0.0),
                (1.0, -1, 0.9, 0.0), (0.6, -1, 1.0, 0.05), (0.6, 64, 0.95, 0.05)]
    results = [filter_case(num_rows, vocab, dt, *st) for dt in dtypes for st in settings]
    report = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "hardware": torch.cuda.get_device_name() if HAS_CUDA else py_platform.processor() or "cpu",
        "versions": {"python": py_platform.python_version(), "torch": torch.__version__,
                     "triton": triton.__version__},
        "smoke": args.smoke,
        "filter_results": results,
    }
    if args.sweep:
        report["sweep"] = [r for dt in dtypes
                           for r in sweep(num_rows, vocab, dt, args.smoke, filter_only=True)]
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"{'dtype':>8} {'T':>4} {'top_k':>5} {'top_p':>5} {'min_p':>5} {'chunked us':>10} "
          f"{'graph us':>9} {'row us':>9} {'sort us':>9} {'copy us':>8} {'kept':>8} "
          f"{'differ':>6}")
    for r in results:
        graph = r["chunked_graph_us"] or float("nan")
        print(f"{r['dtype']:>8} {r['temperature']:>4} {r['top_k']:>5} {r['top_p']:>5} "
              f"{r['min_p']:>5} {r['chunked_us']:>10.1f} {graph:>9.1f} {r['row_us']:>9.1f} "
              f"{r['torch_sort_us']:>9.1f} {r['copy_only_us']:>8.1f} {r['kept_per_row']:>8.1f} "
              f"{r['tokens_differing']:>6}")
    for r in report.get("sweep", []):
        print(f"sweep {r['kernel']:>20} {r['dtype']:>8} {r['config']} {r['us']:>10.1f} us")
    print(f"wrote {out}")
    return report


if __name__ == "__main__":
    main()
