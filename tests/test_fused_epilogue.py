"""mrv2/kernels/fused_epilogue.py (the fused decode GEMMs' shared epilogue) against torch.

A small kernel hands ``round_product`` and ``store_output`` an fp32 tile, as the GEMM kernels
do, on a ragged [M, N] (rows and columns past the tensor masked). The torch reference is the
unfused path's: the product rounded to the activation dtype, SiLU's result rounded, their
product rounded, then the residual added in fp32 and stored in the output dtype. fp32 in the
interpreter; bf16 (where every rounding shows) on the GPU. Bit for bit, except SiLU's exp
(Triton's and torch's may differ in the last bit): there within one step of the dtype.
"""

import pytest
import torch
import triton
import triton.language as tl

import mrv2  # noqa: F401  (turns on the interpreter without CUDA)
from mrv2.kernels.fused_epilogue import _round_product_body, _store_body
from mrv2.platform import DEVICE, HAS_CUDA


@triton.jit
def _epilogue_probe(acc_ptr, up_ptr, res_ptr, out_ptr, M, N, stride_rm, stride_om,
                    GATE_UP: tl.constexpr, ADD_RESIDUAL: tl.constexpr, BM: tl.constexpr,
                    BN: tl.constexpr):
    m = tl.arange(0, BM)
    n = tl.arange(0, BN)
    acc = tl.load(acc_ptr + m[:, None] * BN + n[None, :])                 # [BM, BN] fp32
    up = tl.load(up_ptr + m[:, None] * BN + n[None, :])
    y = _round_product_body(acc, up, out_ptr.dtype.element_ty, GATE_UP)
    _store_body(y, out_ptr, res_ptr, m, n, (m < M)[:, None] & (n < N)[None, :], stride_rm,
                stride_om, ADD_RESIDUAL)


def _reference(acc, up, residual, dtype, gate_up, add):
    y = acc.to(dtype).float()
    if gate_up:
        s = (y / (1.0 + torch.exp(-y))).to(dtype).float()                   # silu(g), rounded
        y = (s * up.to(dtype).float()).to(dtype).float()
    if add:
        y = y + residual.float()
    return y.to(dtype)


def _run(dtype, gate_up, add, device):
    M, N, BM, BN = 5, 13, 8, 16                       # a ragged tile: rows 5-7, cols 13-15 off
    g = torch.Generator().manual_seed(int(gate_up) * 2 + int(add))
    acc, up = (torch.randn(BM, BN, generator=g) * 3 for _ in range(2))
    residual = torch.randn(M, N, generator=g).to(dtype)
    out = torch.full((M, 20), 7.0, dtype=dtype)       # row stride 20: columns 13-19 untouched
    acc_d, up_d, res_d, out_d = (t.to(device) for t in (acc, up, residual, out))
    _epilogue_probe[(1,)](acc_d, up_d, res_d, out_d, M, N, res_d.stride(0), out_d.stride(0),
                          GATE_UP=gate_up, ADD_RESIDUAL=add, BM=BM, BN=BN)
    got = out_d.cpu()
    want = _reference(acc[:M, :N], up[:M, :N], residual, dtype, gate_up, add)
    if gate_up:  # NOTE: Triton's exp and torch's may differ in the last fp32 bit, which a
        # rounding to bf16 can carry into one bf16 step: within one step of the activation dtype
        step = torch.finfo(dtype).eps
        torch.testing.assert_close(got[:, :N], want, rtol=step, atol=step)
    else:        # a rounding and an add: bit for bit
        assert torch.equal(got[:, :N], want)
    assert (got[:, N:] == 7.0).all()                  # nothing past N (or M) was written


@pytest.mark.parametrize("gate_up", [False, True])
@pytest.mark.parametrize("add", [False, True])
def test_matches_the_unfused_roundings_fp32(gate_up, add):
    _run(torch.float32, gate_up, add, DEVICE)


@pytest.mark.skipif(not HAS_CUDA, reason="bf16 in the interpreter is wrong: GPU only")
@pytest.mark.parametrize("gate_up", [False, True])
@pytest.mark.parametrize("add", [False, True])
def test_matches_the_unfused_roundings_bf16(gate_up, add):
    _run(torch.bfloat16, gate_up, add, "cuda")
