"""The launch-side pieces of ``mrv2.interpreter_fast``: what a Triton interpreter launch
does before and after running a kernel's programs (argument copies, typing, binding).

Each function takes ``replace(obj, name, value)`` (``interpreter_fast._replace``, which
records the original so ``uninstall()`` can restore it) and applies one speed-up;
``interpreter_fast.install()`` calls them when their originals are present, and
``tests/test_interpreter_fast.py`` checks each against the original.
"""

from __future__ import annotations

import builtins
import functools
import inspect
import types

#: torch dtype name -> Triton's mangled pointer type (``triton.runtime.jit.mangle_type``).
TORCH_POINTER_TYPES = {
    "float32": "*fp32", "float16": "*fp16", "bfloat16": "*bf16", "float64": "*fp64",
    "int8": "*i8", "int16": "*i16", "int32": "*i32", "int64": "*i64", "bool": "*u1",
    "uint8": "*u8", "uint16": "*u16", "uint32": "*u32", "uint64": "*u64",
}


def host_args_in_place(interp, replace) -> None:
    """CPU tensors go to the kernel as they are, not as host copies copied back after.

    NOTE: the interpreter "copies" each tensor argument to the host before a launch and
    back after it. For a CPU tensor that copy is a view of the same storage and the copy
    back a self-copy: skipping both changes nothing but the time.
    """
    import torch

    cls = interp.GridExecutor
    original_init, original_restore = cls._init_args_hst, cls._restore_args_dev
    wrapped = (builtins.tuple, list, getattr(interp, "TensorDescriptor", builtins.tuple))

    def _plain(arg):  # a CPU tensor, or an argument the original passes as it is
        if type(arg) in (torch.Tensor, torch.nn.Parameter):
            return arg.device.type == "cpu"
        return not hasattr(arg, "data_ptr") and not isinstance(arg, wrapped)

    def _init_args_hst(self, args_dev, kwargs):
        if all(map(_plain, args_dev)) and all(map(_plain, kwargs.values())):
            return list(args_dev), dict(kwargs)
        return original_init(self, args_dev, kwargs)

    def _restore_args_dev(self, args_dev, args_hst, kwargs, kwargs_hst):
        if all(d is h for d, h in zip(args_dev, args_hst)) and all(
                kwargs_hst[k] is v for k, v in kwargs.items()):
            return
        original_restore(self, args_dev, args_hst, kwargs, kwargs_hst)

    replace(cls, "_init_args_hst", _init_args_hst)
    replace(cls, "_restore_args_dev", _restore_args_dev)


def launcher_memo(interp, replace) -> None:
    """A launch's ``GridExecutor`` takes its kernel's constexpr names from a memo.

    NOTE: the original re-reads and normalises the kernel's annotations at every launch
    and keeps the names in a list that every argument is looked up in; a frozenset of the
    same names answers the same. Used only while ``__init__`` sets nothing else.
    """
    cls = interp.GridExecutor
    original = cls.__init__
    known = {"fn", "arg_names", "grid", "pre_run_hooks", "constexprs"}
    memo: dict = {}

    def __init__(self, fn, arg_names, grid, pre_run_hooks=[]):  # noqa: B006 (as Triton's)
        names = memo.get(fn)
        if names is None:
            original(self, fn, arg_names, grid, pre_run_hooks)
            if set(vars(self)) != known:
                return
            names = memo[fn] = frozenset(self.constexprs)
        self.fn, self.arg_names, self.grid, self.pre_run_hooks = fn, arg_names, grid, \
            pre_run_hooks
        self.constexprs = names

    replace(cls, "__init__", __init__)


def cached_argspec(interp, replace) -> None:
    """The launcher's ``getfullargspec`` / ``getcallargs`` of a kernel, from its spec once.

    ``getcallargs`` of a kernel with plain parameters (no ``*args``, ``**kwargs`` or
    keyword-only ones) is the name -> value dict built here; anything else, and every
    bad call (so that it raises the original's error), goes to ``inspect``.
    """
    names = {k: getattr(inspect, k) for k in dir(inspect) if not k.startswith("__")}
    ns = types.SimpleNamespace(**names)
    spec_of = functools.lru_cache(maxsize=None)(inspect.getfullargspec)

    def getcallargs(fn, *args, **kwargs):
        spec = spec_of(fn)
        params = spec.args
        if (spec.varargs is None and spec.varkw is None and not spec.kwonlyargs
                and len(args) <= len(params)):
            bound = dict(zip(params, args))
            if all(k in params and k not in bound for k in kwargs):
                bound.update(kwargs)
                if len(bound) < len(params) and spec.defaults:
                    first = len(params) - len(spec.defaults)
                    for name, value in zip(params[first:], spec.defaults):
                        bound.setdefault(name, value)
                if len(bound) == len(params):  # else a name is missing or unknown
                    return bound
        return inspect.getcallargs(fn, *args, **kwargs)

    ns.getfullargspec, ns.getcallargs = spec_of, getcallargs
    replace(interp, "inspect", ns)


def typed_args(interp, tl, replace) -> None:
    """``_implicit_cvt`` types CPU tensors and ints from a memo, not by ``mangle_type``.

    NOTE: ``mangle_type`` runs Triton's native specialiser, whose first call imports the
    whole ``triton.experimental.gluon`` package (~80 ms); the memo gives the same types.
    """
    import numpy as np
    import torch

    original = interp._implicit_cvt
    TensorHandle, tensor = interp.TensorHandle, tl.tensor
    ptr_types: dict = {}
    i32 = tl.int32

    def _implicit_cvt(arg):
        cls = type(arg)
        if cls is int:
            if -2**31 <= arg < 2**31:  # NOTE: wider ints keep the original's numpy dtypes
                return tensor(TensorHandle(np.array([arg], dtype=np.int32), i32), i32)
        elif (cls is torch.Tensor or cls is torch.nn.Parameter) and arg.device.type == "cpu":
            ty = ptr_types.get(arg.dtype)
            if ty is None:
                name = TORCH_POINTER_TYPES.get(str(arg.dtype).removeprefix("torch."))
                if name is None:
                    return original(arg)
                ty = ptr_types[arg.dtype] = tl.str_to_ty(name, None)
            return tensor(TensorHandle(np.array([arg.data_ptr()], dtype=np.uint64), ty), ty)
        return original(arg)

    replace(interp, "_implicit_cvt", _implicit_cvt)
