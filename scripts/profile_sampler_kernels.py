"""Per-kernel GPU time of the sampling stage: the top-k/top-p filter's passes and Gumbel-max.

``scripts/bench_sampler.py`` times the whole filter and the whole sampler; this script asks
the torch profiler which kernel the time goes to, per dtype, so a change to one pass can
be aimed and checked: ``_stats_kernel`` (one read of the logits), ``_init_kernel``, the
``NUM_ROUNDS`` x ``_count_kernel`` / ``_narrow_kernel`` rounds, ``_write_kernel``, then
``_gumbel_block_argmax_kernel`` and its reduction. It also reports, per search round,
how many rows still have an open bracket (the rows whose count programs do real work),
from the workspace after each ``_narrow_kernel``.

    python scripts/profile_sampler_kernels.py --out benchmarks/results/sampler_kernels.json
    python scripts/profile_sampler_kernels.py --smoke --out /tmp/k.json   # CPU: tiny, no times

Session 9 (H200, job 9E, 256 x 151,936, top-k 20 / top-p 0.95, the same idea in a scratch
script): ``_count_kernel`` 518 us a call in fp32 vs 949 us in bf16 although the brackets
close in the same rounds; ``_write_kernel`` 113 vs 148, ``_stats_kernel`` 60 vs 55.
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# NOTE: mrv2 first: it switches Triton to its interpreter on a machine without CUDA.
from mrv2.platform import DEVICE, HAS_CUDA  # noqa: I001

import torch
import triton
from torch.profiler import ProfilerActivity, profile

from mrv2.bench.report import git_commit
from mrv2.kernels import top_k_top_p
from mrv2.kernels.gumbel import gumbel_sample


def _inputs(rows: int, vocab: int, dtype: torch.dtype, top_k: int, top_p: float) -> dict:
    g = torch.Generator(device=DEVICE).manual_seed(0)
    full = {"device": DEVICE}
    return {"logits": (torch.randn(rows, vocab, generator=g, **full) * 3).to(dtype),
            "idx": torch.arange(rows, dtype=torch.int32, **full),
            "temp": torch.full((rows,), 0.6, **full),
            "k": torch.full((rows,), top_k, dtype=torch.int32, **full),
            "p": torch.full((rows,), top_p, **full), "mp": torch.zeros(rows, **full),
            "seed": torch.arange(rows, dtype=torch.int64, **full),
            "pos": torch.full((rows,), 1000, dtype=torch.int64, **full)}


def open_rows_per_round(x: dict) -> list[int]:
    """Rows whose top-k or top-p bracket is still open after init and after each round
    (``hi - lo > 1``), read from the workspace after every ``_narrow_kernel`` launch."""
    rows = x["logits"].shape[0]
    seen, orig = [], top_k_top_p._narrow_kernel
    ws = top_k_top_p.top_k_top_p_workspace(rows, x["logits"].shape[1], x["logits"].device)

    class _Spy:
        def __getitem__(self, grid):
            launch = orig[grid]

            def run(*args, **kwargs):
                launch(*args, **kwargs)
                b = ws.bracket[:rows, :4]
                seen.append(int((((b[:, 1] - b[:, 0]) > 1) | ((b[:, 3] - b[:, 2]) > 1))
                                .sum().item()))
            return run
    top_k_top_p._narrow_kernel = _Spy()
    try:
        top_k_top_p.apply_top_k_top_p_min_p(x["logits"].clone(), x["idx"], x["temp"], x["k"],
                                            x["p"], x["mp"], method="chunked", workspace=ws)
    finally:
        top_k_top_p._narrow_kernel = orig
    return seen


def profile_dtype(rows: int, vocab: int, dtype: torch.dtype, top_k: int, top_p: float,
                  calls: int, smoke: bool) -> dict:
    """Per-kernel GPU microseconds a call of filter + sampler (zeros in smoke mode)."""
    x = _inputs(rows, vocab, dtype, top_k, top_p)
    work = x["logits"].clone()
    method = "chunked"

    def step():
        work.copy_(x["logits"])               # NOTE: the filter works in place
        top_k_top_p.apply_top_k_top_p_min_p(work, x["idx"], x["temp"], x["k"], x["p"],
                                            x["mp"], method=method)
        return gumbel_sample(work, x["idx"], x["temp"], x["seed"], x["pos"])

    for _ in range(1 if smoke else 3):
        step()
    kernels = []
    if not smoke:
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                step()
            torch.cuda.synchronize()
        for ev in prof.key_averages():
            us = getattr(ev, "device_time_total", None)
            if us is None:
                us = ev.cuda_time_total
            if us > 0:
                kernels.append({"name": ev.key, "us_per_call": us / calls,
                                "launches_per_call": ev.count / calls})
        kernels.sort(key=lambda k: -k["us_per_call"])
    kept = (work > float("-inf")).sum(1).float()
    return {"dtype": str(dtype).replace("torch.", ""), "kernels": kernels,
            "open_rows_per_round": open_rows_per_round(x),
            "kept_per_row": {"mean": kept.mean().item(), "min": kept.min().item(),
                             "max": kept.max().item()}}


def main(argv: list[str] | None = None) -> dict:
    """Profile; returns the JSON it wrote."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU, no timing")
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--top-k", type=int, default=20)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--calls", type=int, default=5, help="profiled calls per dtype")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" /
                                         "sampler_kernels.json"))
    args = ap.parse_args(argv)
    if not HAS_CUDA and not args.smoke:
        raise SystemExit("profile_sampler_kernels profiles the GPU; use --smoke on the CPU")
    rows, vocab = (4, 4096) if args.smoke else (args.rows, args.vocab)
    dtypes = (torch.float32,) if args.smoke else (torch.float32, torch.bfloat16)
    report = {"benchmark": "sampler kernels profile",
              "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "hardware": torch.cuda.get_device_name() if HAS_CUDA else "cpu",
              "versions": {"torch": torch.__version__, "triton": triton.__version__},
              "git_commit": git_commit(), "smoke": args.smoke,
              "shape": {"rows": rows, "vocab": vocab, "top_k": args.top_k, "top_p": args.top_p,
                        "temperature": 0.6},
              "points": [profile_dtype(rows, vocab, dt, args.top_k, args.top_p, args.calls,
                                       args.smoke) for dt in dtypes]}
    for pt in report["points"]:
        print(f"{pt['dtype']}: rows with an open bracket after each round {pt['open_rows_per_round']}")
        for k in pt["kernels"][:10]:
            print(f"  {k['us_per_call']:9.1f} us  x{k['launches_per_call']:4.1f}  "
                  f"{k['name'][:60]}")
    pathlib.Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
