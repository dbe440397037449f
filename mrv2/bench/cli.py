"""``python -m mrv2 bench throughput|latency``: arguments -> ``BenchConfig`` -> JSON + table.

    python -m mrv2 bench throughput --runner v2,v1,hf               # standard workload
    python -m mrv2 bench throughput --workload host-bound --runner v2,v1
    python -m mrv2 bench latency --runner v2,v1
    python -m mrv2 bench decode --plot      # one decode step: kernels, GPU/wall ms vs roofline
    python -m mrv2 bench timeline --plot    # GPU idle between steps, async off vs on
    python -m mrv2 bench throughput --tiny --runner v2 --out /tmp/t.json   # CPU, seconds
    python -m mrv2 bench latency --workload shared-prefix --prefix-caching both  # TTFT on/off
    python -m mrv2 bench latency --speculative ngram --num-speculative-tokens 3 \
        --workload repetitive --sync-accepted-counts   # v2 without / with / with the sync
    python -m mrv2 bench serve --launch qwen3-0.6b-dummy --request-rate 8,32,inf  # HTTP
    python -m mrv2 bench latency --speculative ngram,draft_model,eagle --batch-sizes 1,8
"""

from __future__ import annotations

import argparse


def _context_list(text: str) -> list:
    """``128,1024,100-1024`` -> ``[128, 1024, (100, 1024)]`` (``bench decode --contexts``)."""
    values = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        lo, sep, hi = item.partition("-")
        try:
            value = (int(lo), int(hi)) if sep else int(item)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated lengths or LO-HI ranges, got {text!r}") from None
        if (min(value) if sep else value) < 1 or (sep and value[0] > value[1]):
            raise argparse.ArgumentTypeError(f"expected positive lengths, LO <= HI, got {item!r}")
        values.append(value)
    if not values:
        raise argparse.ArgumentTypeError(f"expected at least one context, got {text!r}")
    return values


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _runner_list(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [n for n in names if n not in ("v2", "v1", "hf")]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"runners are a comma list of v2, v1, hf; got {text!r}")
    return names


def _spec_list(text: str) -> str:
    # NOTE: argparse calls this before the CLI imports mrv2.platform, and mrv2.bench.spec
    # pulls in Triton kernels: the platform must decide the interpreter first.
    from mrv2 import platform  # noqa: F401
    from mrv2.bench.spec import METHODS

    names = [x.strip() for x in text.split(",") if x.strip()]
    if not names or any(n not in METHODS for n in names) or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"--speculative takes one or a comma list of "
                                         f"{', '.join(METHODS)}; got {text!r}")
    return ",".join(names)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``bench`` subcommand's arguments."""
    p.add_argument("kind", choices=["throughput", "latency", "decode", "timeline", "serve"],
                   help="throughput / latency (v2 vs v1 vs hf), decode (one decode step's "
                        "kernels, GPU and wall ms vs its roofline, per batch and context), "
                        "timeline (GPU idle with async off and on), "
                        "serve (streaming clients against an OpenAI server, mrv2/bench/serve.py)")
    p.add_argument("--runner", type=_runner_list, default=None,
                   help="comma list of v2, v1, hf (run one after another in this process; "
                        "default v2,v1,hf, with --speculative only v2)")
    p.add_argument("--workload", choices=["standard", "host-bound", "shared-prefix",
                                          "repetitive", "shakespeare"],
                   default="standard",
                   help="throughput workload (standard: 256 x [100,1024] in/out; "
                        "host-bound: 1024 x 32 in / 128 out; shared-prefix: 256 x (a shared "
                        "1024-token prefix + 64 own tokens) in / 128 out; repetitive: 64 x "
                        "a repeated loop, 128 in / 256 out, greedy: the embedded model's own "
                        "loop, or random repeated 11-grams for another model). latency: "
                        "shared-prefix and repetitive change its prompts; shakespeare "
                        "(latency only): per request a window of the validation split of "
                        "$MRV2_SHARED_DATA/tinyshakespeare.txt, greedy")
    p.add_argument("--speculative", type=_spec_list, default=None,
                   help="ngram, draft_model, eagle, or a comma list of them: compare v2 "
                        "without and with each in the same job")
    p.add_argument("--num-speculative-tokens", type=int, default=None, help="K (default 3)")
    p.add_argument("--sync-accepted-counts", action="store_true",
                   help="with --speculative: also v2 with sync_accepted_counts on (3 rows)")
    p.add_argument("--draft-model", default=None,
                   help="draft_model: the draft's folder (default: the embedded model's draft)")
    p.add_argument("--eagle-model", default=None,
                   help="eagle: the EAGLE head's folder (default: the embedded model's head)")
    p.add_argument("--prompt-lookup-max", type=int, default=None, help="ngram: longest n")
    p.add_argument("--prompt-lookup-min", type=int, default=None, help="ngram: shortest n")
    p.add_argument("--temperature", type=float, default=None,
                   help="of every request (default 0.6; repetitive, shakespeare: 0, greedy)")
    p.add_argument("--prefix-caching", choices=["on", "off", "both"], default="on",
                   help="the mrv2 runners' LLM(enable_prefix_caching=...); both: each runner "
                        "twice, the one without caching labelled <runner>-no-pc")
    p.add_argument("--prefix-len", type=int, default=None, help="shared-prefix: prefix tokens")
    p.add_argument("--suffix-len", type=int, default=None,
                   help="shared-prefix: distinct tokens per request")
    p.add_argument("--model", default=None, help="HF folder (default: Qwen3-0.6B config from "
                   "$MRV2_SHARED_DATA with dummy weights on a GPU; the embedded model on the CPU)")
    p.add_argument("--load-format", choices=["auto", "dummy"], default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--tiny", action="store_true",
                   help="CPU/CI preset: embedded model, a handful of requests, few tokens")
    p.add_argument("--num-requests", type=int, default=None)
    p.add_argument("--input-len", type=int, default=None, help="fixed prompt length")
    p.add_argument("--output-len", type=int, default=None, help="fixed output length")
    p.add_argument("--max-num-seqs", type=int, default=None, help="default 256 (tiny: 4)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--no-async", action="store_true", help="async_scheduling=False")
    p.add_argument("--cudagraph-mode", choices=("FULL", "FULL_DECODE_ONLY"), default=None,
                   help="the mrv2 runners' CUDA graphs (default FULL: decode and small "
                        "prefill steps; FULL_DECODE_ONLY: decode steps only)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup-requests", type=int, default=None)
    p.add_argument("--repeats", type=int, default=None,
                   help="timed runs of each mrv2 runner, the fastest counts (default 2 on a "
                        "GPU: the first absorbs one-time kernel compilations; 1 on the CPU)")
    p.add_argument("--hf-max-requests", type=int, default=None,
                   help="cap the hf runner to the first N requests (default 64 on standard)")
    p.add_argument("--hf-batch-size", type=int, default=None, help="default: max-num-seqs")
    p.add_argument("--hf-cache", choices=["dynamic", "static"], default="dynamic",
                   help="transformers cache_implementation")
    p.add_argument("--batch-sizes", type=_int_list, default=None,
                   help="latency batch sizes (default 1,8,32)")
    p.add_argument("--contexts", type=_context_list, default=None,
                   help="decode: prompt lengths (default 128,1024); LO-HI: the batch's "
                        "lengths spread evenly over that range (a server's mix)")
    p.add_argument("--decode-steps", type=int, default=32, help="decode: steps measured")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="decode/timeline: the LLM's max_model_len (default 2048, tiny 512). "
                        "NOTE: CUDA graphs take attention's launch (splits, tiles) for this "
                        "length, not the step's contexts: 256 gives the latency bench's")
    p.add_argument("--compare-eager", action="store_true",
                   help="decode: also the step time with and without CUDA graphs")
    p.add_argument("--latency-iters", type=int, default=None, help="timed runs per figure")
    p.add_argument("--sweep-batch", type=_int_list, default=None,
                   help="throughput: also time decode-dominated runs at these batch sizes "
                        "(e.g. 1,8,32,64,128,256) for the roofline plot")
    p.add_argument("--out", default=None, help="JSON path (default: "
                   "./bench_<kind>_<workload>_<date>.json in the current directory)")
    p.add_argument("--plot", action="store_true", help="also write a PNG next to the JSON")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="torch.profiler chrome trace of a few decode steps of the first "
                        "mrv2 runner, written to DIR")
    p.add_argument("--timeline", action="store_true",
                   help="record a per-step CPU/GPU split (mrv2.timeline) for each mrv2 runner")
    s = p.add_argument_group("serve (python -m mrv2 bench serve)")
    s.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server's root URL")
    s.add_argument("--num-prompts", type=int, default=None,
                   help="requests per rate (default: the workload's)")
    s.add_argument("--request-rate", default="inf",
                   help="comma list of requests/s (Poisson arrivals; inf: all at once)")
    s.add_argument("--max-concurrency", type=int, default=256, help="most requests in flight")
    s.add_argument("--client-procs", type=int, default=4,
                   help="client processes sharing the requests (so the client is not the bound)")
    s.add_argument("--warmup-prompts", type=int, default=16,
                   help="requests (16 tokens each) sent once before the timed rates")
    s.add_argument("--launch", default=None, metavar="MODEL",
                   help="start 'python -m mrv2 serve MODEL' first (qwen3-0.6b-dummy: the "
                        "Qwen3-0.6B config with dummy weights), stop it at the end")
    s.add_argument("--launch-args", default=None,
                   help="more serve flags for --launch, one quoted string")
    s.add_argument("--vocab-size", type=int, default=1000,
                   help="token ids of the prompts, if the server does not say its vocabulary")


def config_from_args(args: argparse.Namespace):
    """``BenchConfig`` of parsed arguments."""
    from mrv2.bench.suite import BenchConfig

    runners = args.runner or (["v2"] if args.speculative else ["v2", "v1", "hf"])
    return BenchConfig(
        kind=args.kind, runners=runners, workload=args.workload, model=args.model,
        load_format=args.load_format, dtype=args.dtype, tiny=args.tiny,
        num_requests=args.num_requests, input_len=args.input_len, output_len=args.output_len,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        enforce_eager=args.enforce_eager, async_scheduling=False if args.no_async else None,
        cudagraph_mode=args.cudagraph_mode,
        seed=args.seed, warmup_requests=args.warmup_requests,
        hf_max_requests=args.hf_max_requests, hf_batch_size=args.hf_batch_size,
        hf_cache=None if args.hf_cache == "dynamic" else args.hf_cache,
        batch_sizes=args.batch_sizes, latency_iters=args.latency_iters,
        sweep_batch=args.sweep_batch, profile=args.profile, timeline=args.timeline,
        repeats=args.repeats, prefix_caching=args.prefix_caching,
        prefix_len=args.prefix_len, suffix_len=args.suffix_len, temperature=args.temperature,
        speculative=args.speculative, num_speculative_tokens=args.num_speculative_tokens,
        sync_accepted_counts=args.sync_accepted_counts, draft_model=args.draft_model,
        eagle_model=args.eagle_model,
        prompt_lookup_max=args.prompt_lookup_max, prompt_lookup_min=args.prompt_lookup_min)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark, write the JSON (and PNG), print the table.

    Returns:
        0 when at least one runner succeeded, 1 when all failed, 2 for a bad
        configuration (bad option values, a missing model, lengths over the model's limit).
    """
    from mrv2 import platform
    from mrv2.bench.report import (
        CPU_NOTE,
        default_out_path,
        latency_table,
        throughput_table,
        write_json,
    )
    from mrv2.bench.suite import run_latency, run_throughput

    if args.kind == "serve":  # an HTTP client: mrv2/bench/serve.py
        from mrv2.bench.serve import run_serve_bench

        return run_serve_bench(args)
    if args.kind in ("decode", "timeline"):  # step-level figures (bench/steps.py)
        from mrv2.bench.steps import run as run_steps

        sizes = args.batch_sizes or ((1, 8, 32, 64, 128, 256) if args.kind == "decode"
                                     else (1, 64, 256))
        try:
            run_steps(args.kind, args.model, sizes, args.out, plot=args.plot, tiny=args.tiny,
                      contexts=args.contexts or (128, 1024), decode_steps=args.decode_steps,
                      compare_eager=args.compare_eager, max_model_len=args.max_model_len)
        except ValueError as e:  # a point that does not fit, a bad length: say which
            print(f"[bench] error: {e}")
            return 2
        if not platform.HAS_CUDA:
            print(CPU_NOTE)
        return 0

    try:
        cfg = config_from_args(args)
        results = (run_throughput if cfg.kind == "throughput" else run_latency)(cfg)
    except (ValueError, FileNotFoundError) as e:  # a bad option or model: say which, no traceback
        print(f"[bench] error: {e}")
        return 2
    out = args.out or default_out_path(
        cfg.kind, cfg.workload if cfg.kind == "throughput" or cfg.workload != "standard"
        else None, cfg.tiny, cfg.speculative and cfg.speculative.replace(",", "+"))
    path = write_json(results, out)
    print((throughput_table if cfg.kind == "throughput" else latency_table)(results))
    print(f"[bench] wrote {path}")
    if not platform.HAS_CUDA:
        print(CPU_NOTE)
    if args.plot:
        from mrv2.bench.plots import save_plots

        print(f"[bench] wrote {save_plots(results, path.with_suffix('.png'))}")
    ok = [r for r in results["runners"].values() if "error" not in r]
    return 0 if ok else 1
