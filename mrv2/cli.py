"""The command line's arguments and the ``generate`` command (``python -m mrv2 ...``).

Flags take vLLM's names (``vllm serve`` / ``vllm bench`` spell engine arguments and
sampling parameters the same way). Every argument is defined in ``build_parser``, so
``--help`` needs no torch: the package and the model load only when a command runs.
"""

from __future__ import annotations

import argparse
import sys
import time

from mrv2.engine_args import add_engine_arguments, engine_kwargs


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")


def add_generate_arguments(p: argparse.ArgumentParser) -> None:
    """The ``generate`` subcommand's arguments: prompts, sampling parameters, engine limits."""
    g = p.add_argument_group("prompts")
    g.add_argument("--prompt", action="append",
                   help="a prompt (repeat for a batch; default: ROMEO:)")
    g.add_argument("--token-ids", action="store_true",
                   help="prompts are comma-separated token ids; no tokenizer is loaded")
    g.add_argument("--chat", action="store_true",
                   help="send each prompt as a user message through LLM.chat (the chat template)")
    s = p.add_argument_group("sampling parameters (SamplingParams)")
    s.add_argument("--max-tokens", type=int, default=64)
    s.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--top-k", type=int, default=0, help="0 or -1: off")
    s.add_argument("--min-p", type=float, default=0.0)
    s.add_argument("--n", type=int, default=1, help="completions per prompt")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--presence-penalty", type=float, default=0.0)
    s.add_argument("--frequency-penalty", type=float, default=0.0)
    s.add_argument("--repetition-penalty", type=float, default=1.0)
    s.add_argument("--min-tokens", type=int, default=0)
    s.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")
    s.add_argument("--stop-token-ids", type=_int_list, default=None,
                   help="comma-separated token ids that end the output")
    s.add_argument("--bad-words", action="append", default=None,
                   help="a word never to generate (repeatable)")
    s.add_argument("--ignore-eos", action="store_true")
    s.add_argument("--logprobs", type=int, default=None,
                   help="print the top-k log-probabilities of each generated token")
    s.add_argument("--truncate-prompt-tokens", type=int, default=None,
                   help="keep only the last k prompt tokens")
    e = p.add_argument_group("engine (LLM arguments)")
    e.add_argument("--model", default=None, help="HF folder (default: the embedded tiny Qwen3)")
    add_engine_arguments(e)
    e.add_argument("--quiet", action="store_true", help="no progress bar")


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The whole command line (``bench``'s arguments only when ``bench`` is the command).

    Args:
        argv: the arguments to be parsed (``bench`` options are defined in
            ``mrv2.bench.cli``, which imports the benchmark suite: only when needed).
    """
    argv = sys.argv[1:] if argv is None else argv
    # NOTE: allow_abbrev=False: "--max-token 8" must be an error, not --max-tokens.
    parser = argparse.ArgumentParser(prog="python -m mrv2", allow_abbrev=False,
                                     description="mrv2: vLLM's Model Runner V2, rebuilt to be "
                                                 "read. Generate text or run benchmarks.")
    sub = parser.add_subparsers(dest="cmd", required=True)
    gen = sub.add_parser("generate", help="generate text with LLM.generate (or LLM.chat)",
                         allow_abbrev=False,
                         description="Generate text with LLM.generate on the embedded model "
                                     "or --model.")
    add_generate_arguments(gen)
    bench = sub.add_parser("bench", help="throughput / latency benchmarks (JSON + table)",
                           allow_abbrev=False,
                           description="Benchmark mrv2 V2, the V1 baseline and transformers.")
    if argv[:1] == ["bench"]:
        from mrv2.bench.cli import add_arguments

        add_arguments(bench)
    serve = sub.add_parser("serve", help="an OpenAI-compatible server (FastAPI + uvicorn)",
                           allow_abbrev=False,
                           description="Serve a model over OpenAI's HTTP API (AsyncLLM).")
    from mrv2.serve.cli import add_serve_arguments  # argparse only: no fastapi, no torch

    add_serve_arguments(serve)
    return parser


def sampling_params_from_args(args):
    """``SamplingParams`` of the parsed ``generate`` arguments."""
    from mrv2 import SamplingParams

    return SamplingParams(
        n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, seed=args.seed, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, repetition_penalty=args.repetition_penalty,
        max_tokens=args.max_tokens, min_tokens=args.min_tokens, stop=args.stop,
        stop_token_ids=args.stop_token_ids, bad_words=args.bad_words,
        ignore_eos=args.ignore_eos, logprobs=args.logprobs,
        truncate_prompt_tokens=args.truncate_prompt_tokens)


def _check_engine_args(args) -> None:
    """The engine limits, checked before the model loads (a ValueError naming the flag)."""
    for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size",
                 "num_gpu_blocks_override", "kv_cache_memory_bytes"):
        v = getattr(args, name, None)
        if v is not None and v <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {v}")
    util = getattr(args, "gpu_memory_utilization", None)
    if util is not None and not 0.0 < util <= 1.0:
        raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {util}")


def _prompts(args) -> list:
    if args.token_ids and not args.prompt:
        raise ValueError("--token-ids needs --prompt with comma-separated token ids, "
                         "e.g. --prompt 1,403,407")
    prompts = args.prompt or ["ROMEO:"]
    if args.token_ids:
        try:
            return [{"prompt_token_ids": [int(t) for t in p.split(",")]} for p in prompts]
        except ValueError:
            raise ValueError("--token-ids: each --prompt must be comma-separated integers, "
                             f"got {prompts!r}") from None
    return prompts


def run_generate(args) -> int:
    """``python -m mrv2 generate``: print each completion, labelled by prompt index."""
    params = sampling_params_from_args(args)  # bad values fail before the model loads
    _check_engine_args(args)
    prompts = _prompts(args)
    if args.chat and args.token_ids:
        raise ValueError("--chat needs text prompts (not --token-ids)")
    from mrv2 import LLM

    try:
        llm = LLM(model=args.model, seed=args.seed, skip_tokenizer_init=args.token_ids,
                  **engine_kwargs(args))
    except ValueError as exc:
        if "could not load a tokenizer" in str(exc):
            # NOTE: the library's hint names Python arguments; say it in flags.
            raise ValueError(f"the model at {args.model} has no tokenizer: give --tokenizer "
                             "PATH, or --token-ids with token-id prompts (e.g. --token-ids "
                             "--prompt 1,403,407)") from None
        raise
    start = time.perf_counter()
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params,
                           use_tqdm=not args.quiet)
    else:
        outputs = llm.generate(prompts, params, use_tqdm=not args.quiet)
    elapsed = time.perf_counter() - start
    num_out = 0
    for i, out in enumerate(outputs):
        for comp in out.outputs:
            num_out += len(comp.token_ids)
            shown = comp.token_ids if args.token_ids else (out.prompt or "") + comp.text
            tag = f" [{comp.index}]" if len(out.outputs) > 1 else ""
            print(f"--- prompt {i}{tag} ({comp.finish_reason}) ---")
            print(shown)
            if comp.logprobs is not None:
                _print_logprobs(comp)
    print(f"--- {num_out} tokens in {elapsed:.2f} s on {llm.device} ({llm.dtype}) ---",
          file=sys.stderr)
    return 0


def _print_logprobs(comp) -> None:
    print(f"cumulative logprob: {comp.cumulative_logprob:.4f}")
    for pos, (token, top) in enumerate(zip(comp.token_ids, comp.logprobs)):
        alts = ", ".join(f"{lp.decoded_token!r}: {lp.logprob:.3f}" if lp.decoded_token is not None
                         else f"{tid}: {lp.logprob:.3f}"
                         for tid, lp in sorted(top.items(), key=lambda kv: -kv[1].logprob))
        print(f"  {pos:3d} {token:6d} | {alts}")


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` and run the command; a bad value prints ``error: ...`` and returns 2."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(argv).parse_args(argv)
    from mrv2 import platform  # noqa: F401  (device, dtype and Triton mode, before any kernel)

    if args.cmd == "bench":
        from mrv2.bench.cli import run

        return run(args)
    if args.cmd == "serve":
        from mrv2.serve.cli import run_serve

        return run_serve(args)
    try:
        return run_generate(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"python -m mrv2 generate: error: {exc}", file=sys.stderr)
        return 2
