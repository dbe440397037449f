"""Where a throughput workload's GPU time goes, step by step: prefill vs decode, by batch size.

Runs the workload (default ``standard``) on the V2 runner with a ``mrv2.timeline.Timeline``
attached, records each step's scheduled tokens, requests and context sum from the scheduler,
and adds up the GPU span of every step: prefill steps (more tokens than requests) and decode
steps, the latter grouped by batch size (buckets of 32 requests) beside their roofline
(weights + every request's context read once, at 4.24 TB/s). The first run is untimed
(compiles, graph captures). Session 13 used it to find that the standard workload's decode
steps run at ~72% of their roofline, the prefill steps take ~6% of the time, and small
batches (< 64 requests, long contexts) are the least efficient (47-64%).

    python scripts/standard_steps.py --out /tmp/steps.json            # GPU, dummy Qwen3-0.6B
    python scripts/standard_steps.py --tiny --out /tmp/steps.json     # CPU smoke (no GPU spans)
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from mrv2.bench import llm_runs
from mrv2.bench.roofline import decode_roofline, model_info
from mrv2.bench.workloads import make_workload
from mrv2.timeline import Timeline

BANDWIDTH_GBS = 4240.0            # H200 copy bandwidth (PLATFORM.md), not re-measured here


def summarize(recs: list[dict], gpu: dict[int, tuple[float, float]], info: dict,
              bandwidth_gbs: float = BANDWIDTH_GBS) -> tuple[dict, dict]:
    """(totals, decode buckets) from per-step records and GPU spans ``step -> (start, end)``;
    ``info``: ``model_info``'s ``weight_bytes`` and ``kv_bytes_per_token`` (the roofline)."""
    tot = {"prefill_steps": 0, "prefill_gpu_ms": 0.0, "decode_steps": 0, "decode_gpu_ms": 0.0,
           "decode_roofline_ms": 0.0}
    buckets: dict[int, dict] = {}
    for r in recs:
        span = gpu.get(r["step"])
        if span is None or r["tokens"] == 0:
            continue
        ms = span[1] - span[0]
        if r["tokens"] > r["reqs"]:
            tot["prefill_steps"] += 1
            tot["prefill_gpu_ms"] += ms
            continue
        roof = decode_roofline(info["weight_bytes"], info["kv_bytes_per_token"], r["reqs"],
                               r["ctx"] / r["reqs"], bandwidth_gbs)["step_ms"]
        tot["decode_steps"] += 1
        tot["decode_gpu_ms"] += ms
        tot["decode_roofline_ms"] += roof
        b = buckets.setdefault(min(r["reqs"] // 32 * 32, 256),
                               {"steps": 0, "gpu_ms": 0.0, "roof_ms": 0.0, "ctx_sum": 0.0})
        b["steps"] += 1
        b["gpu_ms"] += ms
        b["roof_ms"] += roof
        b["ctx_sum"] += r["ctx"] / r["reqs"]
    out = {k: {"steps": b["steps"], "gpu_ms": b["gpu_ms"], "roof_ms": b["roof_ms"],
               "mean_ctx": b["ctx_sum"] / b["steps"]} for k, b in sorted(buckets.items())}
    return tot, out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="standard")
    ap.add_argument("--model", default=None,
                    help="default: $MRV2_SHARED_DATA/qwen3-tokenizer with dummy weights")
    ap.add_argument("--tiny", action="store_true", help="the embedded model, 8 short requests")
    ap.add_argument("--out", required=True)
    ap.add_argument("--set", action="append", default=[], metavar="MODULE:ATTR=JSON",
                    help="set a module knob first, as scripts/bench_with.py --set (repeatable)")
    args = ap.parse_args(argv)
    if args.set:
        sys.path.insert(0, str(ROOT / "scripts"))
        from bench_with import apply_set
        for spec in args.set:
            apply_set(spec)
    if args.tiny:
        spec, vocab = llm_runs.ModelSpec(None, "auto"), 2048
        wl = make_workload(args.workload, vocab, 0, 8, 16, 8, True)
    else:
        from transformers import AutoConfig
        model = args.model or os.path.join(os.environ.get("MRV2_SHARED_DATA", "../shared/data"),
                                           "qwen3-tokenizer")
        spec, vocab = llm_runs.ModelSpec(model, "dummy"), AutoConfig.from_pretrained(model).vocab_size
        wl = make_workload(args.workload, vocab, 0)
    wl.temperature = 0.6
    llm = llm_runs.build_llm(spec, "v2", llm_runs.EngineSizes(256, wl.max_len, None))
    llm_runs.warm_up(llm, wl, 32, 16)
    llm_runs.generate_timed(llm, wl)  # untimed: the first full run compiles and captures
    sched, tl, recs = llm.engine.scheduler, Timeline(), []
    schedule = sched.schedule

    def recording_schedule():
        o = schedule()
        recs.append({"step": tl.step, "tokens": o.total_num_scheduled_tokens,
                     "reqs": len(o.num_scheduled_tokens), "max_seq_len": o.max_seq_len,
                     "ctx": sum(r.num_computed_tokens for r in sched.running
                                if r.request_id in o.num_scheduled_tokens)})
        return o

    sched.schedule = recording_schedule
    llm.engine.timeline = tl
    run = llm_runs.generate_timed(llm, wl)
    tl.finalize()
    gpu: dict[int, list[float]] = {}
    for s, _, a, b in tl.gpu_spans:
        g = gpu.setdefault(s, [a, b])
        g[0], g[1] = min(g[0], a), max(g[1], b)
    totals, buckets = summarize(recs, gpu, model_info(llm.model, llm.hf_config, llm.dtype))
    from mrv2.bench.report import environment

    res = {**environment(), "workload": args.workload, "attention_order":
           os.environ.get("MRV2_ATTENTION_ORDER", "1") != "0", "set": args.set,
           "run": run, "summary": totals, "buckets": buckets,
           "recs": recs, "gpu": {str(k): v for k, v in gpu.items()}}
    pathlib.Path(args.out).write_text(json.dumps(res))
    print(json.dumps({"output_tok_s": run["output_tok_s"], **totals}, indent=1))
    for k, b in buckets.items():
        print(f"{k:>4}+ reqs: {b['steps']:>4} steps {b['gpu_ms'] / b['steps']:7.3f} ms/step, "
              f"{b['roof_ms'] / b['gpu_ms']:.0%} of roofline, mean context {b['mean_ctx']:.0f}")
    return res


if __name__ == "__main__":
    main()
