"""The persistent decode-layer tail (mrv2/kernels/persistent_layer.py) and its model path.

CPU (interpreter): the staged launches (one stage each) against the torch reference on
random inputs, edge shapes (a column block past N, a K step past K, 1 and 2 rows, the last
layer without a next qkv), bad input, the occupancy arithmetic, and the model's decode
logits through ``forward_decode_persistent`` against the per-GEMM path. GPU (Hopper): the
persistent launch (grid barriers) bitwise equal to the staged launches, in a CUDA graph
replayed several times (the barrier counter goes back to 0), and the model's logits.
"""

from __future__ import annotations

import pytest
import torch

import mrv2  # noqa: F401  (turns on the interpreter without CUDA)
from mrv2.kernels import persistent_layer, skinny_fused
from mrv2.kernels.persistent_layer import layer_tail, layer_tail_ref, programs_per_sm
from mrv2.models import qwen3_persistent
from mrv2.platform import DEVICE, HAS_CUDA

TOL = {"rtol": 1e-5, "atol": 1e-4}


def _weights(H, A, inter, Q, seed, device=DEVICE, dtype=torch.float32, scale=0.2):
    g = torch.Generator().manual_seed(seed)

    def r(*shape, s=scale):
        return (torch.randn(*shape, generator=g) * s).to(device, dtype)
    return {"wo": r(H, A), "ln2": 1 + r(H, s=0.1), "gu": r(2 * inter, H), "wd": r(H, inter),
            "ln1n": 1 + r(H, s=0.1), "wq": r(Q, H)}


def _run(fn, attn, h, w, has_next, eps=1e-6):
    nxt = (w["ln1n"], eps, w["wq"]) if has_next else ()
    return fn(attn, h, w["wo"], w["ln2"], eps, w["gu"], w["wd"], *nxt)


@pytest.mark.parametrize("M,H,A,inter,Q,has_next", [
    (1, 64, 128, 96, 192, True), (2, 48, 96, 72, 80, True), (1, 200, 136, 300, 72, False),
    (2, 130, 260, 70, 33, True), (1, 16, 16, 8, 16, True)])
def test_staged_layer_tail_matches_reference(M, H, A, inter, Q, has_next):
    w = _weights(H, A, inter, Q, seed=M * 7 + H)
    g = torch.Generator().manual_seed(1)
    attn = torch.randn(M, A, generator=g).to(DEVICE)
    h0 = (torch.randn(M, H, generator=g) * 3).to(DEVICE)
    h_ref, h = h0.clone(), h0.clone()
    ref = _run(layer_tail_ref, attn, h_ref, w, has_next)
    out = _run(layer_tail, attn, h, w, has_next)
    torch.testing.assert_close(h, h_ref, **TOL)
    if has_next:
        torch.testing.assert_close(out, ref, **TOL)
    else:
        assert out is None and ref is None


def test_staged_equals_the_per_gemm_kernels_bitwise(monkeypatch):
    """fp32 in the interpreter: the stages are skinny_fused's numerics, bit for bit."""
    monkeypatch.setattr(skinny_fused, "ENABLED", True)
    w = _weights(64, 128, 96, 192, seed=3)
    attn = torch.randn(1, 128).to(DEVICE)
    h0 = torch.randn(1, 64).to(DEVICE)
    h1, h2 = h0.clone(), h0.clone()
    qkv = _run(layer_tail, attn, h1, w, True)
    skinny_fused.skinny_linear_add(attn, w["wo"], h2)
    act = skinny_fused.skinny_norm_gate_up_silu(h2, w["ln2"], 1e-6, w["gu"])
    skinny_fused.skinny_linear_add(act, w["wd"], h2)
    assert torch.equal(h1, h2)
    assert torch.equal(qkv, skinny_fused.skinny_norm_linear(h2, w["ln1n"], 1e-6, w["wq"]))


def test_bad_input_raises_before_work():
    w = _weights(16, 16, 8, 16, seed=0)
    attn, h = torch.randn(1, 16).to(DEVICE), torch.randn(1, 16).to(DEVICE)
    h0 = h.clone()
    with pytest.raises(ValueError, match="wo must be"):
        layer_tail(attn, h, w["wo"][:, :8], w["ln2"], 1e-6, w["gu"], w["wd"])
    with pytest.raises(ValueError, match="1-2 rows"):
        big = torch.randn(3, 16).to(DEVICE)
        layer_tail(big, torch.randn(3, 16).to(DEVICE), w["wo"], w["ln2"], 1e-6, w["gu"], w["wd"])
    with pytest.raises(ValueError, match="next_w_qkv must be"):
        layer_tail(attn, h, w["wo"], w["ln2"], 1e-6, w["gu"], w["wd"], w["ln1n"], 1e-6,
                   w["wq"].t())
    with pytest.raises(ValueError, match="w_down must be"):
        layer_tail(attn, h, w["wo"], w["ln2"], 1e-6, w["gu"], w["wd"].double())
    for bad in ({"slots": 0, "sleep": 0}, {"slots": persistent_layer.MAX_SLOTS + 1, "sleep": 0}):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(persistent_layer, "BARRIER", bad)
            with pytest.raises(ValueError, match="BARRIER needs"):
                layer_tail(attn, h, w["wo"], w["ln2"], 1e-6, w["gu"], w["wd"])
    assert torch.equal(h, h0)                                     # nothing was written


def test_programs_per_sm():
    assert programs_per_sm(56, 0, 4) == 8          # 9 by registers, capped at 8
    assert programs_per_sm(128, 0, 4) == 4         # 4096 registers a warp x 4 warps
    assert programs_per_sm(255, 0, 8) == 1
    assert programs_per_sm(64, 100 * 1024, 16) == 2   # threads 4, registers 2, shared 2
    assert programs_per_sm(32, 200 * 1024, 4) == 1    # shared memory bound


def test_model_decode_through_the_persistent_path(monkeypatch):
    """The embedded model (fp32, interpreter): decode logits with the persistent path (its
    staged launches here) equal the per-GEMM fused path's, and the path ran."""
    from test_skinny_fused import _decode_logits

    from mrv2.models.loader import DEFAULT_MODEL_DIR, load_model
    model, config = load_model(DEFAULT_MODEL_DIR, dtype="float32")
    calls = []
    orig = qwen3_persistent.forward_decode_persistent
    monkeypatch.setattr("mrv2.models.qwen3.forward_decode_persistent",
                        lambda *a: calls.append(1) or orig(*a))
    for ids in ([3], [3, 9]):
        monkeypatch.setattr(persistent_layer, "ENABLED", False)
        base = _decode_logits(model, config, ids, 4, True, monkeypatch)
        monkeypatch.setattr(persistent_layer, "ENABLED", True)
        n = len(calls)
        on = _decode_logits(model, config, ids, 4, True, monkeypatch)
        assert len(calls) == n + 1
        torch.testing.assert_close(on, base, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------- GPU (H200)

def _needs_hopper():
    if not HAS_CUDA or torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the persistent launch needs an sm_90+ GPU")


def _graph_chain(M, layers, staged, monkeypatch, replays=3):
    """``layers`` layer tails at the Qwen3-0.6B shapes (bf16) in one CUDA graph; returns
    every replay's outputs (the counter must be back at 0 after each)."""
    monkeypatch.setattr(persistent_layer, "STAGED", staged)
    ws = [_weights(1024, 2048, 3072, 4096, seed=i, device="cuda", dtype=torch.bfloat16,
                   scale=0.05) for i in range(layers)]
    g = torch.Generator(device="cuda").manual_seed(M)
    attn = torch.randn(M, 2048, generator=g, device="cuda", dtype=torch.bfloat16)
    h0 = torch.randn(M, 1024, generator=g, device="cuda", dtype=torch.bfloat16)
    h = h0.clone()

    def run():
        outs = []
        for i, w in enumerate(ws):
            outs.append(_run(layer_tail, attn, h, w, has_next=i + 1 < layers))
        return outs

    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = run()
    results = []
    for _ in range(replays):
        h.copy_(h0)
        graph.replay()
        torch.cuda.synchronize()
        results.append([o.clone() for o in outs if o is not None] + [h.clone()])
        if not staged:
            assert all(int(c.abs().sum()) == 0 for c in persistent_layer._COUNTERS.values())
    return results


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs the GPU")
@pytest.mark.parametrize("M", [1, 2])
def test_gpu_persistent_bitwise_equal_to_staged(M, monkeypatch):
    _needs_hopper()
    staged = _graph_chain(M, 3, True, monkeypatch)
    persistent = _graph_chain(M, 3, False, monkeypatch)
    for s_run, p_run in zip(staged, persistent, strict=True):
        for i, (a, b) in enumerate(zip(s_run, p_run, strict=True)):
            assert torch.equal(a, b), (i, (a.float() - b.float()).abs().max().item())
    for run in persistent[1:]:                       # every replay the same
        assert all(torch.equal(a, b) for a, b in zip(run, persistent[0], strict=True))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs the GPU")
def test_gpu_model_logits_persistent_vs_per_gemm(monkeypatch):
    """Qwen3-0.6B shape (4 layers, dummy bf16): 1- and 2-token decode logits with the
    persistent path vs the per-GEMM fused path: bitwise equal at one row (the same tiles),
    and within bf16 noise with the same greedy token at two."""
    _needs_hopper()
    from test_skinny_fused import _decode_logits, _qwen3_0_6b
    model, config = _qwen3_0_6b(4)
    for ids in ([3], [3, 9]):
        monkeypatch.setattr(persistent_layer, "ENABLED", False)
        off = _decode_logits(model, config, ids, 4, True, monkeypatch).float()
        monkeypatch.setattr(persistent_layer, "ENABLED", True)
        on = _decode_logits(model, config, ids, 4, True, monkeypatch).float()
        rel = ((on - off).pow(2).mean().sqrt() / off.pow(2).mean().sqrt()).item()
        print(f"M={len(ids)}: bitwise {torch.equal(on, off)}, relative RMS diff {rel:.2e}")
        assert rel < 2e-2 and torch.equal(on.argmax(-1), off.argmax(-1))
        if len(ids) == 1:
            assert torch.equal(on, off)
