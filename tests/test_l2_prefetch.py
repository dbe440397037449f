"""The fused decode GEMMs' L2 prefetch of the next kernel's weight (mrv2/kernels/l2_prefetch.py).

CPU: the chunk plan covers every byte once, the switch and the argument gate, and the model
hands each GEMM the weight of the one after it. GPU (Hopper): the chain and the model's
decode logits are bitwise the same with the prefetch on and off (it is only a hint).
"""

from __future__ import annotations

import pytest
import torch

import mrv2  # noqa: F401  (turns on the interpreter without CUDA)
from mrv2.kernels import l2_prefetch, pdl, skinny_fused, small_m_fused
from mrv2.models import qwen3
from mrv2.models.loader import DEFAULT_MODEL_DIR, load_model
from mrv2.platform import DEVICE, HAS_CUDA, TRITON_INTERPRET


@pytest.mark.parametrize("nbytes,programs,threads", [
    (0, 1, 32), (16, 1, 32), (4096 * 1024 * 2, 1024, 128), (1024 * 2048 * 2, 1024, 128),
    (6144 * 1024 * 2, 768, 128), (100_000, 3, 64), (255, 1, 32), (257, 1, 1),
    (1 << 20, 4096, 128)])
def test_chunks_cover_every_byte_once(nbytes, programs, threads):
    chunk = l2_prefetch.plan(nbytes, programs, threads)
    assert chunk >= l2_prefetch.MIN_CHUNK and chunk & (chunk - 1) == 0      # a power of two
    assert programs * threads * chunk >= nbytes
    chunks = l2_prefetch.chunks_ref(nbytes, programs, threads)
    covered = 0
    for off, size in chunks:        # in order, back to back, 16-byte sizes and offsets
        assert off == covered and size % 16 == 0 and off % 16 == 0 and 0 < size <= chunk
        covered += size
    assert covered == nbytes // 16 * 16          # all but the last < 16 bytes of the tensor
    assert len(chunks) <= programs * threads     # at most one prefetch a thread


def test_plan_rejects_bad_sizes():
    for bad in ((-1, 1, 32), (16, 0, 32), (16, 1, 0)):
        with pytest.raises(ValueError, match="plan needs"):
            l2_prefetch.plan(*bad)


def test_switch_rejects_typos(monkeypatch):
    from mrv2.platform import env_switch
    monkeypatch.setenv("MRV2_L2_PREFETCH", "yes")
    with pytest.raises(ValueError, match="MRV2_L2_PREFETCH must be 0"):
        env_switch("MRV2_L2_PREFETCH", True)
    if TRITON_INTERPRET:
        assert l2_prefetch.ENABLED is False          # no inline asm in the interpreter


def test_prefetch_args_gate(monkeypatch):
    w = torch.zeros(64, 32)
    unused = torch.zeros(1)
    monkeypatch.setattr(l2_prefetch, "ENABLED", True)
    monkeypatch.setattr(pdl, "sm90_or_newer", lambda device: True)
    on = l2_prefetch.prefetch_args(w, 8, 4, unused)
    assert on["PREFETCH"] and on["pf_ptr"] is w and on["PF_BYTES"] == 64 * 32 * 4
    assert on["PF_CHUNK"] == l2_prefetch.plan(64 * 32 * 4, 8, 128)
    for weight in (None, w.t(), w[:0]):              # nothing, not contiguous, empty
        off = l2_prefetch.prefetch_args(weight, 8, 4, unused)
        assert not off["PREFETCH"] and off["pf_ptr"] is unused and off["PF_BYTES"] == 0
    monkeypatch.setattr(pdl, "sm90_or_newer", lambda device: False)   # pre-Hopper
    assert not l2_prefetch.prefetch_args(w, 8, 4, unused)["PREFETCH"]
    monkeypatch.setattr(pdl, "sm90_or_newer", lambda device: True)
    monkeypatch.setattr(l2_prefetch, "ENABLED", False)               # MRV2_L2_PREFETCH=0
    assert not l2_prefetch.prefetch_args(w, 8, 4, unused)["PREFETCH"]


def test_sm90_or_newer_is_false_off_cuda():
    assert pdl.sm90_or_newer(torch.device("cpu")) is False


def test_model_hands_each_gemm_the_next_weight(monkeypatch):
    """The decode layers' four GEMMs each get the weight of the GEMM after them: o_proj,
    gate_up, down_proj, then the next layer's packed qkv (the last layer: none)."""
    model, config = load_model(DEFAULT_MODEL_DIR, dtype="float32")
    seen = []

    def record(op):
        def run(*args, prefetch=None, **kw):
            seen.append((args[3] if op.__name__ != "skinny_linear_add" else args[1], prefetch))
            return op(*args, **kw)
        return run
    ops = tuple(record(op) for op in small_m_fused.SKINNY_OPS)
    monkeypatch.setattr(small_m_fused, "fused_decode_ops", lambda h: ops)
    monkeypatch.setattr(qwen3, "fused_decode_ops", lambda h: ops)
    with torch.device(DEVICE), torch.no_grad():
        from mrv2.forward_context import AttentionMetadata, set_forward_context
        qwen3.bind_kv_cache(model, [torch.zeros(qwen3.kv_cache_shape(config, 1, 16))
                                    for _ in range(config.num_hidden_layers)])
        md = AttentionMetadata(torch.tensor([0, 1], dtype=torch.int32),
                               torch.tensor([1], dtype=torch.int32),
                               torch.zeros(1, 1, dtype=torch.int32), torch.tensor([0]), 1, 1)
        with set_forward_context(md):
            model(torch.tensor([3]), torch.tensor([0]))
    streamed = [w for w, _ in seen]                        # the weight each GEMM streams
    assert len(seen) == 4 * config.num_hidden_layers
    for i, (_, pf) in enumerate(seen):
        if i + 1 < len(seen):
            assert pf is streamed[i + 1], i
        else:
            assert pf is None
    layer = model.model.layers[1]
    assert streamed[4] is layer.qkv_weight() and streamed[5] is layer.self_attn.o_proj.weight


@pytest.mark.parametrize("op", ["norm", "add", "gate_up"])
def test_prefetch_argument_changes_nothing_in_the_interpreter(op, monkeypatch):
    """On the CPU the prefetch compiles out (PREFETCH=False): same result with the argument."""
    monkeypatch.setattr(skinny_fused, "ENABLED", True)
    g = torch.Generator().manual_seed(0)
    x, nw = torch.randn(1, 64, generator=g), torch.randn(64, generator=g)
    w, nxt = torch.randn(48, 64, generator=g), torch.randn(32, 64, generator=g)
    x, nw, w, nxt = (t.to(DEVICE) for t in (x, nw, w, nxt))
    if op == "norm":
        a = skinny_fused.skinny_norm_linear(x, nw, 1e-6, w)
        b = skinny_fused.skinny_norm_linear(x, nw, 1e-6, w, prefetch=nxt)
    elif op == "add":
        a = skinny_fused.skinny_linear_add(x, w, torch.ones(1, 48, device=DEVICE))
        b = skinny_fused.skinny_linear_add(x, w, torch.ones(1, 48, device=DEVICE), prefetch=nxt)
    else:
        a = skinny_fused.skinny_norm_gate_up_silu(x, nw, 1e-6, w)
        b = skinny_fused.skinny_norm_gate_up_silu(x, nw, 1e-6, w, prefetch=nxt)
    assert torch.equal(a, b)


# --------------------------------------------------------------- GPU (H200)

def _needs_hopper():
    if not HAS_CUDA or torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the bulk L2 prefetch needs an sm_90+ GPU")


def _chain(M, ops, layers=4):
    """``layers`` fused decode layers (Qwen3-0.6B shapes, bf16), each GEMM prefetching the
    next one's weight, in a CUDA graph replayed twice; returns every output."""
    kw = {"device": "cuda", "dtype": torch.bfloat16}
    g = torch.Generator(device="cuda").manual_seed(M)
    ws = [{"ln1": 1 + 0.1 * torch.randn(1024, generator=g, **kw),
           "qkv": torch.randn(4096, 1024, generator=g, **kw) * 0.05,
           "o": torch.randn(1024, 2048, generator=g, **kw) * 0.05,
           "ln2": 1 + 0.1 * torch.randn(1024, generator=g, **kw),
           "gate_up": torch.randn(6144, 1024, generator=g, **kw) * 0.05,
           "down": torch.randn(1024, 3072, generator=g, **kw) * 0.05} for _ in range(layers)]
    norm_linear, linear_add, norm_gate_up_silu = ops
    h0 = torch.randn(M, 1024, generator=g, **kw)
    h = h0.clone()

    def run():
        outs = []
        for i, w in enumerate(ws):
            nxt = ws[i + 1]["qkv"] if i + 1 < len(ws) else None
            qkv = norm_linear(h, w["ln1"], 1e-6, w["qkv"], prefetch=w["o"])
            linear_add(qkv[:, :2048].contiguous(), w["o"], h, prefetch=w["gate_up"])
            act = norm_gate_up_silu(h, w["ln2"], 1e-6, w["gate_up"], prefetch=w["down"])
            linear_add(act, w["down"], h, prefetch=nxt)
            outs += [qkv, act]
        return outs

    run()
    h.copy_(h0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = run()
    for _ in range(2):
        h.copy_(h0)
        graph.replay()
    torch.cuda.synchronize()
    return [o.clone() for o in outs] + [h.clone()]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs the GPU")
@pytest.mark.parametrize("M", [1, 2, 4, 16])
def test_gpu_chain_bitwise_with_and_without_prefetch(M, monkeypatch):
    _needs_hopper()
    ops = small_m_fused.SKINNY_OPS if M <= skinny_fused.MODEL_MAX_M else \
        small_m_fused.SMALL_M_OPS
    monkeypatch.setattr(l2_prefetch, "ENABLED", False)
    off = _chain(M, ops)
    monkeypatch.setattr(l2_prefetch, "ENABLED", True)
    on = _chain(M, ops)
    for i, (a, b) in enumerate(zip(off, on, strict=True)):
        assert torch.equal(a, b), (i, (a.float() - b.float()).abs().max().item())


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs the GPU")
def test_gpu_model_decode_logits_bitwise_with_prefetch(monkeypatch):
    """Qwen3-0.6B shape (4 layers, dummy bf16): 1- and 2-token decode logits, prefetch on
    vs off: bitwise equal."""
    _needs_hopper()
    from test_skinny_fused import _decode_logits, _qwen3_0_6b
    model, config = _qwen3_0_6b(4)
    for ids in ([3], [3, 9]):
        monkeypatch.setattr(l2_prefetch, "ENABLED", False)
        off = _decode_logits(model, config, ids, 4, True, monkeypatch)
        monkeypatch.setattr(l2_prefetch, "ENABLED", True)
        on = _decode_logits(model, config, ids, 4, True, monkeypatch)
        assert torch.equal(on, off), (on.float() - off.float()).abs().max().item()
