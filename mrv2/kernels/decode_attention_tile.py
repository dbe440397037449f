"""The pieces of ``decode_attention``'s fused kernel, one ``@triton.jit`` helper each.

``decode_attention._decode_rope_attention_kernel`` is one program per (request, KV head,
split) of a decode step; these are its steps, in the order it takes them:

* ``_request_range``: the request's token, its ``seq_len`` and this split's key range;
* ``_token_meta``: the token's RoPE angles and cache slot (with ``attention.EARLY_META``
  loaded before the PDL wait: no kernel of the current step writes them);
* ``_new_token_kv``: the token's raw k and v from the qkv projection;
* ``_norm_rope``: q/k-norm and RoPE of a few heads, as the two halves RoPE pairs
  (``rotary``'s, whose ``qk_norm_rope`` does the same arithmetic; re-exported here);
* ``_load_key_tile`` and ``_attend_key_tile``: one tile of cached keys through the block
  table, then folded into the online softmax.

Each has a plain Python body (``*_body``) that the kernel calls under the interpreter.
"""

from __future__ import annotations

import triton
import triton.language as tl

from mrv2.kernels.attention_tile import request_meta_body, split_key_range_body
from mrv2.kernels.rotary import _norm_rope, _norm_rope_body  # noqa: F401 (re-exported)
from mrv2.platform import interpreter_body


@triton.jit
def _request_range(query_start_loc_ptr, seq_lens_ptr, split, NUM_SPLITS: tl.constexpr,
                   BLOCK_N: tl.constexpr, CACHE: tl.constexpr, PART_TILES: tl.constexpr):
    # Request program_id(0)'s token t (q_len 0: graph padding), its seq_len (attention_tile.
    # request_meta, no request order), this split's keys [lo, hi) and kv_hi: the cached ones
    # below the new token (key seq_len - 1), which the kernel adds from registers.
    # CACHE=".cg": through L2 only (loads before the PDL wait).
    _, t, q_len, seq_len = request_meta_body(None, query_start_loc_ptr, seq_lens_ptr, False,
                                             CACHE)
    lo, hi = split_key_range_body(split, seq_len, NUM_SPLITS, BLOCK_N, PART_TILES)
    return t, q_len, seq_len, lo, hi, tl.minimum(hi, seq_len - 1)


@triton.jit
def _load_key_tile(start, kv_hi, b, kv_cache_ptr, block_table_ptr, kh, c, c_ok, stride_ckv,
                   stride_cb, stride_co, stride_ch, stride_bt, HALF: tl.constexpr,
                   PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, CACHE: tl.constexpr):
    # The BLOCK_N cached keys and values from `start` (those below kv_hi; the rest load 0)
    # as the halves RoPE pairs: K^T [BH, BN] twice, V [BN, BH] twice, and the key mask.
    # CACHE=".cg": through L2 only (a load issued before the PDL wait: see the kernel).
    # NOTE: no default for CACHE: Triton 3.6 on the GPU fails to compile a call that leaves
    # a string constexpr to its default ("'str' object has no attribute 'type'"); the
    # interpreter accepts it (tests/test_triton_traps.py checks every kernel module).
    n = start + tl.arange(0, BLOCK_N)                                   # [BN]
    n_ok = n < kv_hi
    page = tl.load(block_table_ptr + b * stride_bt + n // PAGE_SIZE, mask=n_ok, other=0,
                   cache_modifier=CACHE)
    slot_off = page.to(tl.int64) * stride_cb + (n % PAGE_SIZE) * stride_co + kh * stride_ch
    k_mask = c_ok[:, None] & n_ok[None, :]                              # [BH, BN]
    k_ptrs = kv_cache_ptr + slot_off[None, :] + c[:, None]              # [BH, BN]: K^T halves
    v_mask = n_ok[:, None] & c_ok[None, :]                              # [BN, BH]
    v_ptrs = kv_cache_ptr + stride_ckv + slot_off[:, None] + c[None, :]
    return (tl.load(k_ptrs, mask=k_mask, other=0.0, cache_modifier=CACHE),
            tl.load(k_ptrs + HALF, mask=k_mask, other=0.0, cache_modifier=CACHE),
            tl.load(v_ptrs, mask=v_mask, other=0.0, cache_modifier=CACHE),
            tl.load(v_ptrs + HALF, mask=v_mask, other=0.0, cache_modifier=CACHE), n_ok)


@triton.jit
def _attend_key_tile(acc1, acc2, m_i, l_i, q1, q2, k1, k2, v1, v2, n_ok, qk_scale,
                     DOT_PRECISION: tl.constexpr):
    # One loaded key tile into the online softmax (masked keys score -inf).
    s = tl.dot(q1, k1, input_precision=DOT_PRECISION)
    s = (s + tl.dot(q2, k2, input_precision=DOT_PRECISION)) * qk_scale  # [BM, BN], log2 units
    s = tl.where(n_ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))                               # [BM]
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])                                     # [BM, BN]
    l_i = l_i * alpha + tl.sum(p, 1)
    acc1 = acc1 * alpha[:, None] + tl.dot(p.to(v1.dtype), v1, input_precision=DOT_PRECISION)
    acc2 = acc2 * alpha[:, None] + tl.dot(p.to(v2.dtype), v2, input_precision=DOT_PRECISION)
    return acc1, acc2, m_new, l_i


@triton.jit
def _token_meta(positions_ptr, cos_sin_ptr, slot_mapping_ptr, t, t_ok, stride_cp, c, c_ok,
                HALF: tl.constexpr, CACHE: tl.constexpr):
    # Token t's RoPE angles ([1, BH] cos and sin) and its cache slot; a padding row (t_ok
    # False) reads none and gets slot -1. CACHE=".cg": through L2 only (before the PDL wait).
    pos = tl.load(positions_ptr + t, mask=t_ok, other=0, cache_modifier=CACHE)
    cs = cos_sin_ptr + pos * stride_cp + c
    cos = tl.load(cs, mask=c_ok, other=0.0, cache_modifier=CACHE)[None, :]     # [1, BH]
    sin = tl.load(cs + HALF, mask=c_ok, other=0.0, cache_modifier=CACHE)[None, :]
    slot = tl.load(slot_mapping_ptr + t, mask=t_ok, other=-1, cache_modifier=CACHE)
    return cos, sin, slot


@triton.jit
def _new_token_kv(qkv_ptr, t, kh, stride_xt, c, has_new, NUM_Q_HEADS: tl.constexpr,
                  NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr):
    # KV head kh's raw k and v of token t from the qkv projection, as [1, BH] halves; only
    # in the program whose key range holds the new token (has_new), zeros elsewhere.
    k_ptrs = qkv_ptr + t * stride_xt + (NUM_Q_HEADS + kh) * (2 * HALF) + c[None, :]
    v_ptrs = k_ptrs + NUM_KV_HEADS * (2 * HALF)
    ok = (c < tl.where(has_new, HALF, 0))[None, :]     # NOTE: not c_ok & has_new (interpreter)
    return (tl.load(k_ptrs, mask=ok, other=0.0), tl.load(k_ptrs + HALF, mask=ok, other=0.0),
            tl.load(v_ptrs, mask=ok, other=0.0), tl.load(v_ptrs + HALF, mask=ok, other=0.0))


# NOTE: the interpreter re-patches triton.language at every jit-helper call: plain bodies.
_request_range_body = interpreter_body(_request_range)
_load_key_tile_body = interpreter_body(_load_key_tile)
_attend_key_tile_body = interpreter_body(_attend_key_tile)
_token_meta_body = interpreter_body(_token_meta)
_new_token_kv_body = interpreter_body(_new_token_kv)
