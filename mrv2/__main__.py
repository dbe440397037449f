"""Command line: ``python -m mrv2 generate ...`` and ``python -m mrv2 bench ...``.

``generate`` runs prompts through ``LLM.generate`` (the V2 runner) and prints the
completions; with no ``--model`` it uses the embedded tiny Qwen3. ``bench``
runs the throughput / latency benchmarks of ``mrv2.bench`` and writes JSON.
"""

from __future__ import annotations

import argparse
import sys
import time


def _parse_token_ids(prompt: str) -> dict:
    """``"1,403,407"`` -> ``{"prompt_token_ids": [1, 403, 407]}`` (ValueError naming --prompt)."""
    try:
        ids = [int(t) for t in prompt.split(",")]
    except ValueError:
        raise ValueError(f"--prompt {prompt!r}: with --token-ids a prompt is comma-separated "
                         "integer token ids, e.g. 1,403,407") from None
    return {"prompt_token_ids": ids}


def _check_generate_args(args):
    """Everything ``generate`` can check before the model is loaded: ``(prompts, params)``.

    Raises:
        ValueError, TypeError: a bad argument, named.
    """
    from mrv2 import SamplingParams

    if args.token_ids and not args.prompt:
        raise ValueError("--token-ids needs --prompt with comma-separated token ids, "
                         "e.g. --prompt 1,403,407")
    prompts = args.prompt or ["ROMEO:"]
    if args.token_ids:
        prompts = [_parse_token_ids(p) for p in prompts]
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=args.seed, n=args.n,
                            ignore_eos=args.ignore_eos)
    for name in ("max_model_len",):
        v = getattr(args, name)
        if v is not None and v <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {v}")
    return prompts, params


def _generate(args) -> int:
    from mrv2 import LLM

    prompts, params = _check_generate_args(args)  # before loading anything
    llm = LLM(model=args.model, dtype=args.dtype, seed=args.seed,
              max_model_len=args.max_model_len, enforce_eager=args.enforce_eager,
              skip_tokenizer_init=args.token_ids)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=not args.quiet)
    elapsed = time.perf_counter() - start
    num_out = 0
    for out in outputs:
        for comp in out.outputs:
            num_out += len(comp.token_ids)
            shown = comp.token_ids if args.token_ids else out.prompt + comp.text
            tag = f" [{comp.index}]" if len(out.outputs) > 1 else ""
            print(f"--- prompt {out.request_id}{tag} ({comp.finish_reason}) ---")
            print(shown)
    print(f"--- {num_out} tokens in {elapsed:.2f} s on {llm.device} ({llm.dtype}) ---",
          file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    # NOTE: allow_abbrev=False: "--max-token 8" must be an error, not --max-tokens.
    parser = argparse.ArgumentParser(prog="python -m mrv2", description=__doc__.splitlines()[0],
                                     allow_abbrev=False)
    sub = parser.add_subparsers(dest="cmd", required=True)
    gen = sub.add_parser("generate", help="generate text with LLM.generate", allow_abbrev=False)
    gen.add_argument("--model", default=None, help="HF folder or hub id (default: embedded tiny Qwen3)")
    gen.add_argument("--prompt", action="append", help="a prompt (repeat for a batch)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--n", type=int, default=1)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--dtype", default="auto")
    gen.add_argument("--max-model-len", type=int, default=None)
    gen.add_argument("--enforce-eager", action="store_true")
    gen.add_argument("--token-ids", action="store_true",
                     help="prompts are comma-separated token ids (no tokenizer)")
    gen.add_argument("--quiet", action="store_true", help="no progress bar")
    from mrv2.bench.cli import add_arguments

    bench = sub.add_parser("bench", help="throughput / latency benchmarks (JSON + table)",
                           description="Benchmark mrv2 V2, the V1 baseline and transformers.",
                           allow_abbrev=False)
    add_arguments(bench)
    args = parser.parse_args(argv)
    if args.cmd == "generate":
        try:
            return _generate(args)
        except (ValueError, TypeError, FileNotFoundError) as e:
            # A bad argument (all checked before loading): one line, argparse's exit code.
            gen.exit(2, f"{gen.prog}: error: {e}\n")
    if args.cmd == "bench":
        from mrv2.bench.cli import run

        return run(args)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
