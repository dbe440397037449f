"""Probe: why do ``bench decode --compare-eager``'s CUDA-graph steps at batch 64 and 128 cost
eager time (job 18C: 18.1 and 21.6 ms a step, against 1.5 and 1.9 ms in the same job's
profile of the same batch sizes)?

The two measurements differ in prefix caching (the profile turns it off, the comparison
leaves the default on) and in the prompts' seeds. For each batch size and prefix-caching
setting this times ``1 + steps`` minus ``1`` output tokens, as ``bench/steps.py`` does,
and prints the graph replays and eager steps (``CudaGraphManager`` counters) and the
Triton compiles of the timed runs.

    python scripts/probe_graph_steps.py --batch-sizes 32,64,128 --out probe.json
"""

from __future__ import annotations

import argparse
import json

import torch

from mrv2 import LLM, SamplingParams
from mrv2.bench.steps import _default_llm_kwargs
from mrv2.bench.timing import count_triton_compiles, random_token_prompts, timed_generate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-sizes", default="32,64,128")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    rows = []
    for caching in (True, False):
        llm = LLM(**{**_default_llm_kwargs(None, 2048 if torch.cuda.is_available() else 512), "max_num_seqs": 256,
                     "enable_prefix_caching": caching})
        graphs = llm.runner.cuda_graphs
        vocab = llm.hf_config.vocab_size
        for b in sizes:
            prompts = random_token_prompts(b, args.context, vocab, seed=b)
            full, first = (SamplingParams(temperature=0.6, max_tokens=n, ignore_eos=True, seed=0)
                           for n in (1 + args.steps, 1))
            timed_generate(llm, prompts, full)  # warm-up
            r0, e0 = dict(graphs.num_replays), dict(graphs.num_eager)
            with count_triton_compiles() as names:
                t_full = timed_generate(llm, prompts, full)
                t_first = timed_generate(llm, prompts, first)
            delta = {k: graphs.num_replays[k] - r0.get(k, 0) for k in graphs.num_replays}
            eager = {k: graphs.num_eager[k] - e0.get(k, 0) for k in graphs.num_eager}
            row = {"prefix_caching": caching, "batch": b,
                   "ms_per_step": (t_full - t_first) / args.steps * 1e3,
                   "full_s": t_full, "first_s": t_first, "replays": delta, "eager": eager,
                   "triton_compiles": len(names), "compiled": sorted(set(names))}
            rows.append(row)
            print(json.dumps(row), flush=True)
        del llm, graphs
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
