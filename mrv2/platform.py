"""Where mrv2 runs: the one place that decides device, dtype and Triton mode.

On a machine without CUDA, mrv2 runs the very same code path on the CPU: Triton
kernels go through Triton's interpreter (``TRITON_INTERPRET=1``, which must be set
before any ``@triton.jit`` decorator runs, so this module is imported first by
``mrv2/__init__.py``), tensors are fp32 (the interpreter computes bf16 wrongly),
and there are no side streams and no CUDA graphs.

``MRV2_DEVICE=cpu`` forces the CPU path on a GPU machine (useful for debugging).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys

import torch

_forced = os.environ.get("MRV2_DEVICE", "").lower()
if _forced not in ("", "cpu", "cuda"):
    raise ValueError(f"MRV2_DEVICE must be 'cpu' or 'cuda', got {_forced!r}")

#: True when mrv2 runs on a CUDA GPU (compiled Triton, bf16, streams, graphs).
HAS_CUDA: bool = torch.cuda.is_available() and _forced != "cpu"
if _forced == "cuda" and not HAS_CUDA:
    raise RuntimeError("MRV2_DEVICE=cuda but torch sees no CUDA device")

if not HAS_CUDA:
    # NOTE: read when Triton is imported and when triton.jit decorates a kernel; setting it
    # later has no effect, and some `transformers` models import Triton on their own.
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise ImportError(
            "triton was imported before mrv2 on a machine without CUDA, so its kernels cannot "
            "switch to the interpreter: `import mrv2` first (before transformers models), or "
            "set TRITON_INTERPRET=1 in the environment")
    os.environ.setdefault("TRITON_INTERPRET", "1")

#: True when Triton kernels run in the interpreter (slow: keep grids small).
TRITON_INTERPRET: bool = os.environ.get("TRITON_INTERPRET", "0") == "1"


def env_switch(name: str, default: bool, environ=None) -> bool:
    """An on/off environment switch: ``1`` on, ``0`` off, unset gives ``default``.

    Args:
        name: the variable (``MRV2_PDL``, ``MRV2_SMALL_M_FUSED``, ...).
        default: the value when it is unset.
        environ: the mapping to read (default ``os.environ``).

    Raises:
        ValueError: the variable holds anything but ``0`` or ``1``, so a typo cannot
            silently leave a path in its default state.
    """
    value = (os.environ if environ is None else environ).get(name)
    if value is None:
        return default
    if value not in ("0", "1"):
        on_off = "on" if default else "off"
        raise ValueError(f"{name} must be 0 (off) or 1 (on; unset: {on_off}), got {value!r}")
    return value == "1"


#: The Triton versions this code is tested with (pyproject.toml pins the same range).
SUPPORTED_TRITON = ">=3.6,<3.10"


def _interpreter_options():
    """Triton's interpreter builder options (a private dataclass), or ``None`` if gone."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return None
    opts = getattr(getattr(interpreter, "interpreter_builder", None), "options", None)
    return opts if dataclasses.is_dataclass(opts) else None


def missing_triton_internals(interpreter: bool | None = None) -> list[str]:
    """The private Triton pieces mrv2's interpreter speed-ups use that this Triton lacks.

    Each is optional (mrv2 falls back to the slower public path), but a missing one means
    Triton changed under us: ``tests/test_triton_internals.py`` reports it by name.

    Args:
        interpreter: check the interpreter's pieces (default: when it is on; compiled
            kernels use no private Triton piece).

    Returns:
        Human-readable names of the missing internals (empty: all present).
    """
    missing = []
    if not (TRITON_INTERPRET if interpreter is None else interpreter):
        return missing
    opts = _interpreter_options()
    if opts is None or "sanitize_overflow" not in {f.name for f in dataclasses.fields(opts)}:
        missing.append("triton.runtime.interpreter.interpreter_builder.options.sanitize_overflow")
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:
        missing.append("triton.runtime.interpreter.InterpretedFunction")
    else:
        if not callable(getattr(InterpretedFunction, "rewrite", None)):
            missing.append("InterpretedFunction.rewrite (a @triton.jit helper's Python body)")
    from triton.runtime import interpreter as _interp

    if not callable(getattr(_interp, "_patch_lang", None)):
        missing.append("triton.runtime.interpreter._patch_lang (patches triton.language)")
    return missing


def interpreter_body(fn):
    """A ``@triton.jit`` helper as the kernels should call it on this platform.

    Under the interpreter every call of a jit helper re-patches ``triton.language``
    (~1.5 ms a call), so the kernels call its plain Python body (Triton's private
    ``rewrite()``) there; compiled, or when this Triton has no ``rewrite``, the helper
    itself (correct, only slower in the interpreter).

    Args:
        fn: a ``@triton.jit`` function.

    Returns:
        ``fn.rewrite()`` under the interpreter when available, else ``fn``.
    """
    rewrite = getattr(fn, "rewrite", None)
    if not TRITON_INTERPRET or not callable(rewrite):
        return fn
    return rewrite()


if TRITON_INTERPRET:
    # NOTE: the interpreter checks every int32 op for overflow, yet its device_assert is a
    # no-op: the check costs ~40% of a kernel's time and can never fire. Turn it off where
    # this Triton has the (private) option; elsewhere keep its default.
    _opts = _interpreter_options()
    if _opts is not None and "sanitize_overflow" in {f.name for f in dataclasses.fields(_opts)}:
        from triton.runtime import interpreter as _interp

        _interp.interpreter_builder.options = dataclasses.replace(_opts, sanitize_overflow=False)


class _KeptPatch:
    """The scope ``_patch_lang`` returns, kept: its ``restore()`` does nothing."""

    def restore(self) -> None:
        pass


#: The interpreter's patches of ``triton.language`` this process keeps, and the module sets and
#: globals dicts they were made for (``_patch_language_once``; ``compiled_language`` undoes them).
_KEPT_SCOPES: list = []
_PATCHED: set[frozenset[int]] = set()
_SEEN: set[tuple[int, int]] = set()  # (globals dict, its size) already looked at


@contextlib.contextmanager
def compiled_language():
    """Triton's own ``triton.language`` inside the block, for a kernel compiled for a GPU in an
    interpreter process (``small_m_resident.sm90_ptx``: the CPU tests check its PTX).

    NOTE: the language this process keeps patched for the interpreter (numpy builtins) would
    fail a compile (``'value' object has no attribute 'dtype'``), and did only once some
    interpreted kernel had run first and Triton's cache held no copy of the compiled one. The
    patches are undone here; the next interpreted launch makes them again.
    """
    while _KEPT_SCOPES:
        _KEPT_SCOPES.pop().restore()
    _PATCHED.clear()
    _SEEN.clear()
    yield


def _patch_language_once() -> bool:
    """Patch ``triton.language`` for the interpreter once per process, not once per launch.

    NOTE: the interpreter swaps every ``triton.language`` builtin for its numpy version at
    each kernel launch and each jit-helper call, and swaps them back after a launch
    (~0.25 ms of a ~0.6 ms minimum launch; ~50 launches and helper calls per decode step).
    Under ``TRITON_INTERPRET=1`` no kernel is ever compiled, so the patched language is the
    only one in use: patch each distinct set of modules once and keep it.

    Returns:
        True when this Triton has the private ``_patch_lang`` (the speed-up is on).
    """
    try:
        from triton.runtime import interpreter as _interp
    except ImportError:
        return False
    original = getattr(_interp, "_patch_lang", None)
    if not callable(original) or getattr(original, "_mrv2_kept", False):
        return callable(original)
    def patch_lang_once(fn):
        key = (id(fn.__globals__), len(fn.__globals__))
        if key not in _SEEN:  # NOTE: a module's globals change size when names are added
            modules = frozenset(id(v) for v in fn.__globals__.values()
                                if isinstance(v, type(sys)))
            if modules not in _PATCHED:
                # the patch stays for the process (only compiled_language undoes it)
                _KEPT_SCOPES.append(original(fn))
                _PATCHED.add(modules)
            _SEEN.add(key)
        return _KeptPatch()

    patch_lang_once._mrv2_kept = True
    _interp._patch_lang = patch_lang_once
    return True


if TRITON_INTERPRET:
    _patch_language_once()
    # ``MRV2_INTERPRETER_FAST=0`` keeps Triton's own interpreter frontend (same results).
    if os.environ.get("MRV2_INTERPRETER_FAST", "1") != "0":
        from mrv2 import interpreter_fast

        interpreter_fast.install()

#: The device every mrv2 tensor lives on.
DEVICE: torch.device = torch.device("cuda" if HAS_CUDA else "cpu")

#: The default compute dtype: bf16 on the GPU, fp32 under the Triton interpreter.
DEFAULT_DTYPE: torch.dtype = torch.bfloat16 if HAS_CUDA else torch.float32


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype:
    """Turn a vLLM-style ``dtype`` argument into a torch dtype for this platform.

    Args:
        dtype: ``"auto"``/``None`` (the platform default), a name such as
            ``"bfloat16"``, ``"float16"``, ``"float32"``, or a ``torch.dtype``.

    Returns:
        The torch dtype. On the CPU, half types are refused: the Triton
        interpreter computes them wrongly.
    """
    if dtype is None or dtype == "auto":
        return DEFAULT_DTYPE
    names = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
             "half": torch.float16, "fp16": torch.float16, "float32": torch.float32,
             "float": torch.float32, "fp32": torch.float32}
    if isinstance(dtype, str):
        if dtype not in names:
            raise ValueError(f"dtype must be one of {sorted(names)} or 'auto', got {dtype!r}")
        dtype = names[dtype]
    if not isinstance(dtype, torch.dtype):
        # NOTE: ValueError, not TypeError: the validation layer reports every bad value as one.
        raise ValueError(f"dtype must be a string or torch.dtype, got {dtype!r}")  # noqa: TRY004
    if not HAS_CUDA and dtype != torch.float32:
        raise ValueError(f"dtype={dtype} is not supported on the CPU (Triton's interpreter "
                         "computes half types wrongly); use dtype='float32' or 'auto'")
    return dtype
