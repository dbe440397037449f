"""The tensor-core stream decode GEMMs (``mrv2.kernels.small_m_stream``, 3-32 rows) against
skinny_fused's torch references, and the model through them against the model without them.

Under the interpreter in fp32: ragged shapes (N not a multiple of the column block, K not a
power of two), 0 / 3 / 16 / 17 / 32 rows, 1 to 4 K chunks (``MAX_BLOCK_K`` lowered so small
K takes several), bias on/off, the in-place add into a strided view, the routing (more rows
or a launch override keep small_m_fused's K-stepping kernel), the launch rules; the embedded
Qwen3 decoding 4 requests through them. bf16 at the Qwen3-0.6B shapes on the GPU.
"""

import pytest
import torch
from test_skinny_fused import TOL, _inputs  # the fused kernels' inputs and tolerance

import mrv2  # noqa: F401  (turns on the interpreter without CUDA)
from mrv2 import LLM, SamplingParams
from mrv2.kernels import persistent_layer, small_m_fused, small_m_stream
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
from mrv2.platform import DEVICE, HAS_CUDA

CASES = [(3, 40, 96, False), (17, 24, 200, True), (32, 17, 64, True), (5, 64, 300, False),
         (0, 24, 64, True), (16, 1, 16, False)]


@pytest.fixture(autouse=True)
def _stream_on(monkeypatch):
    """The stream path on (off by default under the interpreter), the persistent tail off."""
    monkeypatch.setattr(small_m_stream, "ENABLED", True)
    monkeypatch.setattr(persistent_layer, "ENABLED", False)


@pytest.fixture
def spy(monkeypatch):
    """The row counts of the launches that reached ``small_m_stream.run``."""
    calls = []
    orig = small_m_stream.run
    monkeypatch.setattr(small_m_stream, "run",
                        lambda *a, **k: calls.append(a[0].shape[0]) or orig(*a, **k))
    return calls


@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("M,N,K,bias", CASES)
def test_the_three_gemms_match_their_references(M, N, K, bias, chunked, spy, monkeypatch):
    """``chunked``: ``MAX_BLOCK_K`` lowered to the narrowest chunk that still fits, so K of
    64-300 takes 3-4 chunks (one tensor each in the kernel)."""
    if chunked:
        monkeypatch.setattr(small_m_stream, "MAX_BLOCK_K",
                            max(16, 1 << (-(-K // small_m_stream.MAX_CHUNKS) - 1).bit_length()))
        assert -(-K // small_m_stream.block_k(K)) >= (3 if K > 16 else 1)
    x, nw, w, b = _inputs(M, N, K, bias, seed=M * 7 + N)
    torch.testing.assert_close(small_m_norm_linear(x, nw, 1e-6, w, b),
                               skinny_norm_linear_ref(x, nw, 1e-6, w, b), **TOL)
    res = torch.randn(M, N, device=DEVICE)
    want = skinny_linear_add_ref(x, w, res.clone(), b)
    got = res.clone()
    assert small_m_linear_add(x, w, got, b) is got               # in place, as documented
    torch.testing.assert_close(got, want, **TOL)
    _, _, w2, b2 = _inputs(M, N, K, bias, seed=M + 100, rows=2)
    torch.testing.assert_close(small_m_norm_gate_up_silu(x, nw, 1e-6, w2, b2),
                               skinny_norm_gate_up_silu_ref(x, nw, 1e-6, w2, b2), **TOL)
    assert spy == ([M] * 3 if M else [])        # every launch took the stream kernel


def test_the_add_into_a_row_strided_view(spy):
    """x and the residual as column slices of wider buffers: only the residual's own
    columns change."""
    x, _, w, b = _inputs(6, 20, 72, True, seed=9)
    xbuf = torch.randn(6, 100, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    xbuf[:, :72] = x
    buf = torch.randn(6, 32, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    before = buf.clone()
    small_m_linear_add(xbuf[:, :72], w, buf[:, :20], b)
    torch.testing.assert_close(buf[:, :20], skinny_linear_add_ref(x, w, before[:, :20], b),
                               **TOL)
    assert torch.equal(buf[:, 20:], before[:, 20:])
    assert spy == [6]


def test_overrides_and_more_rows_keep_the_k_stepping_kernel(spy):
    """A launch override is the K-stepping kernel's knob; 33+ rows do not fit one program."""
    x, nw, w, b = _inputs(4, 50, 80, True, seed=4)
    want = skinny_norm_linear_ref(x, nw, 1e-6, w, b)
    torch.testing.assert_close(small_m_norm_linear(x, nw, 1e-6, w, b,
                                                   config={"block_k": 32}), want, **TOL)
    x, nw, w, b = _inputs(33, 20, 64, False, seed=33)
    torch.testing.assert_close(small_m_norm_linear(x, nw, 1e-6, w, b),
                               skinny_norm_linear_ref(x, nw, 1e-6, w, b), **TOL)
    assert spy == []
    small_m_norm_linear(x[:32], nw, 1e-6, w, b)
    assert spy == [32]


def test_the_launch_rules():
    assert small_m_stream.block_k(1024) == 1024
    assert small_m_stream.block_k(3072) == 1024          # three chunks (down_proj)
    assert small_m_stream.block_k(100) == 128            # one chunk, padded
    assert small_m_stream.block_k(8192) == 2048          # wider than MAX_BLOCK_K:
    assert not small_m_stream.fits(4, 8192, False)       # ... so it does not fit
    assert small_m_stream.fits(32, 4096, False) and not small_m_stream.fits(33, 64, False)
    assert small_m_stream.fits(3, 2048, True) and not small_m_stream.fits(3, 4096, True)
    assert small_m_stream.default_launch(1024, False) == (16, 8)    # 16,384 weights
    assert small_m_stream.default_launch(1024, True) == (16, 8)     # gate and up: 32,768
    assert small_m_stream.default_launch(3072, False) == (16, 16)   # 49,152: 16 warps


def test_tuned_launches_are_read_by_kind_and_row_block(monkeypatch):
    monkeypatch.setattr(small_m_stream, "TRITON_INTERPRET", False)   # the GPU's choice
    assert small_m_stream.pick_launch(5, 4096, 1024, "norm") == (16, 16, 8)
    monkeypatch.setattr(small_m_stream, "TUNED", {"norm/32": [32, 4]})
    assert small_m_stream.pick_launch(20, 4096, 1024, "norm") == (32, 32, 4)
    assert small_m_stream.pick_launch(16, 4096, 1024, "norm") == (16, 16, 8)  # other block
    assert small_m_stream.pick_launch(20, 4096, 1024, "norm", 64, 16) == (32, 64, 16)


def test_the_model_sends_up_to_32_rows_while_it_is_on(monkeypatch):
    monkeypatch.setattr(small_m_fused, "ENABLED", True)
    x = torch.zeros(24, 64, device=DEVICE)
    assert small_m_fused.model_max_m() == 32 and small_m_fused.use_small_m_fused(x)
    monkeypatch.setattr(small_m_stream, "ENABLED", False)
    assert small_m_fused.model_max_m() == small_m_fused.MODEL_MAX_M == 16
    assert not small_m_fused.use_small_m_fused(x)


@pytest.mark.slow
def test_llm_greedy_with_the_stream_path_equals_without(monkeypatch, spy):
    """End to end in fp32: 4 prompts decoding side by side (T = 4) through the fused decode
    layers, their GEMMs this kernel's or small_m_fused's K-stepping one."""
    # NOTE: eager: a replayed CUDA graph runs no Python, so the spy would see no call.
    llm = LLM(max_model_len=64, max_num_seqs=4, dtype="float32", enforce_eager=True)
    monkeypatch.setattr(small_m_fused, "ENABLED", True)       # NOTE: on a GPU by default
    prompts = ["ROMEO:", "JULIET:\nO Romeo,", "First Citizen:", "KING HENRY:"]
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=5)
    monkeypatch.setattr(small_m_stream, "ENABLED", False)
    off = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert not spy
    monkeypatch.setattr(small_m_stream, "ENABLED", True)
    on = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert 4 in spy                                              # the decodes took it
    assert on == off


# --------------------------------------------------------------- bf16 (GPU only)

@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="bf16 needs the GPU")
@pytest.mark.parametrize("M", [3, 8, 17, 32])
def test_gpu_bf16_qwen3_shapes_vs_the_k_stepping_kernel(M):
    """Each GEMM vs small_m_fused's K-stepping kernel (a ``config`` keeps it) at the
    Qwen3-0.6B shapes, bf16, PDL as the GPU has it: both against the fp32 product, this
    kernel's error at most 2x the other's (+ 1e-2)."""
    kw = {"device": "cuda", "dtype": torch.bfloat16}
    g = torch.Generator(device="cuda").manual_seed(M)
    h = torch.randn(M, 1024, generator=g, **kw)
    nw = 1 + 0.1 * torch.randn(1024, generator=g, **kw)
    wqkv = torch.randn(4096, 1024, generator=g, **kw) * 0.05
    wo = torch.randn(1024, 2048, generator=g, **kw) * 0.05
    wgu = torch.randn(6144, 1024, generator=g, **kw) * 0.05
    wd = torch.randn(1024, 3072, generator=g, **kw) * 0.05
    attn = torch.randn(M, 2048, generator=g, **kw)
    act = torch.randn(M, 3072, generator=g, **kw)
    stepping = {"config": {"block_k": 64}}

    def check(stream, other, exact):
        err_s = (stream.float() - exact).abs().max().item()
        err_k = (other.float() - exact).abs().max().item()
        assert err_s <= 2 * err_k + 1e-2, (err_s, err_k)

    check(small_m_norm_linear(h, nw, 1e-6, wqkv),
          small_m_norm_linear(h, nw, 1e-6, wqkv, **stepping),
          skinny_norm_linear_ref(h.float(), nw.float(), 1e-6, wqkv.float()))
    check(small_m_norm_gate_up_silu(h, nw, 1e-6, wgu),
          small_m_norm_gate_up_silu(h, nw, 1e-6, wgu, **stepping),
          skinny_norm_gate_up_silu_ref(h.float(), nw.float(), 1e-6, wgu.float()))
    for a, w in ((attn, wo), (act, wd)):
        r1, r2 = h.clone(), h.clone()
        check(small_m_linear_add(a, w, r1), small_m_linear_add(a, w, r2, **stepping),
              h.float() + a.float() @ w.float().T)
