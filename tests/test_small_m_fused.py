"""The tensor-core fused decode GEMMs (3-256 rows) against skinny_fused's torch references,
and the model's decode path through them against its unfused path.

Under the interpreter in fp32: ragged shapes (N not a multiple of the column block, K not a
multiple of the K step), 0 / 3 / 17 / 64 / 150 rows (one and several row blocks), bias on/off,
launch overrides, the in-place add into a strided view, the PDL path (prefetched first tile,
peeled first step) bitwise equal to the plain one; then the embedded Qwen3 with the path
forced on vs off (logits and greedy tokens). bf16 at the Qwen3-0.6B shapes on the GPU.
"""

import pytest
import torch
from device_utils import qwen3_layer_weights
from test_skinny_fused import TOL, _inputs  # the fused kernels' inputs and tolerance

import mrv2  # noqa: F401  (turns on the interpreter without CUDA)
from mrv2 import LLM, SamplingParams
from mrv2.kernels import pdl, skinny_fused, small_m_fused, small_m_resident
from mrv2.kernels.skinny_fused import (
    skinny_linear_add_ref,
    skinny_norm_gate_up_silu_ref,
    skinny_norm_linear_ref,
)
from mrv2.kernels.small_m_fused import (
    small_m_linear_add,
    small_m_norm_gate_up_silu,
    small_m_norm_linear,
)
from mrv2.models import qwen3
from mrv2.platform import DEVICE, HAS_CUDA, TRITON_INTERPRET


@pytest.fixture(autouse=True)
def _own_kernel(monkeypatch):
    # These tests are small_m_fused's own Triton kernel: its entry points hand bf16 / fp16
    # GPU calls to small_m_resident by default (tests/test_small_m_resident.py).
    monkeypatch.setattr(small_m_resident, "ENABLED", False)


CASES = [(3, 40, 96, False), (17, 24, 200, True), (64, 17, 64, True), (5, 64, 300, False),
         (0, 24, 64, True), (150, 24, 64, True)]
OVERRIDES = ({}, {"block_m": 16, "block_n": 16, "block_k": 64},
             {"block_m": 32, "block_n": 32, "block_k": 32})


@pytest.mark.parametrize("M,N,K,bias", CASES)
def test_norm_linear_matches_reference(M, N, K, bias):
    x, nw, w, b = _inputs(M, N, K, bias, seed=M * 100 + N + K)
    ref = skinny_norm_linear_ref(x, nw, 1e-6, w, b)
    for cfg in OVERRIDES:
        out = small_m_norm_linear(x, nw, 1e-6, w, b, config=cfg)
        assert out.shape == (M, N) and out.dtype == x.dtype
        torch.testing.assert_close(out, ref, **TOL)


@pytest.mark.parametrize("M,N,K,bias", CASES)
def test_linear_add_matches_reference_in_place(M, N, K, bias):
    x, _, w, b = _inputs(M, N, K, bias, seed=M * 100 + N + K + 1)
    residual = torch.randn(M, N, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    ref = skinny_linear_add_ref(x, w, residual.clone(), b)
    for cfg in OVERRIDES:
        r = residual.clone()
        out = small_m_linear_add(x, w, r, b, config=cfg)
        assert out is r                                       # written in place, returned
        torch.testing.assert_close(r, ref, **TOL)


def test_linear_add_into_a_row_strided_view():
    x, _, w, b = _inputs(5, 20, 72, True, seed=9)
    buf = torch.randn(5, 32, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    before = buf.clone()
    small_m_linear_add(x, w, buf[:, :20], b)
    torch.testing.assert_close(buf[:, :20], skinny_linear_add_ref(x, w, before[:, :20], b), **TOL)
    assert torch.equal(buf[:, 20:], before[:, 20:])


@pytest.mark.parametrize("M,N,K,bias", CASES)
def test_norm_gate_up_silu_matches_reference(M, N, K, bias):
    x, nw, w, b = _inputs(M, N, K, bias, seed=M * 100 + N + K + 2, rows=2)
    ref = skinny_norm_gate_up_silu_ref(x, nw, 1e-5, w, b)
    for cfg in OVERRIDES:
        out = small_m_norm_gate_up_silu(x, nw, 1e-5, w, b, config=cfg)
        assert out.shape == (M, N) and out.dtype == x.dtype
        torch.testing.assert_close(out, ref, **TOL)


def test_bad_input_raises_before_work():
    x, nw, w, _ = _inputs(4, 32, 64, True, seed=3)
    with pytest.raises(ValueError, match="at most 256 rows"):
        small_m_norm_linear(torch.randn(257, 64, device=DEVICE), nw, 1e-6, w)
    with pytest.raises(ValueError, match="norm_weight"):
        small_m_norm_linear(x, nw[:10], 1e-6, w)
    with pytest.raises(ValueError, match="even"):
        small_m_norm_gate_up_silu(x, nw, 1e-6, w[:31])
    with pytest.raises(ValueError, match="dtype"):
        small_m_norm_linear(x.double(), nw.double(), 1e-6, w.double())
    res = torch.zeros(4, 32, device=DEVICE)
    with pytest.raises(ValueError, match="residual"):
        small_m_linear_add(x, w, res[:, :31])
    with pytest.raises(ValueError, match="share memory"):
        small_m_linear_add(res, torch.randn(32, 32, device=DEVICE), res)


@pytest.mark.skipif(not TRITON_INTERPRET, reason="the interpreter's PDL path (no gdc calls)")
@pytest.mark.parametrize("M,N,K,bias", [(3, 40, 128, False), (17, 24, 192, True),
                                         (64, 17, 64, True), (5, 64, 256, False)])
def test_pdl_path_equals_the_plain_path(M, N, K, bias, monkeypatch):
    # The PDL path loads the first weight tile(s) before the (skipped) wait and peels the
    # first K step: the same sums in the same order, so bitwise the same result. NOTE: K a
    # multiple of the default block_k (PDL is only taken then, see small_m_fused._run).
    x, nw, w, b = _inputs(M, N, K, bias, seed=M + N + K, rows=2)
    outs = {}
    for on in (False, True):
        monkeypatch.setattr(pdl, "use_pdl", lambda device, on=on: on)
        r = torch.zeros(M, 2 * N, device=DEVICE)
        outs[on] = (small_m_norm_linear(x, nw, 1e-6, w, b),
                    small_m_norm_gate_up_silu(x, nw, 1e-6, w, b),
                    small_m_linear_add(x, w, r, b))
    for a, c in zip(outs[False], outs[True], strict=True):
        assert torch.equal(a, c)


def test_switch_reads_only_shapes(monkeypatch):
    assert small_m_fused.ENABLED is False or not TRITON_INTERPRET   # never interpreted
    monkeypatch.setattr(small_m_fused, "ENABLED", True)
    assert small_m_fused.use_small_m_fused(torch.zeros(3, 8, device=DEVICE))
    assert small_m_fused.use_small_m_fused(torch.zeros(16, 8, device=DEVICE))
    assert not small_m_fused.use_small_m_fused(torch.zeros(2, 8, device=DEVICE))  # skinny's
    assert not small_m_fused.use_small_m_fused(torch.zeros(17, 8, device=DEVICE))  # cuBLAS's
    assert not small_m_fused.use_small_m_fused(torch.zeros(8, 16, device=DEVICE)[:, ::2])


# --------------------------------------------------------------- in the model

def _llm_tokens(llm, prompts, monkeypatch, on):
    calls = []
    orig = qwen3.Qwen3DecoderLayer.forward_decode
    monkeypatch.setattr(qwen3.Qwen3DecoderLayer, "forward_decode",
                        lambda self, *a: calls.append(a[1].shape[0]) or orig(self, *a))
    monkeypatch.setattr(small_m_fused, "ENABLED", on)
    monkeypatch.setattr(skinny_fused, "ENABLED", False)       # NOTE: on a GPU it is on
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=5)
    out = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    monkeypatch.undo()
    return out, calls


def test_llm_greedy_small_m_fused_on_equals_off(monkeypatch):
    """End to end: 4 prompts (a 14-token prefill, then decodes of T = 4), on vs off, fp32."""
    # NOTE: eager: a replayed CUDA graph runs no Python, so the spy would see no call.
    llm = LLM(max_model_len=64, max_num_seqs=4, dtype="float32", enforce_eager=True)
    prompts = ["ROMEO:", "JULIET:\nO Romeo,", "First Citizen:", "KING HENRY:"]
    off, calls_off = _llm_tokens(llm, prompts, monkeypatch, False)
    on, calls_on = _llm_tokens(llm, prompts, monkeypatch, True)
    # the 14-token prefill and the 4-row decodes (3-64 rows: prompts too) took the path
    assert not calls_off and 14 in calls_on and 4 in calls_on
    assert on == off


@pytest.mark.skipif(not HAS_CUDA, reason="bf16 needs the GPU")
@pytest.mark.parametrize("M", [4, 32, 64, 256])
def test_gpu_bf16_qwen3_shapes(M):
    """bf16 at the Qwen3-0.6B shapes: within bf16 rounding of the references."""
    kw = {"device": "cuda", "dtype": torch.bfloat16}
    g = torch.Generator(device="cuda").manual_seed(M)
    x = torch.randn(M, 1024, generator=g, **kw)
    nw, qkv, _, gate_up, down = qwen3_layer_weights(g, **kw)
    tol = {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(small_m_norm_linear(x, nw, 1e-6, qkv),
                               skinny_norm_linear_ref(x, nw, 1e-6, qkv), **tol)
    act = small_m_norm_gate_up_silu(x, nw, 1e-6, gate_up)
    torch.testing.assert_close(act, skinny_norm_gate_up_silu_ref(x, nw, 1e-6, gate_up), **tol)
    r = x.clone()
    torch.testing.assert_close(small_m_linear_add(act, down, r),
                               skinny_linear_add_ref(act, down, x.clone()), **tol)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="CUDA graphs need the GPU")
@pytest.mark.parametrize("M", [4, 32])
def test_gpu_chain_in_a_cuda_graph_pdl_on_equals_off(M, monkeypatch):
    """Two fused layers at the Qwen3-0.6B shapes, bf16, captured in a CUDA graph: with PDL
    (the default on Hopper) bitwise what they give without it."""
    kw = {"device": "cuda", "dtype": torch.bfloat16}
    g = torch.Generator(device="cuda").manual_seed(M)
    ws = [qwen3_layer_weights(g, **kw) for _ in range(2)]
    h0 = torch.randn(M, 1024, generator=g, **kw)

    def chain(h):
        for nw, qkv, o, gate_up, down in ws:
            q = small_m_norm_linear(h, nw, 1e-6, qkv)
            small_m_linear_add(q[:, :2048], o, h)
            small_m_linear_add(small_m_norm_gate_up_silu(h, nw, 1e-6, gate_up), down, h)
        return h

    outs = {}
    for on in (False, True):
        monkeypatch.setattr(pdl, "PDL_ENABLED", on)
        h = h0.clone()
        chain(h)                                            # compile
        h.copy_(h0)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            chain(h)
        h.copy_(h0)
        graph.replay()
        torch.cuda.synchronize()
        outs[on] = h.clone()
    assert torch.equal(outs[True], outs[False])
