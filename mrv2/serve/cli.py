"""``python -m mrv2 serve [MODEL]``: flags (argparse only: ``--help`` stays fast) and the runner.

    python -m mrv2 serve                                  # the embedded tiny Qwen3
    python -m mrv2 serve PATH --load-format dummy --port 8000 --api-key K
    curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
        -d '{"prompt": "ROMEO:", "max_tokens": 32, "temperature": 0}'

FastAPI, uvicorn and the model load only when the command runs (``pip install -e
".[serve]"``).
"""

from __future__ import annotations

import argparse
import sys

from mrv2.engine_args import add_engine_arguments, engine_kwargs


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """The ``serve`` subcommand's arguments (vLLM's names)."""
    p.add_argument("model", nargs="?", default=None,
                   help="HF folder (default: the embedded tiny Qwen3)")
    p.add_argument("--model", dest="model_flag", default=None, help="same as MODEL")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1")
    p.add_argument("--served-model-name", default=None,
                   help="the name clients pass as model (default: MODEL, or the embedded "
                        "model's folder name)")
    e = p.add_argument_group("engine (LLM arguments)")
    add_engine_arguments(e)
    e.add_argument("--load-format", choices=("auto", "safetensors", "dummy"), default="auto",
                   help="dummy: random weights of the config's shape (benchmarks)")
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--no-enable-prefix-caching", action="store_true")
    e.add_argument("--no-async-scheduling", action="store_true")
    p.add_argument("--log-level", default="warning", help="uvicorn's log level")
    p.add_argument("--engine-process", choices=("auto", "on", "off"), default="auto",
                   help="step the engine in its own process, off the HTTP layer's GIL "
                        "(auto: on with CUDA)")


def build_llm(args):
    """The ``LLM`` of parsed ``serve`` arguments."""
    from mrv2 import LLM

    # NOTE: LLM checks every size before it loads anything (a ValueError naming the field).
    return LLM(**llm_kwargs(args))


def llm_kwargs(args) -> dict:
    """The ``LLM`` arguments of parsed ``serve`` arguments."""
    return dict(
        model=args.model_flag or args.model, seed=args.seed, load_format=args.load_format,
        enable_prefix_caching=not args.no_enable_prefix_caching,
        async_scheduling=False if args.no_async_scheduling else None, **engine_kwargs(args))


def served_name(args, llm) -> str:
    return args.served_model_name or args.model_flag or args.model or llm.model_path.name


def run_serve(args) -> int:
    """Load the model, start ``AsyncLLM`` and serve it with uvicorn until interrupted."""
    try:
        import uvicorn

        from mrv2.serve.api_server import create_app
        from mrv2.serve.async_engine import AsyncLLM
    except ImportError as exc:
        print(f"python -m mrv2 serve: error: {exc.name} is missing: pip install -e '.[serve]'",
              file=sys.stderr)
        return 2
    try:
        if args.engine_process == "auto":
            from mrv2.platform import HAS_CUDA
        if args.engine_process == "on" or (args.engine_process == "auto" and HAS_CUDA):
            engine = AsyncLLM(engine_process=True, llm_kwargs=llm_kwargs(args))
        else:
            engine = AsyncLLM(build_llm(args))
    except (ValueError, FileNotFoundError, TypeError, RuntimeError) as exc:
        print(f"python -m mrv2 serve: error: {exc}", file=sys.stderr)
        return 2
    llm = engine.llm
    name = served_name(args, llm)
    app = create_app(engine, name, api_key=args.api_key)
    print(f"[serve] {name} on http://{args.host}:{args.port}/v1 ({llm.device}, {llm.dtype})",
          file=sys.stderr, flush=True)
    from mrv2.serve.engine_core import freeze_heap

    freeze_heap()  # NOTE: what startup loaded is never walked by a full collection again
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    finally:
        engine.shutdown()
        freeze_heap(False)
    return 0
