"""write_kv_cache (Triton) against its torch reference."""

import pytest
import torch

from mrv2.kernels.kv_cache import write_kv_cache, write_kv_cache_ref
from mrv2.platform import DEVICE


def _case(num_tokens, num_blocks, block_size, num_kv_heads, head_dim, pad=0, seed=0,
          dtype=torch.float32, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g).to(device, dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g).to(device, dtype)
    # Distinct random slots anywhere in the cache; the last `pad` tokens are padding.
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[num_tokens - pad:] = -1
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim,
                        generator=g).to(device, dtype)
    return key, value, cache, slots.to(device)


@pytest.mark.parametrize("num_tokens,block_size,num_kv_heads,head_dim,pad", [
    (1, 16, 1, 8, 0),
    (37, 16, 2, 8, 5),
    (70, 4, 4, 64, 3),
    (16, 32, 8, 16, 16),   # every token is padding
    (5, 1, 3, 12, 1),      # odd heads and head_dim
])
def test_matches_reference(num_tokens, block_size, num_kv_heads, head_dim, pad):
    key, value, cache, slots = _case(num_tokens, 24, block_size, num_kv_heads, head_dim, pad)
    expected = cache.clone()
    write_kv_cache_ref(key, value, expected, slots)
    write_kv_cache(key, value, cache, slots)
    torch.testing.assert_close(cache, expected, rtol=0, atol=0)


def test_reference_semantics():
    # The spec, spelled out: slot s -> block s // block_size, offset s % block_size.
    key, value, cache, slots = _case(6, 4, 4, 2, 8, pad=2)
    before = cache.clone()
    write_kv_cache_ref(key, value, cache, slots)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(cache[0, s // 4, s % 4], key[t])
            assert torch.equal(cache[1, s // 4, s % 4], value[t])
    untouched = torch.ones(4 * 4, dtype=torch.bool, device=slots.device)
    untouched[slots[slots >= 0]] = False
    assert torch.equal(cache.reshape(2, 16, 2, 8)[:, untouched],
                       before.reshape(2, 16, 2, 8)[:, untouched])


def test_empty_batch():
    key, value, cache, slots = _case(0, 4, 16, 2, 8)
    before = cache.clone()
    write_kv_cache(key, value, cache, slots)
    assert torch.equal(cache, before)


def test_strided_views_of_fused_qkv():
    # key/value as views into one [T, q + k + v] projection, as the model produces them.
    num_tokens, h_q, h_kv, d = 9, 4, 2, 16
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(num_tokens, (h_q + 2 * h_kv) * d, generator=g).to(DEVICE)
    key = qkv[:, h_q * d:(h_q + h_kv) * d].view(num_tokens, h_kv, d)
    value = qkv[:, (h_q + h_kv) * d:].view(num_tokens, h_kv, d)
    slots = torch.randperm(8 * 16, generator=g)[:num_tokens].to(DEVICE)
    cache = torch.zeros(2, 8, 16, h_kv, d, device=DEVICE)
    expected = cache.clone()
    write_kv_cache_ref(key.contiguous(), value.contiguous(), expected, slots)
    write_kv_cache(key, value, cache, slots)
    torch.testing.assert_close(cache, expected, rtol=0, atol=0)


def test_bad_shapes_raise():
    key, value, cache, slots = _case(4, 4, 16, 2, 8)
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv_cache(key, value, cache, slots[:3])
    with pytest.raises(ValueError, match="kv_cache"):
        write_kv_cache(key, value, cache[0], slots)


@pytest.mark.gpu
def test_matches_reference_bf16_cuda():
    key, value, cache, slots = _case(300, 64, 16, 8, 128, pad=7, dtype=torch.bfloat16,
                                     device="cuda")
    expected = cache.clone()
    write_kv_cache_ref(key, value, expected, slots)
    write_kv_cache(key, value, cache, slots)
    torch.testing.assert_close(cache, expected, rtol=0, atol=0)
