"""Serve's attention precompile: the listed launch variants are every one the picker can
choose, and the precompile launches each once without touching the cache."""

from __future__ import annotations

import random

import pytest
import torch

import mrv2  # noqa: F401  (turns on the interpreter without CUDA)
from mrv2.kernels import attention
from mrv2.kernels.attention_warmup import launch_variants, precompile
from mrv2.platform import DEVICE


@pytest.mark.parametrize("dims", [(16, 8, 128, 256, 2048), (4, 2, 64, 24, 700),
                                  (32, 8, 128, 64, 4096)])
def test_launch_variants_cover_every_choice_of_the_gpu_picker(monkeypatch, dims):
    """The GPU picker (table + heuristic, 132 SMs) at random shapes: every choice is listed.
    The Qwen3-0.6B shape with max_model_len 2048 has about 20 (job U compiled them one by
    one inside serving steps)."""
    monkeypatch.setattr(attention, "TRITON_INTERPRET", False)
    monkeypatch.setattr(attention, "_num_sms", lambda: 132)
    num_heads, num_kv_heads, head_dim, max_reqs, max_len = dims
    variants = launch_variants(num_heads, num_kv_heads, head_dim, max_reqs, max_len)
    keys = [tuple(sorted(v.items())) for v in variants]
    assert len(keys) == len(set(keys)) and 2 <= len(keys) <= 64
    group_pad = 1 << (num_heads // num_kv_heads - 1).bit_length()
    rng = random.Random(sum(dims))
    for _ in range(4000):
        q_len = rng.choice([1, 1, 1, rng.randint(2, 16), rng.randint(17, 600)])
        ctx = rng.randint(q_len, max_len)
        cfg = attention._pick_config(rng.randint(1, max_reqs), num_kv_heads, group_pad,
                                     q_len, ctx, max(16, head_dim))
        assert tuple(sorted(cfg.items())) in keys, (q_len, ctx, cfg)
    if dims[:3] == (16, 8, 128):
        assert 10 <= len(keys) <= 40


def test_precompile_launches_each_variant_once_and_writes_nothing(monkeypatch):
    """The dummy problem goes through paged_attention with each variant's config; the
    cache is only read."""
    g = torch.Generator().manual_seed(0)
    kv_cache = torch.randn(2, 3, 16, 2, 32, generator=g).to(DEVICE)  # [2, blocks, page, Hkv, D]
    before = kv_cache.clone()
    variants = launch_variants(4, 2, 32, max_num_reqs=3, max_model_len=48)
    seen = []
    real = attention.paged_attention

    def spy(q, cache, md, scale, out=None, **kw):
        seen.append(kw["config"])
        assert cache is kv_cache and md.block_table.shape == (1, 3) and q.shape == (1, 4, 32)
        return real(q, cache, md, scale, out=out, **kw)

    monkeypatch.setattr(attention, "paged_attention", spy)
    assert precompile(kv_cache, 4, 3, variants) == len(variants) == len(seen)
    assert seen == variants
    assert torch.equal(kv_cache, before)


def test_precompile_decode_rope_launches_each_decode_variant_and_writes_nothing(monkeypatch):
    """With the fused decode RoPE + attention kernel on, serve's warm-up also compiles its
    decode launches: one per ``launch_variants(..., max_query_len=1)`` entry, cache untouched."""
    from mrv2.kernels import decode_attention
    from mrv2.kernels.attention_warmup import precompile_decode_rope
    from mrv2.kernels.rotary import build_cos_sin_cache

    g = torch.Generator().manual_seed(1)
    kv_cache = torch.randn(2, 3, 16, 2, 32, generator=g).to(DEVICE)  # [2, blocks, page, Hkv, D]
    before = kv_cache.clone()
    variants = launch_variants(4, 2, 32, max_num_reqs=3, max_model_len=48, max_query_len=1)
    seen = []
    real = decode_attention.decode_rope_attention

    def spy(qkv, positions, cos_sin, qw, kw, eps, cache, md, scale, h, hkv, **kw_):
        seen.append(kw_["config"])
        assert cache is kv_cache and qkv.shape == (1, (4 + 2 * 2) * 32) and (h, hkv) == (4, 2)
        return real(qkv, positions, cos_sin, qw, kw, eps, cache, md, scale, h, hkv, **kw_)

    monkeypatch.setattr(decode_attention, "decode_rope_attention", spy)
    cos_sin = build_cos_sin_cache(32, 48, 10000.0).to(DEVICE)
    assert precompile_decode_rope(kv_cache, 4, 3, variants, cos_sin, torch.ones(32, device=DEVICE)) \
        == len(variants) == len(seen)
    assert seen == variants and torch.equal(kv_cache, before)


def test_runner_precompile_covers_the_fused_decode_kernel_when_on(monkeypatch):
    from mrv2 import LLM
    from mrv2.kernels import attention_warmup, decode_attention

    llm = LLM(max_model_len=64, max_num_seqs=2, dtype="float32", enforce_eager=True)
    calls = []
    monkeypatch.setattr(attention_warmup, "precompile",
                        lambda *a, **k: calls.append("paged") or 5)
    monkeypatch.setattr(attention_warmup, "precompile_decode_rope",
                        lambda *a, **k: calls.append("rope") or 2)
    monkeypatch.setattr(decode_attention, "ENABLED", False)   # NOTE: on a GPU it is on
    assert llm.runner.precompile_attention() == 5 and calls == ["paged"]
    monkeypatch.setattr(decode_attention, "ENABLED", True)
    assert llm.runner.precompile_attention() == 7 and calls == ["paged", "paged", "rope"]


def test_runner_precompiles_fused_decode_launches_only_up_to_its_token_cap(monkeypatch):
    """The fused decode kernel runs for decode steps of at most MAX_TOKENS tokens (one per
    request), so the warm-up walks the decode picker only up to that many requests."""
    from mrv2 import LLM
    from mrv2.kernels import attention_warmup, decode_attention

    llm = LLM(max_model_len=1024, max_num_seqs=64, dtype="float32", enforce_eager=True)
    monkeypatch.setattr(attention, "TRITON_INTERPRET", False)   # the GPU picker (132 SMs):
    monkeypatch.setattr(attention, "_num_sms", lambda: 132)             # its choice varies with batch
    seen = {}
    monkeypatch.setattr(attention_warmup, "precompile", lambda *a, **k: 0)
    monkeypatch.setattr(attention_warmup, "precompile_decode_rope",
                        lambda cache, h, width, variants, *a: seen.setdefault("v", variants)
                        and len(variants))
    monkeypatch.setattr(decode_attention, "ENABLED", True)
    monkeypatch.setattr(decode_attention, "MAX_TOKENS", 2)
    n = llm.runner.precompile_attention()
    dims = llm.runner.dims
    want = launch_variants(dims.num_heads, dims.num_kv_heads, dims.head_dim, 2, 1024,
                           max_query_len=1, pick=decode_attention.pick_config)
    assert seen["v"] == want and n == len(want)
    assert len(want) < len(launch_variants(dims.num_heads, dims.num_kv_heads, dims.head_dim,
                                           64, 1024, max_query_len=1,
                                           pick=decode_attention.pick_config))  # the cap matters
    # one request takes its own launch, and the walk has it (1024 keys: 16 tiles of 64)
    one = dict(decode_attention.ONE_REQUEST_LAUNCH, num_splits=16)
    assert any(v["num_splits"] == 16 and v["block_n"] == 64 for v in want), (one, want)
    assert decode_attention.pick_config(1, dims.num_kv_heads, 2, 1, 1024)["num_splits"] == 16
    assert decode_attention.pick_config(1, dims.num_kv_heads, 2, 1, 60)["num_splits"] == 1


def test_runner_precompiles_the_ordered_decode_launches_of_large_batches(monkeypatch):
    """Decode steps of >= ORDER_MIN_REQS requests launch with a request order (its own
    compiled variant): the warm-up walks those batch sizes once more, with the order."""
    from mrv2 import LLM
    from mrv2.kernels import attention_warmup, decode_attention

    llm = LLM(max_model_len=attention.ORDER_MIN_SEQ_LEN, max_num_seqs=attention.ORDER_MIN_REQS,
              dtype="float32", enforce_eager=True)
    calls = []
    monkeypatch.setattr(attention_warmup, "precompile",
                        lambda *a, **k: calls.append((k.get("ordered", False), a[3])) or 1)
    monkeypatch.setattr(decode_attention, "ENABLED", False)
    monkeypatch.setattr(attention, "ORDER_ENABLED", True)
    assert llm.runner.precompile_attention() == 2
    dims = llm.runner.dims
    assert [o for o, _ in calls] == [False, True]
    assert calls[1][1] == launch_variants(dims.num_heads, dims.num_kv_heads, dims.head_dim,
                                          attention.ORDER_MIN_REQS, attention.ORDER_MIN_SEQ_LEN,
                                          max_query_len=1,
                                          min_num_reqs=attention.ORDER_MIN_REQS)
    calls.clear()
    monkeypatch.setattr(attention, "ORDER_ENABLED", False)
    assert llm.runner.precompile_attention() == 1 and [o for o, _ in calls] == [False]


def test_precompile_launches_the_ordered_variant(monkeypatch):
    seen = []
    real = attention.paged_attention

    def spy(q, kv_cache, md, scale, out=None, **kw):
        seen.append(None if md.req_order is None else md.req_order.tolist())
        return real(q, kv_cache, md, scale, out, **kw)

    monkeypatch.setattr(attention, "paged_attention", spy)
    kv_cache = torch.zeros(2, 4, 16, 2, 32, device=DEVICE)
    variants = launch_variants(4, 2, 32, 2, 64, max_query_len=1)[:1]
    assert precompile(kv_cache, 4, 3, variants, ordered=True) == 1
    assert seen == [[0]]


def test_runner_precompiles_decode_heads_when_on(monkeypatch):
    """With MRV2_DECODE_HEADS on and batches reaching its request floor, the warm-up launches
    its kernel too (plain; with the order as well where large batches take one)."""
    from mrv2 import LLM
    from mrv2.kernels import attention_warmup, decode_attention, decode_heads

    llm = LLM(max_model_len=64, max_num_seqs=4, dtype="float32", enforce_eager=True)
    monkeypatch.setattr(attention_warmup, "precompile", lambda *a, **k: 5)
    monkeypatch.setattr(decode_attention, "ENABLED", False)
    monkeypatch.setattr(decode_heads, "MIN_REQS", 4)
    launched = []
    real = decode_heads.decode_heads_attention
    monkeypatch.setattr(decode_heads, "decode_heads_attention",
                        lambda q, kv, md, *a, **k: launched.append(md.req_order is None)
                        or real(q, kv, md, *a, **k))
    monkeypatch.setattr(decode_heads, "ENABLED", False)
    assert llm.runner.precompile_attention() == 5 and not launched
    monkeypatch.setattr(decode_heads, "ENABLED", True)
    assert llm.runner.precompile_attention() == 6 and launched == [True]
    monkeypatch.setattr(attention, "may_order", lambda n, s: True)
    # the ordered paged variants (5 more), then decode_heads plain and ordered
    assert llm.runner.precompile_attention() == 5 + 5 + 2 and launched[1:] == [True, False]
    monkeypatch.setattr(decode_heads, "MIN_REQS", 5)                # beyond max_num_seqs
    launched.clear()
    llm.runner.precompile_attention()
    assert not launched
