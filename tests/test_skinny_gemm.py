"""The decode-sized weight-stream GEMM against ``F.linear`` (its reference).

Under the interpreter in fp32: random shapes with ragged edges (N not a multiple of the
column block, K not a multiple of the K step), 1..MAX_M rows, with and without bias,
an empty batch, and the launch overrides the sweep uses; bf16 on the GPU.
"""

import pytest
import torch
import torch.nn.functional as F

import mrv2  # noqa: F401  (turns on the interpreter without CUDA)
from mrv2.kernels.skinny_gemm import MAX_M, linear, skinny_linear
from mrv2.platform import DEVICE, HAS_CUDA


@pytest.mark.parametrize("M,N,K,bias", [(1, 40, 96, False), (3, 24, 200, True),
                                        (8, 17, 64, True), (5, 64, 300, False)])
def test_matches_f_linear(M, N, K, bias):
    g = torch.Generator().manual_seed(M * 1000 + N + K)
    x = torch.randn(M, K, generator=g).to(DEVICE)
    w = torch.randn(N, K, generator=g).to(DEVICE)
    b = torch.randn(N, generator=g).to(DEVICE) if bias else None
    ref = F.linear(x, w, b)
    for kw in ({}, {"block_n": 16, "block_k": 64}, {"block_n": 8, "block_k": 128}):
        out = skinny_linear(x, w, b, **kw)
        assert out.shape == (M, N) and out.dtype == x.dtype
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-4)


def test_strided_rows_empty_batch_and_bad_input():
    g = torch.Generator().manual_seed(3)
    big = torch.randn(4, 2 * 48, generator=g).to(DEVICE)
    x = big[:, :48]                                   # row stride 96: rows of a wider tensor
    w = torch.randn(20, 48, generator=g).to(DEVICE)
    torch.testing.assert_close(skinny_linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-4)
    assert skinny_linear(torch.empty(0, 48, device=DEVICE), w).shape == (0, 20)
    with pytest.raises(ValueError, match="at most"):
        skinny_linear(torch.randn(MAX_M + 1, 48, device=DEVICE), w)
    with pytest.raises(ValueError, match=r"\[M, K\]"):
        skinny_linear(torch.randn(2, 47, device=DEVICE), w)
    with pytest.raises(ValueError, match="contiguous"):
        skinny_linear(torch.randn(48, 2, device=DEVICE).t(), w)
    # the model's entry point: the kernel on the GPU for <= MODEL_MAX_M rows, else F.linear
    torch.testing.assert_close(linear(x[:2], w), F.linear(x[:2], w), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="bf16 needs the GPU")
@pytest.mark.parametrize("M", [1, 2, 4, 8])
@pytest.mark.parametrize("N,K", [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)])
def test_gpu_bf16_qwen3_shapes(M, N, K):
    g = torch.Generator(device="cuda").manual_seed(M + N)
    x = torch.randn(M, K, device="cuda", generator=g, dtype=torch.bfloat16)
    w = torch.randn(N, K, device="cuda", generator=g, dtype=torch.bfloat16) * 0.05
    ref = F.linear(x.float(), w.float())
    out = skinny_linear(x, w)
    # bf16 output rounding (and cuBLAS's own) dominates: compare as cuBLAS would be compared
    cublas = F.linear(x, w).float()
    err = (out.float() - ref).abs().max().item()
    assert err <= 2 * (cublas - ref).abs().max().item() + 1e-3
