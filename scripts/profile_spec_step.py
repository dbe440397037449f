"""Where a speculating decode step spends its time: per-phase CPU/GPU split and top host ops.

For each method (no speculation, n-gram, draft model, EAGLE) on the embedded model, one
request at a time (batch 1, the latency case), this runs the ``repetitive`` workload once
untimed, then records:

- ``mrv2.timeline``'s mean CPU ms per phase and GPU ms per span of one step, and the
  tokens per step (mean accepted length + ...), so ``step ms / tokens per step`` is TPOT;
- a ``torch.profiler`` table of the host's most expensive ops and the runner's functions
  (``record_function`` around ``expand`` / ``verify`` / ``finish`` / ``propose``).

Usage (GPU)::

    python scripts/profile_spec_step.py --out /tmp/spec_profile.json
    python scripts/profile_spec_step.py --methods none,ngram --steps 64 --k 3

Not a benchmark: the profiler slows the host. TPOT figures come from ``python -m mrv2
bench latency --speculative ...``.
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import mrv2  # noqa: F401, I001  (first: it sets up Triton on a CPU)
import torch

from mrv2 import LLM, SamplingParams
from mrv2.bench.spec import EMBEDDED_DRAFT_DIR, EMBEDDED_EAGLE_DIR
from mrv2.bench.workloads import EMBEDDED_LOOP, make_workload
from mrv2.timeline import Timeline


def _wrap(obj, name: str, label: str) -> None:
    """Put a ``record_function(label)`` around ``obj.name`` (an instance attribute)."""
    fn = getattr(obj, name)

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with torch.profiler.record_function(label):
            return fn(*args, **kwargs)

    setattr(obj, name, wrapped)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _config(method: str, k: int) -> dict | None:
    if method == "none":
        return None
    cfg = {"method": method, "num_speculative_tokens": k}
    if method == "draft_model":
        cfg["model"] = str(EMBEDDED_DRAFT_DIR)
    elif method == "eagle":
        cfg["model"] = str(EMBEDDED_EAGLE_DIR)
    return cfg


def profile_method(method: str, k: int, output_len: int, top: int, cprofile_top: int = 0
                   ) -> dict:
    """One method's timeline summary and top host ops at batch 1."""
    llm = LLM(speculative_config=_config(method, k))
    wl = make_workload("repetitive", llm.hf_config.vocab_size, num_requests=1,
                       loop=EMBEDDED_LOOP)
    prompt = wl.requests()[0]
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for _ in range(2):  # warm: compiles, graphs
        llm.generate([prompt], params, use_tqdm=False)
    _sync()
    t0 = time.perf_counter()
    llm.generate([prompt], params, use_tqdm=False)
    _sync()
    wall = time.perf_counter() - t0
    engine = llm.engine
    tl = Timeline()
    engine.timeline = tl
    llm.generate([prompt], params, use_tqdm=False)
    engine.timeline = None
    tl.finalize()
    summary = tl.summary()
    runner = llm.runner
    if runner.spec is not None:
        for name in ("expand", "verify", "finish"):
            _wrap(runner.spec, name, f"spec.{name}")
        if runner.spec.draft is not None:
            _wrap(runner.spec.draft, "propose", "draft.propose")
    _wrap(runner, "execute_model", "runner.execute_model")
    _wrap(engine.scheduler, "schedule", "scheduler.schedule")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        llm.generate([prompt], params, use_tqdm=False)
    _sync()
    table = prof.key_averages().table(sort_by="cpu_time_total", row_limit=top)
    if torch.cuda.is_available():  # where the GPU's time goes
        table += "\n" + prof.key_averages().table(sort_by="self_cuda_time_total",
                                                  row_limit=top)
    steps = summary.get("num_steps") if isinstance(summary, dict) else None
    cprofile = None
    if cprofile_top:
        import cProfile
        import io
        import pstats

        prof_py = cProfile.Profile()
        prof_py.enable()
        llm.generate([prompt], params, use_tqdm=False)
        _sync()
        prof_py.disable()
        buf = io.StringIO()
        stats = pstats.Stats(prof_py, stream=buf)
        stats.sort_stats("tottime").print_stats(cprofile_top)
        stats.sort_stats("cumulative").print_stats(cprofile_top)
        cprofile = buf.getvalue()
    return {"method": method, "k": k, "output_len": output_len, "wall_s": wall,
            "tpot_ms": wall * 1e3 / output_len, "timeline": summary, "steps": steps,
            "profile_table": table, "cprofile": cprofile}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--methods", default="none,ngram,draft_model,eagle")
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--out", default=None)
    p.add_argument("--cprofile", type=int, default=0,
                   help="also print the N most expensive Python functions (cProfile)")
    args = p.parse_args()
    results = []
    for method in args.methods.split(","):
        r = profile_method(method, args.k, args.output_len, args.top, args.cprofile)
        print(f"== {method}: wall TPOT {r['tpot_ms']:.3f} ms")
        print(json.dumps(r["timeline"], indent=1, default=str)[:3000])
        print(r["profile_table"])
        if r["cprofile"]:
            print(r["cprofile"])
        results.append(r)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main()
