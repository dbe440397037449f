"""mrv2: a small, readable reimplementation of vLLM's Model Runner V2.

``from mrv2 import LLM, SamplingParams`` gives vLLM's offline API. The package
imports ``mrv2.platform`` first: it decides the device and, without CUDA, turns
on Triton's interpreter before any kernel is defined.
"""

import sys as _sys


def _is_cli_start() -> bool:
    """True while ``python -m mrv2 ...`` imports the package (the CLI imports platform itself)."""
    argv = getattr(_sys, "orig_argv", [])
    return _sys.argv[:1] == ["-m"] and any(
        a == "-m" and b == "mrv2" for a, b in zip(argv, argv[1:], strict=False))  # noqa: RUF007 (3.10)


# NOTE: platform imports torch (~1.5 s); `python -m mrv2 --help` should not wait for it.
if not _is_cli_start():
    from mrv2 import platform  # noqa: F401  (must run before any Triton kernel is defined)

__version__ = "0.1.0"

_LAZY = {
    "LLM": "mrv2.llm",
    "SamplingParams": "mrv2.sampling_params",
    "RequestOutput": "mrv2.outputs",
    "CompletionOutput": "mrv2.outputs",
    "LLMEngine": "mrv2.engine_api",
}


def __getattr__(name):
    # Lazy so that `import mrv2.kernels...` stays light (no transformers import).
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'mrv2' has no attribute {name!r}")


__all__ = ["LLM", "CompletionOutput", "LLMEngine", "RequestOutput", "SamplingParams"]
