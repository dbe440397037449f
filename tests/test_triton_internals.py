"""The private Triton pieces mrv2 uses are still there (a readable failure when one is gone).

mrv2 only speeds the interpreter up with them (``mrv2.platform``) and falls back to the
public path without them, so a missing one is not a crash: this test is what notices.
"""

import dataclasses

import pytest
import triton
import triton.language as tl

from mrv2 import platform


def test_triton_internals_mrv2_relies_on_are_present():
    missing = platform.missing_triton_internals()
    assert not missing, (
        f"Triton {triton.__version__} lacks internals mrv2 uses: {', '.join(missing)}. "
        f"mrv2 supports triton{platform.SUPPORTED_TRITON} (pyproject.toml); update "
        "mrv2/platform.py for this Triton or install a supported one.")


def test_triton_version_is_in_the_pinned_range():
    major, minor = (int(x) for x in triton.__version__.split(".")[:2])
    assert (3, 6) <= (major, minor) < (3, 10), (
        f"Triton {triton.__version__} is outside triton{platform.SUPPORTED_TRITON}")


@pytest.mark.skipif(not platform.TRITON_INTERPRET, reason="interpreter only")
def test_the_interpreter_speedups_are_on():
    from triton.runtime import interpreter

    opts = interpreter.interpreter_builder.options
    assert dataclasses.is_dataclass(opts) and opts.sanitize_overflow is False


def test_interpreter_body_falls_back_to_the_helper_without_rewrite():
    class NoRewrite:  # a jit helper of a Triton without the private rewrite()
        pass

    helper = NoRewrite()
    assert platform.interpreter_body(helper) is helper
    body = platform.interpreter_body(tl.sum)
    assert body is tl.sum if not platform.TRITON_INTERPRET else callable(body)


@pytest.mark.skipif(not platform.TRITON_INTERPRET, reason="interpreter only")
def test_the_language_is_patched_once_and_kernels_still_agree():
    import torch
    from triton.runtime import interpreter

    assert getattr(interpreter._patch_lang, "_mrv2_kept", False)

    @triton.jit
    def add_rowsum(x_ptr, out_ptr, N: tl.constexpr):
        i = tl.arange(0, N)
        x = tl.load(x_ptr + i)
        tl.store(out_ptr + i, x + tl.sum(x, 0))  # tl.sum is a jit helper: a nested patch

    for n in (1, 16, 64):  # several launches: the kept patch must serve every one
        x = torch.randn(n)
        out = torch.empty(n)
        add_rowsum[(1,)](x, out, n)
        torch.testing.assert_close(out, x + x.sum())
