"""mrv2.interpreter_fast: each memoised piece of Triton's interpreter equals its original,
and the kernels compute the same bits with the speed-ups on and off."""

import contextlib

import pytest
import torch
import triton
import triton.language as tl

from mrv2 import interpreter_fast, platform

pytestmark = pytest.mark.skipif(not platform.TRITON_INTERPRET, reason="interpreter only")


def _original(name):
    """The original Triton piece that the speed-up ``name`` (an attribute) replaced."""
    return next(orig for _, attr, orig in interpreter_fast._CHANGES if attr == name)


@contextlib.contextmanager
def _speedups_off():
    interpreter_fast.uninstall()
    try:
        yield
    finally:
        interpreter_fast.install()


def _speedups_on_and_off():
    yield "on"
    with _speedups_off():
        yield "off"


def _same_error(fn_a, fn_b):
    """Both raise the same exception type, or neither does; returns both results."""
    res = []
    for fn in (fn_a, fn_b):
        try:
            res.append(fn())
        except Exception as exc:  # noqa: BLE001 (the type is what is compared)
            res.append(type(exc))
    return res


def test_every_speedup_is_on():
    missing = set(interpreter_fast._STEPS) - set(interpreter_fast._INSTALLED)
    assert not missing, (f"Triton {triton.__version__} lacks what these interpreter "
                         f"speed-ups replace: {sorted(missing)} (mrv2/interpreter_fast.py)")


_DTYPES = [tl.int1, tl.int8, tl.uint8, tl.int16, tl.uint16, tl.int32, tl.uint32, tl.int64,
           tl.uint64, tl.float16, tl.bfloat16, tl.float32, tl.float64, tl.float8e5,
           tl.float8e4nv]


def test_np_dtype_table_equals_the_original():
    from triton.runtime import interpreter

    original = _original("_get_np_dtype")
    for ty in _DTYPES:
        for t in (ty, tl.pointer_type(ty), tl.block_type(ty, [4, 2]),
                  tl.block_type(tl.pointer_type(ty), [8])):
            assert interpreter._get_np_dtype(t) == original(t), t


@pytest.mark.parametrize("shape", [[16], [1, 64], [2, 4, 8], [tl.constexpr(32), 2]])
def test_block_type_memo_equals_the_original(shape):
    for ty in (tl.float32, tl.int64, tl.pointer_type(tl.float32)):
        fast = tl.block_type(ty, shape)
        fast_again = tl.block_type(ty, list(fast.shape))  # a memo hit
        with _speedups_off():
            slow = tl.block_type(ty, shape)
        for got in (fast, fast_again):
            assert got == slow and got.name == slow.name and got.numel == slow.numel
            assert list(got.shape) == list(slow.shape) and got.element_ty == slow.element_ty


@pytest.mark.parametrize("shape", [[3], [16, 6], [], (2, 4)])
def test_block_type_memo_keeps_the_shape_errors(shape):
    fast = _same_error(lambda: tl.block_type(tl.float32, shape), lambda: None)[0]
    with _speedups_off():
        slow = _same_error(lambda: tl.block_type(tl.float32, shape), lambda: None)[0]
    assert fast is slow and isinstance(fast, type) and issubclass(fast, Exception)


def test_tensor_memo_equals_the_original():
    import numpy as np
    from triton.runtime.interpreter import TensorHandle

    cases = [(np.zeros((4, 8), np.float32), tl.block_type(tl.float32, [4, 8])),
             (np.zeros((4, 8), np.float32), tl.block_type(tl.float32, [4, 8])),  # hit
             (np.zeros(1, np.int32), tl.int32), (np.zeros(1, np.int64), tl.int64)]
    for data, ty in cases:
        fast = tl.tensor(TensorHandle(data, ty.scalar), ty)
        with _speedups_off():
            slow = tl.tensor(TensorHandle(data, ty.scalar), ty)
        assert fast.type == slow.type and fast.dtype == slow.dtype
        assert [s.value for s in fast.shape] == [s.value for s in slow.shape]
        assert fast.numel.value == slow.numel.value


def test_computation_type_memo_equals_the_original():
    from triton.language.semantic import TritonSemantic
    from triton.runtime.interpreter import interpreter_semantic

    original = _original("computation_type_impl")
    for a in _DTYPES:
        for b in _DTYPES:
            for flags in ((False, False, False), (True, False, False), (False, True, True)):
                args = (a, flags[0], b, flags[1], flags[2])
                got = _same_error(
                    lambda a=args: TritonSemantic.computation_type_impl(interpreter_semantic, *a),
                    lambda a=args: original(interpreter_semantic, *a))
                assert got[0] == got[1], (args, got)


def test_typed_args_equal_mangle_type():
    from triton.runtime import interpreter

    original = _original("_implicit_cvt")
    for name in interpreter_fast.TORCH_POINTER_TYPES:
        t = torch.zeros(3, dtype=getattr(torch, name))
        assert triton.runtime.jit.mangle_type(t) == interpreter_fast.TORCH_POINTER_TYPES[name]
        fast, slow = interpreter._implicit_cvt(t), original(t)
        assert fast.type == slow.type and fast.handle.data.tolist() == slow.handle.data.tolist()
    assert interpreter._implicit_cvt(1.5) == original(1.5) == 1.5  # floats pass as they are
    for v in (0, 1, -1, 2**31 - 1, 2**31, -2**31, -2**31 - 1, 2**63 - 1, 2**63, True):
        fast, slow = interpreter._implicit_cvt(v), original(v)
        assert fast.type == slow.type and fast.handle.data.dtype == slow.handle.data.dtype, v
        assert fast.handle.data.tolist() == slow.handle.data.tolist(), v


def test_cached_getcallargs_equals_inspect():
    import inspect

    from triton.runtime import interpreter

    def plain(a, b, c=3, d=4):
        pass

    def star(a, *rest, k=1, **kw):
        pass

    calls = [(plain, (1, 2), {}), (plain, (1,), {"b": 2, "d": 9}), (plain, (), {"a": 1, "b": 2}),
             (plain, (1, 2, 3, 4), {}), (star, (1, 2, 3), {"k": 2, "z": 0}),
             (plain, (1,), {}), (plain, (1, 2), {"a": 1}), (plain, (1, 2), {"e": 1}),
             (plain, (1, 2, 3, 4, 5), {}), (plain, (1,), {"e": 1, "c": 3})]  # the last 5 raise
    for fn, args, kwargs in calls:
        got = _same_error(lambda f=fn, a=args, k=kwargs: interpreter.inspect.getcallargs(f, *a, **k),
                          lambda f=fn, a=args, k=kwargs: inspect.getcallargs(f, *a, **k))
        assert got[0] == got[1], (fn.__name__, args, kwargs, got)


@triton.jit
def _scale_rows(x_ptr, out_ptr, n, stride_x, stride_o, factor, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    i = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * stride_x + i, mask=i < n, other=0.0)
    tl.store(out_ptr + row * stride_o + i, x * factor + row, mask=i < n)


def test_host_args_in_place_writes_into_views_and_keeps_other_memory():
    base = torch.full((5, 12), -7.0)
    x = torch.randn(4, 10)
    out = base[1:, 1:11]  # a strided view into the middle of a larger tensor
    _scale_rows[(4,)](x, out, 10, x.stride(0), out.stride(0), 2.5, BLOCK=16)
    expected = torch.full((5, 12), -7.0)
    expected[1:, 1:11] = x * 2.5 + torch.arange(4.0)[:, None]
    assert torch.equal(base, expected)


@triton.jit
def _mixed_ops(a_ptr, b_ptr, out_f_ptr, out_i_ptr, off, M: tl.constexpr, N: tl.constexpr):
    # Broadcasts of every kind, promotions, pointer offsets, unsigned ops, comparisons.
    m = tl.arange(0, M)
    n = tl.arange(0, N)
    a = tl.load(a_ptr + m[:, None] * N + n[None, :])                # [M, N] fp32
    b = tl.load(b_ptr + n)                                          # [N] int64
    col = tl.sum(a, 1)[:, None]                                     # [M, 1]
    f = a * col + b[None, :] - (m[:, None] + off)                   # fp32, int64, int32
    h = (n.to(tl.uint32) * 0x9E3779B1) ^ (b.to(tl.uint32) >> 3)     # [N] uint32
    i = tl.where((a > 0.5) & (h[None, :] < 2**31), h[None, :].to(tl.int64), b[None, :] + m[:, None])
    lit = (3 - m[:, None]).to(tl.int64) * 2**40 + (0.5 * a > 0.2).to(tl.int64) - (b[None, :] >> 2)  # literals
    tl.store(out_f_ptr + m[:, None] * N + n[None, :], f / (1.0 + col))
    tl.store(out_i_ptr + m[:, None] * N + n[None, :], i + off + lit)


@triton.jit
def _bad_broadcast(x_ptr, M: tl.constexpr, N: tl.constexpr):
    tl.store(x_ptr + tl.arange(0, M), tl.arange(0, M) + tl.arange(0, N))  # [M] + [N]


def test_broadcasts_promotions_and_pointer_offsets_match_with_the_speedups_off():
    g = torch.Generator().manual_seed(3)
    a, b = torch.rand(8, 16, generator=g), torch.randint(-9, 2**40, (16,), generator=g)

    def run():
        out_f, out_i = torch.empty(8, 16), torch.empty(8, 16, dtype=torch.int64)
        _mixed_ops[(1,)](a, b, out_f, out_i, 5, M=8, N=16)
        return out_f, out_i

    fast = run()
    with _speedups_off():
        slow = run()
    assert all(torch.equal(x, y) for x, y in zip(fast, slow))


@triton.jit
def _bad_literal(x_ptr, N: tl.constexpr):
    tl.store(x_ptr + tl.arange(0, N), tl.arange(0, N).to(tl.uint32) + -1)


def test_a_negative_literal_with_an_unsigned_tensor_still_fails():
    x = torch.zeros(8, dtype=torch.int32)
    for _ in _speedups_on_and_off():
        with pytest.raises(Exception, match="unsigned tensor and a negative scalar"):
            _bad_literal[(1,)](x, N=8)


def test_an_incompatible_broadcast_still_fails():
    x = torch.zeros(64, dtype=torch.int32)
    for _ in _speedups_on_and_off():
        with pytest.raises(Exception, match="Cannot make_shape_compatible"):
            _bad_broadcast[(1,)](x, M=8, N=4)


def _kernel_outputs():
    """The outputs of mrv2's step kernels on small random inputs, each a tensor."""
    from test_kernels_attention import make_batch

    from mrv2.kernels.attention import paged_attention
    from mrv2.kernels.gumbel import gumbel_sample
    from mrv2.kernels.kv_cache import write_kv_cache

    outs = []
    for reqs in ([(40, 1)], [(0, 7), (20, 1), (33, 3)]):  # a decode; a mixed batch
        q, kv_cache, md = make_batch(reqs, 4, 2, 16, seed=1)
        outs.append(paged_attention(q, kv_cache, md, 0.25))
    g = torch.Generator().manual_seed(2)
    kv = torch.zeros(2, 4, 16, 2, 16)
    key, value = torch.randn(3, 2, 16, generator=g), torch.randn(3, 2, 16, generator=g)
    write_kv_cache(key, value, kv, torch.tensor([5, -1, 40]))
    outs.append(kv)
    logits = torch.randn(3, 300, generator=g)
    outs.append(gumbel_sample(logits, torch.tensor([2, 0, 1], dtype=torch.int32),
                              torch.tensor([0.8, 0.0, 1.3]), torch.tensor([1, 2, 3]),
                              torch.tensor([4, 5, 6])))
    return outs


def test_kernels_give_the_same_bits_with_the_speedups_off():
    fast = _kernel_outputs()
    with _speedups_off():
        slow = _kernel_outputs()
    for a, b in zip(fast, slow):
        assert torch.equal(a, b)


def test_mrv2_interpreter_fast_0_keeps_tritons_frontend():
    import os
    import subprocess
    import sys

    code = ("import mrv2.platform, mrv2.interpreter_fast as f, triton.runtime.interpreter as i; "
            "print(f._INSTALLED, i._get_np_dtype.__module__)")
    env = {**os.environ, "MRV2_INTERPRETER_FAST": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["[]", "triton.runtime.interpreter"]


def test_launcher_memo_keeps_the_constexpr_names():
    from triton.runtime import interpreter

    fn = _mixed_ops.fn
    names = ["a_ptr", "b_ptr", "out_f_ptr", "out_i_ptr", "off", "M", "N"]
    for _ in range(2):  # a memo miss, then a hit
        fast = interpreter.GridExecutor(fn, names, (1,))
        assert fast.fn is fn and fast.grid == (1,) and fast.arg_names is names
    with _speedups_off():
        slow = interpreter.GridExecutor(fn, names, (1,))
    assert set(fast.constexprs) == set(slow.constexprs) == {"M", "N"}
