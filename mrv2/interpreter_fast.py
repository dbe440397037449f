"""A cheaper Triton interpreter: the frontend's per-operation bookkeeping, memoised.

Under ``TRITON_INTERPRET=1`` each ``tl.*`` operation of a kernel runs Triton's frontend
in Python (type checks, broadcasting, a new ``block_type`` and ``tensor``) around one
small numpy call, and each launch types and "copies to the host" its arguments. For
mrv2's decode-sized kernels that bookkeeping was ~90% of a kernel's time (~20 us an
operation). Each speed-up here replaces one pure piece of it with a memoised or
short-circuited equivalent that returns what the original returns, so the kernels run
the same code path and compute the same bits, only faster. Nothing here runs when
kernels are compiled (``mrv2.platform`` installs it only under the interpreter).

Every piece is private Triton: ``install()`` applies only those whose originals it finds
and returns their names; ``uninstall()`` puts the originals back (tests compare kernels
both ways); ``tests/test_interpreter_fast.py`` checks each piece against its original.
"""

from __future__ import annotations

import builtins
import inspect

from mrv2 import interpreter_fast_launch as _launch
from mrv2.interpreter_fast_launch import TORCH_POINTER_TYPES  # noqa: F401 (re-exported)

# (object, attribute, original value) of every replacement, in the order made.
_CHANGES: list[tuple[object, str, object]] = []
_INSTALLED: list[str] = []

def _replace(obj, name: str, value) -> None:
    _CHANGES.append((obj, name, getattr(obj, name)))
    setattr(obj, name, value)


def _np_dtype_table(interp, tl) -> None:
    """``_get_np_dtype`` as a dict lookup (the original builds a 19-entry dict per call)."""
    import numpy as np

    original = interp._get_np_dtype
    table = {}
    for name in ("int1", "float16", "float32", "float64", "int8", "uint8", "int16", "uint16",
                 "int32", "uint32", "int64", "uint64", "bfloat16"):
        ty = getattr(tl, name)
        table[ty.name] = original(ty)
    dtype, block_type, pointer_type = tl.dtype, tl.block_type, tl.pointer_type
    u64 = np.dtype(np.uint64)

    def _get_np_dtype(tt_dtype):
        ty = tt_dtype
        if type(ty) is block_type:
            ty = ty.element_ty
        cls = type(ty)
        if cls is dtype:
            found = table.get(ty.name)
            if found is not None:
                return found
        elif cls is pointer_type:
            return u64
        return original(tt_dtype)

    _replace(interp, "_get_np_dtype", _get_np_dtype)


def _block_type_memo(core) -> None:
    """``block_type.__init__`` reuses the shape tuple, numel and name of a shape seen before.

    NOTE: the original builds a Triton ``tuple`` (a ``constexpr_type`` per dimension),
    validates it and formats its name for every new type, i.e. for nearly every op.
    Block types of one shape share that (never mutated) shape tuple.
    """
    block_type, triton_tuple = core.block_type, core.tuple
    original = block_type.__init__
    memo: dict[tuple, tuple] = {}

    def __init__(self, element_ty, shape):
        dims = shape.values if type(shape) is triton_tuple else shape
        if type(dims) is list and all(type(s) is int for s in dims):
            key = builtins.tuple(dims)
            hit = memo.get(key)
            if hit is not None:
                self.element_ty = element_ty
                self.shape, self.numel, shape_str = hit
                self.name = f"<{shape_str}, {element_ty}>"
                return
            original(self, element_ty, shape)
            memo[key] = (self.shape, self.numel, str(self.shape))
            return
        original(self, element_ty, shape)

    _replace(block_type, "__init__", __init__)


def _tensor_memo(core) -> None:
    """``tensor.__init__`` reuses the ``constexpr`` shape of a block shape seen before.

    With :func:`_block_type_memo` every block type of one shape holds the same shape
    object, so the memo is keyed by that object (kept alive by the memo itself); scalars
    share one empty shape.
    """
    tensor, block_type = core.tensor, core.block_type
    original = tensor.__init__
    memo: dict[int, tuple] = {}
    scalar: list = []

    def __init__(self, handle, type):
        if builtins.type(type) is block_type:
            key = type.shape
            hit = memo.get(id(key))
            if hit is not None and hit[0] is key:
                self.handle, self.type, self.dtype = handle, type, type.element_ty
                self.shape, self.numel = hit[1], hit[2]
                return
            original(self, handle, type)
            memo[id(key)] = (key, self.shape, self.numel)
            return
        if scalar and isinstance(type, core.dtype) and not type.is_block():
            self.handle, self.type, self.dtype = handle, type, type.scalar
            self.shape, self.numel = scalar
            return
        original(self, handle, type)
        if isinstance(type, core.dtype) and not type.is_block():
            scalar[:] = [self.shape, self.numel]

    _replace(tensor, "__init__", __init__)


def _broadcast_blocks(semantic, core) -> None:
    """``broadcast_impl_value`` of two blocks of one rank without Triton tuples.

    The original compares shapes as Triton tuples (a new tuple and a ``constexpr`` per
    comparison); this compares their int lists and broadcasts as it would, and splats a
    scalar without rebuilding its block type. Ranks that differ and incompatible shapes
    (its error) go to the original.
    """
    cls = semantic.TritonSemantic
    original = cls.broadcast_impl_value
    block_type, dtype = core.block_type, core.dtype

    def broadcast_impl_value(self, lhs, rhs):
        lty, rty = lhs.type, rhs.type
        lblock, rblock = type(lty) is block_type, type(rty) is block_type
        if lblock != rblock:  # a block and a scalar: splat the scalar to the block's shape
            # NOTE: the original passes ty.to_ir(builder), an equal block type; the
            # interpreter's create_splat reads only its shape.
            if lblock and isinstance(rty, dtype) and not rty.is_block():
                ty = block_type(rty, lty.shape.values)
                return lhs, self.make_tensor(self.builder.create_splat(ty, rhs.handle), ty)
            if rblock and isinstance(lty, dtype) and not lty.is_block():
                ty = block_type(lty, rty.shape.values)
                return self.make_tensor(self.builder.create_splat(ty, lhs.handle), ty), rhs
            return original(self, lhs, rhs)
        if not lblock:
            return original(self, lhs, rhs)
        lshape, rshape = lty.shape.values, rty.shape.values
        if lshape == rshape:
            return lhs, rhs
        if len(lshape) != len(rshape):
            return original(self, lhs, rhs)
        shape = []
        for left, right in zip(lshape, rshape):
            if left == 1:
                shape.append(right)
            elif right == 1 or right == left:
                shape.append(left)
            else:
                return original(self, lhs, rhs)  # raises its error
        if lshape != shape:
            lhs = self.make_tensor(self.builder.create_broadcast(lhs.handle, shape),
                                   block_type(lty.scalar, shape))
        if rshape != shape:
            rhs = self.make_tensor(self.builder.create_broadcast(rhs.handle, shape),
                                   block_type(rty.scalar, shape))
        return lhs, rhs

    _replace(cls, "broadcast_impl_value", broadcast_impl_value)


def _binary_checks(semantic, core) -> None:
    """``binary_op_type_checking_impl`` of two tensors that need no cast: broadcast only.

    Two tensors of one non-pointer dtype whose computation type is that dtype, or a
    pointer and an integer offset where the op allows the pointer: the original's
    checks pass and its casts return the operands unchanged, so what is left is the
    broadcast. A tensor and a Python int or float whose computation type is the tensor's
    dtype: the literal's cast (the original's) and the broadcast. Everything else goes to
    the original.
    """
    cls = semantic.TritonSemantic
    original = cls.binary_op_type_checking_impl
    tensor, dtype, pointer_type = core.tensor, core.dtype, core.pointer_type
    numbers = (int, float)  # NOTE: not bool (an int1 literal), not numpy scalars

    def binary_op_type_checking_impl(self, lhs, rhs, allow_lhs_ptr=False, allow_rhs_ptr=False,
                                     arithmetic_check=True, div_or_mod=False):
        if type(lhs) is tensor and type(rhs) is tensor:
            lty, rty = lhs.dtype, rhs.dtype
            lcls, rcls = type(lty), type(rty)
            if lcls is dtype and rcls is dtype:
                if lty.name == rty.name and (not arithmetic_check or self.computation_type_impl(
                        lty, False, rty, False, div_or_mod).name == lty.name):
                    return self.broadcast_impl_value(lhs, rhs)
            elif (lcls is pointer_type and rcls is dtype and allow_lhs_ptr and rty.is_int()
                  or lcls is dtype and rcls is pointer_type and allow_rhs_ptr and lty.is_int()):
                return self.broadcast_impl_value(lhs, rhs)
        elif arithmetic_check and (type(rhs) in numbers and type(lhs) is tensor
                                   and type(lhs.dtype) is dtype):
            # A tensor and a Python number: the original's steps without its pointer checks
            # (no pointer here) when the tensor keeps its dtype.
            lty = lhs.dtype
            ret = self.computation_type_impl(lty, False, self.to_tensor_type(rhs), True,
                                             div_or_mod)
            if ret.name == lty.name:
                return self.broadcast_impl_value(lhs, self._cast_to_computation_type(rhs, ret))
        elif arithmetic_check and (type(lhs) in numbers and type(rhs) is tensor
                                   and type(rhs.dtype) is dtype):
            rty = rhs.dtype
            ret = self.computation_type_impl(self.to_tensor_type(lhs), True, rty, False,
                                             div_or_mod)
            if ret.name == rty.name:
                return self.broadcast_impl_value(self._cast_to_computation_type(lhs, ret), rhs)
        return original(self, lhs, rhs, allow_lhs_ptr, allow_rhs_ptr, arithmetic_check,
                        div_or_mod)

    _replace(cls, "binary_op_type_checking_impl", binary_op_type_checking_impl)


def _lean_builtin_patch(interp) -> None:
    """The interpreter's wrapper around each ``tl`` builtin sets ``_semantic`` in place.

    NOTE: the original wrapper rebuilds the keyword dict without ``_semantic`` at every
    call of every builtin; setting the key in the (fresh) ``**kwargs`` dict is the same.
    Applies to the patch made at the first launch (mrv2.platform keeps it).
    """
    semantic = interp.interpreter_semantic

    def _patch_attr(obj, name, member, builder, scope):
        def new_member(*args, **kwargs):
            kwargs["_semantic"] = semantic
            return member(*args, **kwargs)

        scope.set_attr(obj, name, new_member)

    _replace(interp, "_patch_attr", _patch_attr)


def _expand_dims_fast(interp, semantic, core) -> None:
    """``x[:, None]`` of a block: its block type from the int shape, the data reshaped.

    NOTE: ``np.expand_dims`` is a reshape after normalising the axis; the reshape alone
    returns the same view.
    """
    cls, builder = semantic.TritonSemantic, interp.InterpreterBuilder
    original, original_handle = cls.expand_dims, builder.create_expand_dims
    block_type, TensorHandle = core.block_type, interp.TensorHandle

    def expand_dims(self, input, axis):
        ty = input.type
        if type(ty) is block_type and type(axis) is int and 0 <= axis <= len(ty.shape.values):
            shape = list(ty.shape.values)
            shape.insert(axis, 1)
            return self.make_tensor(self.builder.create_expand_dims(input.handle, axis),
                                    block_type(ty.element_ty, shape))
        return original(self, input, axis)

    def create_expand_dims(self, arg, axis):
        data = arg.data
        if type(axis) is int and 0 <= axis <= data.ndim:
            return TensorHandle(data.reshape(data.shape[:axis] + (1,) + data.shape[axis:]),
                                arg.dtype.scalar)
        return original_handle(self, arg, axis)

    _replace(cls, "expand_dims", expand_dims)
    _replace(builder, "create_expand_dims", create_expand_dims)


def _computation_type_memo(semantic) -> None:
    """``computation_type_impl`` (a pure function of two types and three flags) memoised."""
    cls = semantic.TritonSemantic
    original = cls.computation_type_impl
    memo: dict[tuple, object] = {}

    def computation_type_impl(self, a_ty, a_is_scalar, b_ty, b_is_scalar, div_or_mod):
        key = (a_ty.name, a_is_scalar, b_ty.name, b_is_scalar, div_or_mod)
        hit = memo.get(key)
        if hit is None:  # errors are raised, never memoised
            hit = memo[key] = original(self, a_ty, a_is_scalar, b_ty, b_is_scalar, div_or_mod)
        return hit

    _replace(cls, "computation_type_impl", computation_type_impl)


def _cache_policy_memo(core) -> None:
    """``_normalize_cache_policy`` of plain strings memoised (a frozen dataclass per load)."""
    original = core._normalize_cache_policy
    memo: dict[tuple, object] = {}

    def _normalize_cache_policy(cache_policy, cache_modifier, eviction_policy):
        if cache_policy is None and type(cache_modifier) is str and type(eviction_policy) is str:
            key = (cache_modifier, eviction_policy)
            hit = memo.get(key)
            if hit is None:
                hit = memo[key] = original(None, cache_modifier, eviction_policy)
            return hit
        return original(cache_policy, cache_modifier, eviction_policy)

    _replace(core, "_normalize_cache_policy", _normalize_cache_policy)


_STEPS = {
    # name: (apply(interp, tl, core, semantic), the originals it needs are present)
    "np_dtype_table": (lambda i, tl, c, s: _np_dtype_table(i, tl),
                       lambda i, tl, c, s: callable(getattr(i, "_get_np_dtype", None))),
    "block_type_memo": (lambda i, tl, c, s: _block_type_memo(c),
                        lambda i, tl, c, s: hasattr(c, "block_type") and hasattr(c, "tuple")),
    "tensor_memo": (lambda i, tl, c, s: _tensor_memo(c),
                    lambda i, tl, c, s: hasattr(c, "tensor")),
    "broadcast_blocks": (
        lambda i, tl, c, s: _broadcast_blocks(s, c),
        lambda i, tl, c, s: hasattr(getattr(s, "TritonSemantic", None), "broadcast_impl_value")),
    "binary_checks": (
        lambda i, tl, c, s: _binary_checks(s, c),
        lambda i, tl, c, s: hasattr(getattr(s, "TritonSemantic", None),
                                    "binary_op_type_checking_impl")),
    "lean_builtin_patch": (
        lambda i, tl, c, s: _lean_builtin_patch(i),
        lambda i, tl, c, s: callable(getattr(i, "_patch_attr", None))
        and hasattr(i, "interpreter_semantic")),
    "computation_type_memo": (
        lambda i, tl, c, s: _computation_type_memo(s),
        lambda i, tl, c, s: hasattr(getattr(s, "TritonSemantic", None),
                                    "computation_type_impl")),
    "host_args_in_place": (
        lambda i, tl, c, s: _launch.host_args_in_place(i, _replace),
        lambda i, tl, c, s: all(hasattr(getattr(i, "GridExecutor", None), m)
                                for m in ("_init_args_hst", "_restore_args_dev"))),
    "cached_argspec": (lambda i, tl, c, s: _launch.cached_argspec(i, _replace),
                       lambda i, tl, c, s: getattr(i, "inspect", None) is inspect),
    "expand_dims_fast": (
        lambda i, tl, c, s: _expand_dims_fast(i, s, c),
        lambda i, tl, c, s: hasattr(getattr(s, "TritonSemantic", None), "expand_dims")
        and hasattr(getattr(i, "InterpreterBuilder", None), "create_expand_dims")),
    "launcher_memo": (lambda i, tl, c, s: _launch.launcher_memo(i, _replace),
                      lambda i, tl, c, s: hasattr(getattr(i, "GridExecutor", None), "__init__")),
    "cache_policy_memo": (lambda i, tl, c, s: _cache_policy_memo(c),
                          lambda i, tl, c, s: callable(getattr(c, "_normalize_cache_policy",
                                                               None))),
    "typed_args": (lambda i, tl, c, s: _launch.typed_args(i, tl, _replace),
                   lambda i, tl, c, s: callable(getattr(i, "_implicit_cvt", None))
                   and hasattr(i, "TensorHandle")),
}


def install() -> list[str]:
    """Apply every speed-up this Triton has the pieces for (once per process).

    Returns:
        The names of the speed-ups now on (empty when Triton cannot be imported).
    """
    if _INSTALLED:
        return list(_INSTALLED)
    try:
        import triton.language as tl
        from triton.language import core, semantic
        from triton.runtime import interpreter
    except ImportError:
        return []
    for name, (apply, present) in _STEPS.items():
        if present(interpreter, tl, core, semantic):
            apply(interpreter, tl, core, semantic)
            _INSTALLED.append(name)
    return list(_INSTALLED)


def uninstall() -> None:
    """Put every original back (tests run kernels without the speed-ups to compare)."""
    while _CHANGES:
        obj, name, original = _CHANGES.pop()
        setattr(obj, name, original)
    _INSTALLED.clear()
