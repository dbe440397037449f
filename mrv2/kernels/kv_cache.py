"""Writing the new tokens' keys and values into the paged KV cache.

Each layer owns one cache tensor ``kv_cache`` of shape
``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (index 0 holds keys, 1 values).
A token's place in it is a single integer, its *slot*: block ``slot // block_size``,
offset ``slot % block_size``. The idea of paging is that the runner, not the kernel,
decides where each token lives (``slot_mapping``, built from the block table), so the
write is a plain scatter; slot -1 marks a padding token that must not be written.
See notebooks/01_qwen3_and_paged_kv.ipynb.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mrv2.platform import TRITON_INTERPRET


def _check(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
           slot_mapping: torch.Tensor) -> None:
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError("kv_cache must have shape [2, num_blocks, block_size, num_kv_heads, "
                         f"head_dim], got {tuple(kv_cache.shape)}")
    if key.shape != value.shape or key.shape[1:] != kv_cache.shape[3:]:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} must be "
                         f"[num_tokens, {kv_cache.shape[3]}, {kv_cache.shape[4]}]")
    if slot_mapping.shape != (key.shape[0],):
        raise ValueError(f"slot_mapping must have shape [{key.shape[0]}], "
                         f"got {tuple(slot_mapping.shape)}")


def write_kv_cache_ref(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                       slot_mapping: torch.Tensor) -> None:
    """Plain torch reference of :func:`write_kv_cache` (the executable specification).

    Args:
        key: ``[num_tokens, num_kv_heads, head_dim]`` keys of the new tokens.
        value: ``[num_tokens, num_kv_heads, head_dim]`` values of the new tokens.
        kv_cache: ``[2, num_blocks, block_size, num_kv_heads, head_dim]``, written in place.
        slot_mapping: ``[num_tokens]`` int64 cache slot per token; -1 = padding, skipped.
    """
    _check(key, value, kv_cache, slot_mapping)
    block_size = kv_cache.shape[2]
    keep = slot_mapping >= 0                                    # [num_tokens] bool
    slots = slot_mapping[keep].long()                           # [num_kept]
    blocks, offsets = slots // block_size, slots % block_size
    kv_cache[0, blocks, offsets] = key[keep].to(kv_cache.dtype)
    kv_cache[1, blocks, offsets] = value[keep].to(kv_cache.dtype)


@triton.jit(do_not_specialize=["num_tokens"])
def _write_kv_cache_kernel(
    key_ptr, value_ptr, slot_mapping_ptr,   # inputs
    kv_cache_ptr,                           # output (written in place)
    num_tokens,                             # sizes
    stride_kt, stride_kh, stride_kd,        # strides of key
    stride_vt, stride_vh, stride_vd,        # strides of value
    stride_ckv, stride_cb, stride_co, stride_ch, stride_cd,  # strides of kv_cache
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_HD: tl.constexpr,
):
    # Each program moves BLOCK_T tokens; all heads x dims of a token form one row.
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)          # [BLOCK_T]
    hd = tl.arange(0, BLOCK_HD)                                        # [BLOCK_HD]
    h = hd // HEAD_DIM
    d = hd % HEAD_DIM

    # Load the slots; padding tokens (-1) and rows past the end are masked out.
    slot = tl.load(slot_mapping_ptr + tok, mask=tok < num_tokens, other=-1)
    row_ok = slot >= 0                                                 # [BLOCK_T]
    mask = row_ok[:, None] & (hd < NUM_KV_HEADS * HEAD_DIM)[None, :]   # [BLOCK_T, BLOCK_HD]
    slot = tl.where(row_ok, slot, 0)

    # Load the new keys/values in their own layout (they may be views into a fused qkv).
    k = tl.load(key_ptr + tok[:, None] * stride_kt + h[None, :] * stride_kh
                + d[None, :] * stride_kd, mask=mask)
    v = tl.load(value_ptr + tok[:, None] * stride_vt + h[None, :] * stride_vh
                + d[None, :] * stride_vd, mask=mask)

    # Store at block slot // BLOCK_SIZE, offset slot % BLOCK_SIZE, in the cache dtype.
    dst = (kv_cache_ptr + (slot // BLOCK_SIZE)[:, None] * stride_cb
           + (slot % BLOCK_SIZE)[:, None] * stride_co
           + h[None, :] * stride_ch + d[None, :] * stride_cd)         # [BLOCK_T, BLOCK_HD]
    tl.store(dst, k.to(kv_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_ckv, v.to(kv_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Scatter the new tokens' keys and values into their cache slots (Triton).

    Token ``t`` goes to block ``slot_mapping[t] // block_size``, offset
    ``slot_mapping[t] % block_size``; tokens whose slot is -1 (padding) are skipped.

    Args:
        key: ``[num_tokens, num_kv_heads, head_dim]`` keys of the new tokens (any strides,
            e.g. a view into a fused qkv projection).
        value: ``[num_tokens, num_kv_heads, head_dim]`` values, same shape as ``key``.
        kv_cache: ``[2, num_blocks, block_size, num_kv_heads, head_dim]``, written in place;
            keys/values are converted to its dtype.
        slot_mapping: ``[num_tokens]`` int64 cache slot of each token; -1 = skip.

    Returns:
        None; ``kv_cache`` is updated in place.
    """
    _check(key, value, kv_cache, slot_mapping)
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    block_hd = triton.next_power_of_2(num_kv_heads * head_dim)
    # NOTE: the interpreter pays per program, the GPU likes one token per program.
    block_t = max(1, min(64, triton.next_power_of_2(num_tokens), 8192 // block_hd)) \
        if TRITON_INTERPRET else 1
    grid = (triton.cdiv(num_tokens, block_t),)
    _write_kv_cache_kernel[grid](
        key, value, slot_mapping,
        kv_cache,
        num_tokens,
        *key.stride(), *value.stride(), *kv_cache.stride(),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_T=block_t, BLOCK_HD=block_hd,
    )
