"""TPOT with and without speculative decoding, in one process (a stop-gap until the bench CLI
grows ``--speculative``).

Every configuration runs the same requests: the embedded model (or ``--model``) on a
repetitive workload (its own greedy loop as the prompt, so n-gram drafts are real), greedy,
``ignore_eos``. TPOT = wall time of the batch / output tokens per request (the short
prefill included); acceptance is read from the runner's ``SpecDecodeStats``. Writes JSON.
With ``--model`` the draft-model configuration is skipped (the shipped draft fits only the
embedded model).

    python scripts/bench_spec_decode.py --batch-sizes 1,8,32 --out benchmarks/results/spec.json
    python scripts/bench_spec_decode.py --smoke          # tiny, runs on the CPU
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from mrv2 import LLM, SamplingParams
from mrv2.models.loader import DEFAULT_MODEL_DIR
from mrv2.spec_decode.metrics import SpecDecodeStats

#: The embedded model's greedy loop after "JULIET:" (tests/test_spec_decode_e2e.py).
LOOP = [952, 26, 199, 47, 12, 292, 359, 850, 1, 199, 199, 952, 26]


def _configs(k: int) -> dict:
    draft = str(DEFAULT_MODEL_DIR) + "-draft"
    return {"none": None,
            "ngram": {"method": "ngram", "num_speculative_tokens": k},
            "ngram_sync": {"method": "ngram", "num_speculative_tokens": k,
                           "sync_accepted_counts": True},
            "draft_model": {"method": "draft_model", "model": draft,
                            "num_speculative_tokens": k}}


def run(args) -> dict:
    results = []
    for name, cfg in _configs(args.k).items():
        if name == "draft_model" and args.model is not None:
            continue
        llm = LLM(args.model, dtype=args.dtype, max_model_len=args.max_model_len,
                  max_num_seqs=max(args.batch_sizes), speculative_config=cfg,
                  load_format=args.load_format, skip_tokenizer_init=True)
        for batch in args.batch_sizes:
            prompts = [{"prompt_token_ids": LOOP * 2}] * batch
            sp = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
            llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                         use_tqdm=False)  # warm-up
            steps0 = llm.engine.num_steps
            if cfg:  # count the timed run only (the engine holds the same object)
                llm.engine.spec_stats = llm.runner.spec.stats = SpecDecodeStats(args.k)
            t0 = time.perf_counter()
            llm.generate(prompts, sp, use_tqdm=False)
            wall = time.perf_counter() - t0
            stats = llm.runner.spec.stats.as_dict() if cfg else None
            results.append({"config": name, "batch": batch, "wall_s": wall,
                            "tpot_ms": 1e3 * wall / args.output_len,
                            "steps": llm.engine.num_steps - steps0, "spec_stats": stats})
            print(f"{name:12s} batch {batch:3d}: TPOT {results[-1]['tpot_ms']:.3f} ms, "
                  f"steps {results[-1]['steps']}"
                  + (f", mean accepted length {stats['mean_accepted_length']:.2f}" if stats
                     else ""))
    return {"k": args.k, "output_len": args.output_len, "results": results}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--load-format", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--smoke", action="store_true", help="batch 1, 16 tokens (CPU)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    if args.smoke:
        args.batch_sizes, args.output_len, args.max_model_len = [1], 16, 64
    data = run(args)
    if args.out:
        pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(args.out).write_text(json.dumps(data, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
