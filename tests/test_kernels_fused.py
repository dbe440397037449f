"""The fused model kernels (RMSNorm, add + RMSNorm, q/k-norm + RoPE, SiLU * up) against
their torch references: random inputs, odd sizes, empty and one-token batches, views."""

import pytest
import torch
import transformers

from mrv2.forward_context import AttentionMetadata, set_forward_context
from mrv2.kernels import activation, layernorm, rotary
from mrv2.kernels.activation import silu_and_mul, silu_and_mul_ref
from mrv2.kernels.layernorm import (
    fused_add_rms_norm,
    fused_add_rms_norm_ref,
    rms_norm,
    rms_norm_ref,
)
from mrv2.kernels.rotary import build_cos_sin_cache, qk_norm_rope, qk_norm_rope_ref, rope_ref
from mrv2.models import qwen3
from mrv2.platform import DEVICE

TOL = {"rtol": 1e-5, "atol": 1e-5}
BF16 = {"rtol": 1.6e-2, "atol": 1e-2}


def _randn(*shape, seed=0, dtype=torch.float32, device=DEVICE, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(device, dtype)


def _cos_sin_cache(head_dim, max_position, theta=10000.0, device=DEVICE):
    return build_cos_sin_cache(head_dim, max_position, theta, device=device)       # [P, D]


class _NoLaunch:
    """Stands in for a kernel: any launch fails the test."""

    def __getitem__(self, grid):
        raise AssertionError("an empty batch must not launch a kernel")


# ---------------------------------------------------------------- RMSNorm, add + RMSNorm

@pytest.mark.parametrize("num_tokens,hidden", [(1, 48), (7, 48), (33, 256), (5, 100),
                                                (3, 1024), (70, 64), (40, 1024)])
def test_rms_norm_matches_reference(num_tokens, hidden):
    x = _randn(num_tokens, hidden, scale=3.0)
    w = _randn(hidden, seed=1)
    torch.testing.assert_close(rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6), **TOL)


@pytest.mark.parametrize("num_tokens,hidden", [(1, 48), (7, 48), (33, 256), (5, 100), (70, 64)])
def test_fused_add_rms_norm_matches_reference(num_tokens, hidden):
    x, r = _randn(num_tokens, hidden), _randn(num_tokens, hidden, seed=1)
    w = _randn(hidden, seed=2)
    x0, r0 = x.clone(), r.clone()
    out, res = fused_add_rms_norm(x, r, w, 1e-5)
    ref_out, ref_res = fused_add_rms_norm_ref(x, r, w, 1e-5)
    torch.testing.assert_close(res, ref_res, rtol=0, atol=0)   # one fp32 add, same rounding
    torch.testing.assert_close(out, ref_out, **TOL)
    assert torch.equal(x, x0) and torch.equal(r, r0)          # inputs are left alone


def test_rms_norm_reference_semantics():
    # The spec: each row divided by its root mean square, times the weight.
    x, w = _randn(4, 48), _randn(48, seed=1)
    rms = x.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()
    torch.testing.assert_close(rms_norm_ref(x, w, 1e-6), x / rms * w, **TOL)
    out, res = fused_add_rms_norm_ref(x, x, w, 1e-6)
    torch.testing.assert_close(res, 2 * x, rtol=0, atol=0)
    torch.testing.assert_close(out, rms_norm_ref(2 * x, w, 1e-6), **TOL)


def test_norm_of_strided_views():
    # x and residual as column slices of wider tensors (copied to contiguous rows first).
    big, big_r = _randn(9, 80), _randn(9, 80, seed=1)
    x, r, w = big[:, 16:64], big_r[:, 8:56], _randn(48, seed=2)
    torch.testing.assert_close(rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6), **TOL)
    out, res = fused_add_rms_norm(x, r, w, 1e-6)
    ref_out, ref_res = fused_add_rms_norm_ref(x, r, w, 1e-6)
    torch.testing.assert_close(res, ref_res, rtol=0, atol=0)
    torch.testing.assert_close(out, ref_out, **TOL)


def test_norm_zero_rows_and_empty_batch(monkeypatch):
    w = _randn(48)
    torch.testing.assert_close(rms_norm(torch.zeros(2, 48, device=DEVICE), w, 1e-6),
                               torch.zeros(2, 48, device=DEVICE), rtol=0, atol=0)
    monkeypatch.setattr(layernorm, "_rms_norm_kernel", _NoLaunch())
    x = torch.empty(0, 48, device=DEVICE)
    assert rms_norm(x, w, 1e-6).shape == (0, 48)
    out, res = fused_add_rms_norm(x, x, w, 1e-6)
    assert out.shape == res.shape == (0, 48)


def test_norm_bad_shapes_raise():
    x, w = _randn(3, 48), _randn(48)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, w[:40], 1e-6)
    with pytest.raises(ValueError, match="residual"):
        fused_add_rms_norm(x, x[:2], w, 1e-6)


# --------------------------------------------------------------- q/k-norm + RoPE

@pytest.mark.parametrize("num_tokens,num_q_heads,num_kv_heads,head_dim", [
    (1, 4, 2, 64),
    (7, 14, 2, 16),    # 14 q heads: not a power of two
    (33, 4, 2, 64),
    (5, 8, 4, 8),      # stories260K's heads
    (3, 16, 8, 128),   # Qwen3-0.6B's heads
    (37, 16, 8, 128),  # several programs under the interpreter, the last one partial
    (4, 3, 1, 12),     # half a head (6) is not a power of two either
])
@pytest.mark.parametrize("use_norm", [True, False])
def test_qk_norm_rope_matches_reference(num_tokens, num_q_heads, num_kv_heads, head_dim,
                                        use_norm):
    max_position = 50
    cache = _cos_sin_cache(head_dim, max_position)
    q = _randn(num_tokens, num_q_heads, head_dim, scale=2.0)
    k = _randn(num_tokens, num_kv_heads, head_dim, seed=1)
    g = torch.Generator().manual_seed(2)
    positions = torch.randint(0, max_position, (num_tokens,), generator=g)
    positions[0] = max_position - 1              # both ends of the cache
    positions[-1] = 0
    positions = positions.to(DEVICE)
    w = (_randn(head_dim, seed=3), _randn(head_dim, seed=4)) if use_norm else (None, None)
    q_out, k_out = qk_norm_rope(q, k, positions, cache, *w, eps=1e-6)
    q_ref, k_ref = qk_norm_rope_ref(q, k, positions, cache, *w, eps=1e-6)
    assert q_out.shape == q.shape and k_out.shape == k.shape
    torch.testing.assert_close(q_out, q_ref, **TOL)
    torch.testing.assert_close(k_out, k_ref, **TOL)


@pytest.mark.parametrize("num_tokens,num_q_heads,num_kv_heads,head_dim,block_size", [
    (1, 4, 2, 64, 16),     # one token
    (9, 14, 2, 16, 4),     # 14 q heads; tokens cross block boundaries
    (37, 16, 8, 128, 16),  # Qwen3-0.6B's heads, several programs under the interpreter
    (4, 3, 1, 12, 2),      # half a head (6) not a power of two
])
@pytest.mark.parametrize("use_norm,gpu_tiles", [(True, False), (False, False), (True, True)])
def test_qk_norm_rope_writes_kv_cache_as_rope_then_write_kv(num_tokens, num_q_heads,
                                                             num_kv_heads, head_dim,
                                                             block_size, use_norm, gpu_tiles,
                                                             monkeypatch):
    """With kv_cache: q as before, and the cache exactly as qk_norm_rope_ref followed by
    write_kv_cache_ref (padding slots -1 untouched, the rest of the cache untouched);
    ``gpu_tiles``: the GPU's launch (one token per program) run by the interpreter."""
    from mrv2.kernels.kv_cache import write_kv_cache_ref

    if gpu_tiles:
        monkeypatch.setattr(rotary, "TRITON_INTERPRET", False)

    max_position, num_blocks = 64, 24
    cache = _cos_sin_cache(head_dim, max_position)
    qkv = _randn(num_tokens, (num_q_heads + 2 * num_kv_heads) * head_dim)  # views, as the model
    q = qkv[:, :num_q_heads * head_dim].view(num_tokens, num_q_heads, head_dim)
    k = qkv[:, num_q_heads * head_dim:(num_q_heads + num_kv_heads) * head_dim].view(
        num_tokens, num_kv_heads, head_dim)
    v = qkv[:, (num_q_heads + num_kv_heads) * head_dim:].view(num_tokens, num_kv_heads, head_dim)
    g = torch.Generator().manual_seed(5)
    positions = torch.randint(0, max_position, (num_tokens,), generator=g).to(DEVICE)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    if num_tokens > 2:
        slots[1] = -1                                # a padding token
    slots = slots.to(DEVICE)
    w = (_randn(head_dim, seed=3), _randn(head_dim, seed=4)) if use_norm else (None, None)
    kv = _randn(2, num_blocks, block_size, num_kv_heads, head_dim, seed=9)  # stale contents
    want = kv.clone()
    q_ref, k_ref = qk_norm_rope_ref(q, k, positions, cache, *w, eps=1e-6)
    write_kv_cache_ref(k_ref, v, want, slots)
    q_out, none = qk_norm_rope(q, k, positions, cache, *w, eps=1e-6, v=v, kv_cache=kv,
                               slot_mapping=slots)
    assert none is None
    torch.testing.assert_close(q_out, q_ref, **TOL)
    torch.testing.assert_close(kv, want, **TOL)


def test_qk_norm_rope_kv_cache_errors_and_empty_batch(monkeypatch):
    q, k, v = _randn(3, 4, 16), _randn(3, 2, 16, seed=1), _randn(3, 2, 16, seed=2)
    cache, positions = _cos_sin_cache(16, 8), torch.arange(3, device=DEVICE)
    kv = torch.zeros(2, 4, 4, 2, 16, device=DEVICE)
    slots = torch.arange(3, device=DEVICE)
    with pytest.raises(ValueError, match="needs v and slot_mapping"):
        qk_norm_rope(q, k, positions, cache, kv_cache=kv, slot_mapping=slots)
    with pytest.raises(ValueError, match="slot_mapping must have shape"):
        qk_norm_rope(q, k, positions, cache, v=v, kv_cache=kv, slot_mapping=slots[:2])
    with pytest.raises(ValueError, match="kv_cache must have shape"):
        qk_norm_rope(q, k, positions, cache, v=v, kv_cache=kv[0], slot_mapping=slots)
    with pytest.raises(ValueError, match="contiguous"):
        qk_norm_rope(q, k, positions, cache, v=v, kv_cache=kv.transpose(1, 2),
                     slot_mapping=slots)
    monkeypatch.setattr(rotary, "_qk_norm_rope_kernel", _NoLaunch())
    q_out, none = qk_norm_rope(q[:0], k[:0], positions[:0], cache, v=v[:0], kv_cache=kv,
                               slot_mapping=slots[:0])
    assert q_out.shape == (0, 4, 16) and none is None and not kv.any()


def test_qk_norm_rope_of_views_into_fused_qkv():
    # q and k as views of one [T, (H_q + 2 H_kv) * D] projection (token stride != H * D),
    # and a q whose dims are strided (copied first).
    num_tokens, h_q, h_kv, d = 6, 4, 2, 16
    qkv = _randn(num_tokens, (h_q + 2 * h_kv) * d)
    q = qkv[:, :h_q * d].view(num_tokens, h_q, d)
    k = qkv[:, h_q * d:(h_q + h_kv) * d].view(num_tokens, h_kv, d)
    cache, positions = _cos_sin_cache(d, 20), torch.arange(3, 9, device=DEVICE)
    w = (_randn(d, seed=1), _randn(d, seed=2))
    for qq in (q, _randn(num_tokens, h_q, 2 * d, seed=3)[:, :, ::2]):
        got = qk_norm_rope(qq, k, positions, cache, *w)
        ref = qk_norm_rope_ref(qq.contiguous(), k.contiguous(), positions, cache, *w)
        torch.testing.assert_close(got[0], ref[0], **TOL)
        torch.testing.assert_close(got[1], ref[1], **TOL)


def test_rope_reference_semantics():
    # Position 0 rotates by nothing; a rotation keeps each half-pair's length; and q.k
    # after RoPE depends on the positions only through their difference.
    d, cache = 16, _cos_sin_cache(16, 64)
    torch.testing.assert_close(cache[0], torch.tensor([1.0] * 8 + [0.0] * 8, device=DEVICE))
    torch.testing.assert_close(cache[5, 0], torch.tensor(5.0).cos().to(DEVICE))  # pair 0: 1 rad
    x = _randn(1, 2, d)
    torch.testing.assert_close(rope_ref(x, torch.tensor([0], device=DEVICE), cache), x,
                               rtol=0, atol=0)
    y = rope_ref(x, torch.tensor([37], device=DEVICE), cache)
    def pair_len(t):
        return t[..., :d // 2] ** 2 + t[..., d // 2:] ** 2

    torch.testing.assert_close(pair_len(y), pair_len(x), **TOL)
    q, k = _randn(1, 1, d, seed=1), _randn(1, 1, d, seed=2)

    def score(m, n):
        pm, pn = torch.tensor([m], device=DEVICE), torch.tensor([n], device=DEVICE)
        return (rope_ref(q, pm, cache) * rope_ref(k, pn, cache)).sum()

    torch.testing.assert_close(score(10, 3), score(50, 43), **TOL)


def test_qk_norm_rope_empty_batch_and_errors(monkeypatch):
    cache = _cos_sin_cache(16, 8)
    q, k = _randn(2, 4, 16), _randn(2, 2, 16)
    positions = torch.tensor([0, 1], device=DEVICE)
    with pytest.raises(ValueError, match="even"):
        qk_norm_rope(q[..., :15], k[..., :15], positions, cache[:, :15])
    with pytest.raises(ValueError, match="both"):
        qk_norm_rope(q, k, positions, cache, q_weight=_randn(16))
    with pytest.raises(ValueError, match="positions"):
        qk_norm_rope(q, k, positions[:1], cache)
    monkeypatch.setattr(rotary, "_qk_norm_rope_kernel", _NoLaunch())
    q_out, k_out = qk_norm_rope(q[:0], k[:0], positions[:0], cache)
    assert q_out.shape == (0, 4, 16) and k_out.shape == (0, 2, 16)


# --------------------------------------------------------------- SiLU(gate) * up

@pytest.mark.parametrize("num_tokens,width", [(1, 48), (7, 172), (33, 768), (20, 3000)])
def test_silu_and_mul_matches_reference(num_tokens, width):
    gate, up = _randn(num_tokens, width, scale=4.0), _randn(num_tokens, width, seed=1)
    torch.testing.assert_close(silu_and_mul(gate, up), silu_and_mul_ref(gate, up), **TOL)


def test_silu_and_mul_of_views_and_empty_batch(monkeypatch):
    gate_up = _randn(5, 2 * 96, scale=4.0)        # a fused [T, 2 I] projection, split
    gate, up = gate_up[:, :96], gate_up[:, 96:]
    torch.testing.assert_close(silu_and_mul(gate, up), silu_and_mul_ref(gate, up), **TOL)
    with pytest.raises(ValueError, match="same"):
        silu_and_mul(gate, up[:, :95])
    monkeypatch.setattr(activation, "_silu_and_mul_kernel", _NoLaunch())
    assert silu_and_mul(gate[:0], up[:0]).shape == (0, 96)


def test_gpu_launch_configs(monkeypatch):
    """The GPU's grids (one row / token per program, 1024-wide SiLU column blocks), run by
    the interpreter: the wrappers pick them when TRITON_INTERPRET is off."""
    for module in (layernorm, rotary, activation):
        monkeypatch.setattr(module, "TRITON_INTERPRET", False)
    x, r, w = _randn(3, 48), _randn(3, 48, seed=1), _randn(48, seed=2)
    torch.testing.assert_close(rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6), **TOL)
    for got, ref in zip(fused_add_rms_norm(x, r, w, 1e-6), fused_add_rms_norm_ref(x, r, w, 1e-6)):
        torch.testing.assert_close(got, ref, **TOL)
    cache, positions = _cos_sin_cache(16, 32), torch.tensor([31, 0, 7], device=DEVICE)
    q, k, qw, kw = _randn(3, 6, 16), _randn(3, 2, 16, seed=1), _randn(16), _randn(16, seed=1)
    for got, ref in zip(qk_norm_rope(q, k, positions, cache, qw, kw),
                        qk_norm_rope_ref(q, k, positions, cache, qw, kw)):
        torch.testing.assert_close(got, ref, **TOL)
    gate, up = _randn(2, 1100, scale=4.0), _randn(2, 1100, seed=1)   # 2 column blocks
    torch.testing.assert_close(silu_and_mul(gate, up), silu_and_mul_ref(gate, up), **TOL)


# --------------------------------------------------------------- in the model

def _forward(model, config, fused, monkeypatch):
    """One mixed step: a 5-token prefill at positions 0..4 and a 4-token chunk at 60..63."""
    monkeypatch.setattr(qwen3, "FUSED_KERNELS", fused)
    with torch.device(DEVICE):
        qwen3.bind_kv_cache(model, [torch.zeros(qwen3.kv_cache_shape(config, 8, 16))
                                    for _ in range(config.num_hidden_layers)])
        md = AttentionMetadata(torch.tensor([0, 5, 9], dtype=torch.int32),
                               torch.tensor([5, 64], dtype=torch.int32),
                               torch.tensor([[0, 5, 6, 7], [1, 2, 3, 4]], dtype=torch.int32),
                               torch.tensor([0, 1, 2, 3, 4, 76, 77, 78, 79]), 5, 64)
        ids = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6, 5])
        positions = torch.tensor([0, 1, 2, 3, 4, 60, 61, 62, 63])
        with set_forward_context(md), torch.no_grad():
            return model.compute_logits(model(ids, positions))                # [9, vocab]


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_model_with_fused_kernels_equals_torch_path(kind, monkeypatch):
    """The model through the kernels equals it through their torch references (the
    path test_qwen3_model.py checks against Hugging Face on the CPU)."""
    cls = {"qwen3": transformers.Qwen3Config, "llama": transformers.LlamaConfig}[kind]
    config = cls(vocab_size=300, hidden_size=48, intermediate_size=72, num_hidden_layers=2,
                 num_attention_heads=6, num_key_value_heads=2, head_dim=16,
                 max_position_embeddings=64, attention_bias=kind == "llama")
    model = qwen3.Qwen3ForCausalLM(config).to(DEVICE).eval()
    assert model.use_qk_norm == (kind == "qwen3")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # random norm weights and biases too, so that all of them matter
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    fused = _forward(model, config, True, monkeypatch)
    torch.testing.assert_close(fused, _forward(model, config, False, monkeypatch), **TOL)


# --------------------------------------------------------------- bf16 (GPU only)

@pytest.mark.gpu
def test_fused_kernels_bf16_cuda():
    """bf16 in, bf16 out, fp32 math (the interpreter computes bf16 wrongly: GPU only)."""
    kw = {"dtype": torch.bfloat16, "device": "cuda"}
    x, r, w = _randn(300, 1024, **kw), _randn(300, 1024, seed=1, **kw), _randn(1024, seed=2, **kw)
    torch.testing.assert_close(rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6), **BF16)
    out, res = fused_add_rms_norm(x, r, w, 1e-6)
    ref_out, ref_res = fused_add_rms_norm_ref(x, r, w, 1e-6)
    torch.testing.assert_close(res, ref_res, rtol=0, atol=0)
    torch.testing.assert_close(out, ref_out, **BF16)
    cache = _cos_sin_cache(128, 4096, 1e6, device="cuda")
    q, k = _randn(300, 16, 128, **kw), _randn(300, 8, 128, seed=1, **kw)
    positions = torch.randint(0, 4096, (300,), device="cuda")
    qw, kw_ = _randn(128, seed=3, **kw), _randn(128, seed=4, **kw)
    for got, ref in zip(qk_norm_rope(q, k, positions, cache, qw, kw_),
                        qk_norm_rope_ref(q, k, positions, cache, qw, kw_)):
        torch.testing.assert_close(got, ref, **BF16)
    gate, up = _randn(300, 3072, scale=4.0, **kw), _randn(300, 3072, seed=1, **kw)
    torch.testing.assert_close(silu_and_mul(gate, up), silu_and_mul_ref(gate, up), **BF16)
