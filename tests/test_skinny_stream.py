"""The stream decode GEMMs (``mrv2.kernels.skinny_stream``) against their torch references,
and the model through them against the model without them.

Under the interpreter in fp32: ragged shapes (N not a multiple of the column block, K not a
power of two), 0..2 rows, bias on/off, launch overrides, the in-place add, the launch caps;
the embedded Qwen3 decoding through them.
bf16 at the Qwen3-0.6B shapes on the GPU.
"""

import pytest
import torch
from test_skinny_fused import _inputs  # the same random operands

import mrv2  # noqa: F401  (turns on the interpreter without CUDA)
from mrv2 import LLM, SamplingParams
from mrv2.kernels import persistent_layer, skinny_fused, skinny_stream
from mrv2.kernels.skinny_fused import (
    skinny_linear_add,
    skinny_linear_add_ref,
    skinny_norm_gate_up_silu,
    skinny_norm_gate_up_silu_ref,
    skinny_norm_linear,
    skinny_norm_linear_ref,
)
from mrv2.platform import DEVICE, HAS_CUDA

TOL = {"rtol": 1e-5, "atol": 1e-4}
CASES = [(1, 40, 96, False), (2, 24, 200, True), (2, 17, 64, True), (1, 33, 48, False),
         (2, 64, 300, True), (0, 24, 64, True), (1, 1, 16, False)]


@pytest.fixture(autouse=True)
def _stream_on(monkeypatch):
    """The stream path on (off by default under the interpreter), the persistent tail off."""
    monkeypatch.setattr(skinny_stream, "ENABLED", True)
    monkeypatch.setattr(persistent_layer, "ENABLED", False)


@pytest.fixture
def spy(monkeypatch):
    """The launches that reached ``skinny_stream.run``."""
    calls = []
    orig = skinny_stream.run
    monkeypatch.setattr(skinny_stream, "run",
                        lambda *a, **k: calls.append(a[0].shape[0]) or orig(*a, **k))
    return calls


@pytest.mark.parametrize("M,N,K,bias", CASES)
def test_the_three_gemms_match_their_references(M, N, K, bias, spy):
    x, nw, w, b = _inputs(M, N, K, bias, seed=M * 7 + N)
    torch.testing.assert_close(skinny_norm_linear(x, nw, 1e-6, w, b),
                               skinny_norm_linear_ref(x, nw, 1e-6, w, b), **TOL)
    res = torch.randn(M, N, device=DEVICE)
    want = skinny_linear_add_ref(x, w, res.clone(), b)
    got = res.clone()
    assert skinny_linear_add(x, w, got, b) is got              # in place, as documented
    torch.testing.assert_close(got, want, **TOL)
    _, _, w2, b2 = _inputs(M, N, K, bias, seed=M + 100, rows=2)
    torch.testing.assert_close(skinny_norm_gate_up_silu(x, nw, 1e-6, w2, b2),
                               skinny_norm_gate_up_silu_ref(x, nw, 1e-6, w2, b2), **TOL)
    assert spy == ([M] * 3 if M else [])       # every launch took the stream kernel


def test_row_strided_x_and_residual_views(spy):
    """x and the residual as column slices of wider buffers (row strides > their widths): only
    the residual's own columns change."""
    x, nw, w, b = _inputs(2, 20, 72, True, seed=9)
    xbuf = torch.randn(2, 100, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    xbuf[:, :72] = x
    buf = torch.randn(2, 32, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    before = buf.clone()
    skinny_linear_add(xbuf[:, :72], w, buf[:, :20], b)
    torch.testing.assert_close(buf[:, :20], skinny_linear_add_ref(x, w, before[:, :20], b), **TOL)
    assert torch.equal(buf[:, 20:], before[:, 20:])
    torch.testing.assert_close(skinny_norm_linear(xbuf[:, :72], nw, 1e-6, w, b),
                               skinny_norm_linear_ref(x, nw, 1e-6, w, b), **TOL)
    assert spy == [2, 2]


@pytest.mark.parametrize("block_n", [1, 4, 32])
def test_launch_overrides_and_the_skinny_kernel_fallback(block_n, spy):
    x, nw, w, b = _inputs(2, 50, 80, True, seed=block_n)
    want = skinny_norm_linear_ref(x, nw, 1e-6, w, b)
    torch.testing.assert_close(skinny_norm_linear(x, nw, 1e-6, w, b, block_n=block_n), want,
                               **TOL)
    assert spy == [2]
    # a block_k override is the K-stepping kernel's knob: it keeps that kernel
    torch.testing.assert_close(skinny_norm_linear(x, nw, 1e-6, w, b, block_k=32), want, **TOL)
    assert spy == [2]


def test_the_launch_caps():
    assert skinny_stream.default_launch(1024, False) == (16, 8)    # 16,384 weights a program
    assert skinny_stream.default_launch(3072, False) == (4, 8)     # K padded to 4,096
    assert skinny_stream.default_launch(1024, True) == (8, 8)      # gate and up rows
    # at most 128 weights a thread: 4 warps hold half of what 8 do
    assert skinny_stream.max_block_n(2048, False, 8) == 16
    assert skinny_stream.max_block_n(2048, False, 4) == 8
    assert skinny_stream.max_block_n(3072, True, 4) == 2        # 2 x 4,096 a column
    assert skinny_stream.fits(2, 4096, True) and not skinny_stream.fits(3, 64, False)
    assert not skinny_stream.fits(1, 16385, True)                   # one column too wide


def test_more_rows_keep_the_k_stepping_kernel(spy):
    """3-8 rows (skinny_fused takes up to 8) stay on skinny_fused's own kernel: the stream
    kernel lost there (job 15C)."""
    x, nw, w, b = _inputs(3, 20, 64, False, seed=3)
    torch.testing.assert_close(skinny_norm_linear(x, nw, 1e-6, w, b),
                               skinny_norm_linear_ref(x, nw, 1e-6, w, b), **TOL)
    assert spy == []


def test_tuned_launches_are_read_by_kind_and_rows(monkeypatch):
    monkeypatch.setattr(skinny_stream, "TRITON_INTERPRET", False)     # the GPU's choice
    assert skinny_stream.pick_launch(1, 4096, 1024, "norm") == (16, 8)
    monkeypatch.setattr(skinny_stream, "TUNED", {"norm/1": [4, 8], "add/1": [32, 4]})
    assert skinny_stream.pick_launch(1, 4096, 1024, "norm") == (4, 8)
    assert skinny_stream.pick_launch(2, 4096, 1024, "norm") == (16, 8)   # M = 2: default
    assert skinny_stream.pick_launch(1, 1024, 3072, "add") == (4, 4)     # capped: spills
    assert skinny_stream.pick_launch(1, 1024, 2048, "add", 2, 8) == (2, 8)   # overrides


@pytest.mark.slow
def test_llm_greedy_with_the_stream_path_equals_without(monkeypatch, spy):
    """End to end in fp32: 2 prompts decoding side by side (T = 2) through the fused decode
    layers, their GEMMs the stream kernel's or skinny_fused's own."""
    # NOTE: eager: a replayed CUDA graph runs no Python, so the spy would see no call.
    llm = LLM(max_model_len=64, max_num_seqs=2, dtype="float32", enforce_eager=True)
    monkeypatch.setattr(skinny_fused, "ENABLED", True)          # NOTE: on a GPU by default
    prompts = ["ROMEO:", "JULIET:\nO Romeo,"]
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=6)
    monkeypatch.setattr(skinny_stream, "ENABLED", False)
    off = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert not spy
    monkeypatch.setattr(skinny_stream, "ENABLED", True)
    on = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert spy                                                   # the stream path ran
    assert on == off


# --------------------------------------------------------------- bf16 (GPU only)

@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="bf16 needs the GPU")
@pytest.mark.parametrize("M", [1, 2])
def test_gpu_bf16_qwen3_shapes_vs_the_k_stepping_kernel(M):
    """Each stream GEMM vs skinny_fused's K-stepping kernel (``block_k=1024`` keeps it) at
    the Qwen3-0.6B shapes, bf16, PDL as the GPU has it: both against the fp32 product, the
    stream kernel's error at most 2x the other's (+ 1e-2)."""
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

    def check(stream, stepping, exact):
        err_s = (stream.float() - exact).abs().max().item()
        err_k = (stepping.float() - exact).abs().max().item()
        assert err_s <= 2 * err_k + 1e-2, (err_s, err_k)

    check(skinny_norm_linear(h, nw, 1e-6, wqkv), skinny_norm_linear(h, nw, 1e-6, wqkv,
                                                                     block_k=1024),
          skinny_norm_linear_ref(h.float(), nw.float(), 1e-6, wqkv.float()))
    check(skinny_norm_gate_up_silu(h, nw, 1e-6, wgu),
          skinny_norm_gate_up_silu(h, nw, 1e-6, wgu, block_k=1024),
          skinny_norm_gate_up_silu_ref(h.float(), nw.float(), 1e-6, wgu.float()))
    for a, w in ((attn, wo), (act, wd)):
        r1, r2 = h.clone(), h.clone()
        check(skinny_linear_add(a, w, r1), skinny_linear_add(a, w, r2, block_k=1024),
              h.float() + a.float() @ w.float().T)
