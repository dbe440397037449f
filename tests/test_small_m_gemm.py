"""The tensor-core decode GEMM (3-64 rows) against ``F.linear`` (its reference).

Under the interpreter in fp32: rows from 0 to MAX_M (one row block, several row blocks,
a block boundary), N and K that the blocks do not divide, with and without bias, strided
rows, the launch overrides the sweep uses, bad input; the provisional defaults' invariants;
the benchmark's CPU smoke run. bf16 at the Qwen3-0.6B shapes (and inside a CUDA graph) on
the GPU.
"""

import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from script_loader import load_script

import mrv2  # noqa: F401  (turns on the interpreter without CUDA)
from mrv2.kernels.small_m_gemm import (
    _SMEM_BYTES,
    MAX_M,
    NUM_SMS,
    _launch,
    _smem_bytes,
    small_m_linear,
)
from mrv2.platform import DEVICE, HAS_CUDA, TRITON_INTERPRET

QWEN3_0_6B = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)]  # qkv, o, gate_up, down


def _inputs(M, N, K, bias, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(DEVICE)
    w = torch.randn(N, K, generator=g).to(DEVICE)
    b = torch.randn(N, generator=g).to(DEVICE) if bias else None
    return x, w, b


@pytest.mark.parametrize("M,N,K,bias", [(1, 40, 96, False), (3, 24, 200, True),
                                        (16, 17, 64, True), (17, 50, 130, False),
                                        (33, 70, 300, True), (64, 33, 160, False)])
def test_matches_f_linear(M, N, K, bias):
    x, w, b = _inputs(M, N, K, bias, seed=M * 1000 + N + K)
    ref = F.linear(x, w, b)
    # the default; small tiles (several row and column blocks, ragged K); one big K step
    for kw in ({}, {"block_m": 16, "block_n": 16, "block_k": 32},
               {"block_m": 64, "block_n": 32, "block_k": 256, "num_warps": 8, "num_stages": 2}):
        out = small_m_linear(x, w, b, **kw)
        assert out.shape == (M, N) and out.dtype == x.dtype
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-4)


def test_strided_rows_and_empty_sizes():
    g = torch.Generator().manual_seed(3)
    big = torch.randn(5, 2 * 48, generator=g).to(DEVICE)
    x = big[:, :48]                                   # row stride 96: rows of a wider tensor
    w = torch.randn(20, 48, generator=g).to(DEVICE)
    b = torch.randn(20, generator=g).to(DEVICE)
    torch.testing.assert_close(small_m_linear(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-4)
    assert small_m_linear(torch.empty(0, 48, device=DEVICE), w).shape == (0, 20)
    assert small_m_linear(x, torch.empty(0, 48, device=DEVICE)).shape == (5, 0)
    x0, w0 = torch.empty(5, 0, device=DEVICE), torch.empty(20, 0, device=DEVICE)
    torch.testing.assert_close(small_m_linear(x0, w0, b), F.linear(x0, w0, b))
    torch.testing.assert_close(small_m_linear(x0, w0), torch.zeros(5, 20, device=DEVICE))


def test_bad_input_raises_before_any_work():
    x, w, b = _inputs(4, 20, 48, True, seed=5)
    cases = [
        ((torch.randn(MAX_M + 1, 48, device=DEVICE), w), {}, "at most"),
        ((torch.randn(4, 47, device=DEVICE), w), {}, r"\[M, K\]"),
        ((x[0], w), {}, r"\[M, K\]"),
        ((torch.randn(48, 4, device=DEVICE).t(), w), {}, "contiguous last dim"),
        ((x, torch.randn(48, 20, device=DEVICE).t()), {}, "contiguous last dim"),
        ((x, w.double()), {}, "dtype"),
        ((x, w, b[:19]), {}, "bias"),
        ((x, w, b.double()), {}, "bias"),
        ((x, w), {"block_n": 8}, "block_n"),
        ((x, w), {"block_k": 48}, "block_k"),
        ((x, w), {"block_m": 2048}, "block_m"),
        ((x, w), {"num_warps": 3}, "num_warps"),
        ((x, w), {"num_stages": 0}, "num_stages"),
    ]
    for args, kw, match in cases:
        with pytest.raises(ValueError, match=match):
            small_m_linear(*args, **kw)
    with pytest.raises(TypeError, match="fp32, bf16 or fp16"):
        small_m_linear(x.double(), w.double())


@pytest.mark.parametrize("M", [3, 4, 8, 16, 17, 32, 33, 64])
def test_default_launch_streams_weights_once_and_fits(M):
    for (N, K), elem_bytes in itertools.product(QWEN3_0_6B, (2, 4)):   # bf16, fp32
        cfg = _launch(M, N, K, elem_bytes)
        assert set(cfg) == {"block_m", "block_n", "block_k", "num_warps", "num_stages"}
        assert cfg["block_m"] >= M and cfg["block_m"] in (16, 32, 64)  # one row block: W once
        assert cfg["block_n"] in (16, 32, 64) and 64 <= cfg["block_k"] <= 512
        waves = math.ceil(math.ceil(N / cfg["block_n"]) / NUM_SMS)      # programs per SM
        smem = _smem_bytes(cfg["block_m"], cfg["block_n"], cfg["block_k"], cfg["num_stages"],
                           elem_bytes)
        assert smem * waves <= _SMEM_BYTES and 2 <= cfg["num_stages"] <= 4


@pytest.mark.skipif(not TRITON_INTERPRET, reason="the smoke run uses CPU tensors: the interpreter only")
def test_bench_script_smoke(tmp_path):
    bench = load_script("bench_small_m_gemm")
    report = bench.main(["--smoke", "--sweep", "--out", str(tmp_path / "s.json")])
    assert report["smoke"] and (tmp_path / "s.json").exists()
    assert {(r["shape"], r["M"]) for r in report["sweep"]} == {
        (s, m) for s in ("qkv", "o", "gate_up", "down") for m in (4, 17)}
    assert all(r["best_config"] and r["tried"] for r in report["sweep"])
    runners = {(r["M"], r["runner"]) for r in report["chain"]}
    assert {(4, "cublas"), (4, "small_m"), (4, "skinny"), (17, "small_m_best")} <= runners


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="bf16 needs the GPU")
@pytest.mark.parametrize("M", [4, 8, 16, 32, 64])
@pytest.mark.parametrize("N,K", QWEN3_0_6B)
def test_gpu_bf16_qwen3_shapes(M, N, K):
    g = torch.Generator(device="cuda").manual_seed(M + N)
    x = torch.randn(M, K, device="cuda", generator=g, dtype=torch.bfloat16)
    w = torch.randn(N, K, device="cuda", generator=g, dtype=torch.bfloat16) * 0.05
    b = torch.randn(N, device="cuda", generator=g, dtype=torch.bfloat16)
    for bias in (None, b):
        ref = F.linear(x.float(), w.float(), None if bias is None else bias.float())
        out = small_m_linear(x, w, bias)
        # bf16 output rounding (and cuBLAS's own) dominates: compare as cuBLAS would be compared
        cublas = F.linear(x, w, bias).float()
        err = (out.float() - ref).abs().max().item()
        assert out.dtype == torch.bfloat16 and out.shape == (M, N)
        assert err <= 2 * (cublas - ref).abs().max().item() + 1e-3


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="CUDA graphs need the GPU")
def test_gpu_inside_a_cuda_graph():
    x = torch.randn(32, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16) * 0.05
    eager = small_m_linear(x, w)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = small_m_linear(x, w)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.testing.assert_close(out, small_m_linear(x, w), rtol=0, atol=0)
    assert not torch.equal(out, eager)
