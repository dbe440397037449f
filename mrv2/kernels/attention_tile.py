"""One key tile of paged attention's online softmax, and a split's key range, shared by its kernels.

``paged_attention``'s kernel (every step kind) and ``decode_heads``' (large decode batches,
several KV heads a program) both walk a request's keys a ``BLOCK_N`` tile at a time through
the block table and fold each tile into a running (max, sum, weighted values) in fp32: this
is that step, once. ``split_key_range`` is the keys one split of a request reads, for
``paged_attention``'s and ``decode_attention``'s kernels alike; ``request_meta`` a program's
request and its lengths (before the PDL wait with ``attention.EARLY_META``), ``query_range``
the query part of them (the split merge's); ``prefetch_keys_l2`` brings
a key range's cached rows into L2 (``prefetch.global.L2``, PTX only) before a PDL wait. See
``mrv2/kernels/attention.py`` for the layout of their arguments.
"""

from __future__ import annotations

import triton
import triton.language as tl

from mrv2.platform import interpreter_body

#: log2(e): the kernels take scores in log2 units (``qk_scale = scale * _LOG2E``, then exp2).
_LOG2E = 1.4426950408889634


@triton.jit
def _attend_tile(acc, m_i, l_i, q, start, seq_end, pos, b,
                 kv_cache_ptr, block_table_ptr, qk_scale, kh0, e_off, e_ok,
                 stride_ckv, stride_cb, stride_co, stride_ch, stride_bt,
                 PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                 DOT_PRECISION: tl.constexpr):
    # Find the page and offset of each of the BLOCK_N keys through the block table.
    n = start + tl.arange(0, BLOCK_N)                                   # [BLOCK_N]
    if MASKED:
        n_ok = n < seq_end
        page = tl.load(block_table_ptr + b * stride_bt + n // PAGE_SIZE, mask=n_ok, other=0)
    else:
        page = tl.load(block_table_ptr + b * stride_bt + n // PAGE_SIZE)
    slot_off = page.to(tl.int64) * stride_cb + (n % PAGE_SIZE) * stride_co + kh0 * stride_ch
    k_ptrs = kv_cache_ptr + slot_off[None, :] + e_off[:, None]          # [BLOCK_E, BLOCK_N]
    v_ptrs = kv_cache_ptr + stride_ckv + slot_off[:, None] + e_off[None, :]

    # Scores in log2 units (scale * log2(e) folded in), fp32 accumulation.
    if MASKED:
        k = tl.load(k_ptrs, mask=e_ok[:, None] & n_ok[None, :], other=0.0)
    else:
        k = tl.load(k_ptrs, mask=e_ok[:, None], other=0.0)
    s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale        # [BLOCK_M, BLOCK_N]
    if MASKED:
        # Causal by absolute position, and nothing past this program's key range.
        s = tl.where((n[None, :] <= pos[:, None]) & n_ok[None, :], s, float("-inf"))

    # Online softmax: rescale the running sums to the new row maximum.
    m_new = tl.maximum(m_i, tl.max(s, 1))                               # [BLOCK_M]
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])                                     # [BLOCK_M, BLOCK_N]
    l_i = l_i * alpha + tl.sum(p, 1)

    # Accumulate P @ V (masked keys load as 0 so stale cache bytes cannot make NaN).
    if MASKED:
        v = tl.load(v_ptrs, mask=n_ok[:, None] & e_ok[None, :], other=0.0)
    else:
        v = tl.load(v_ptrs, mask=e_ok[None, :], other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


# NOTE: under the interpreter every call of a @triton.jit helper re-patches
# triton.language (~1.6 ms a call); the kernel calls the helper's plain Python body there.
_attend_tile_body = interpreter_body(_attend_tile)


@triton.jit
def split_key_range(split, kv_end, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr,
                    PART_TILES: tl.constexpr):
    # Keys [lo, hi) of split `split` of a request whose keys end at kv_end: PART_TILES key
    # tiles a split (attention.DECODE_PARTITIONS; later splits may be empty), else an equal
    # share of the request's tiles.
    if PART_TILES > 0:
        tiles = PART_TILES
    else:
        tiles = ((kv_end + BLOCK_N - 1) // BLOCK_N + NUM_SPLITS - 1) // NUM_SPLITS
    lo = split * tiles * BLOCK_N
    return lo, tl.minimum(lo + tiles * BLOCK_N, kv_end)


# NOTE: the interpreter re-patches triton.language at every jit-helper call: a plain body.
split_key_range_body = interpreter_body(split_key_range)


@triton.jit
def query_range(query_start_loc_ptr, b, CACHE: tl.constexpr):
    # Request b's first new token and query length. CACHE=".cg": through L2 only, for loads
    # issued before the PDL wait (attention.EARLY_META).
    q_start = tl.load(query_start_loc_ptr + b, cache_modifier=CACHE)
    return q_start, tl.load(query_start_loc_ptr + b + 1, cache_modifier=CACHE) - q_start


query_range_body = interpreter_body(query_range)


@triton.jit
def request_meta(req_order_ptr, query_start_loc_ptr, seq_lens_ptr, HAS_ORDER: tl.constexpr,
                 CACHE: tl.constexpr):
    # This program's request b (req_order's slot with HAS_ORDER, else program_id(0)), its
    # first new token, query length (query_range) and seq_len; CACHE as there.
    if HAS_ORDER:
        b = tl.load(req_order_ptr + tl.program_id(0), cache_modifier=CACHE)
    else:
        b = tl.program_id(0)
    q_start, q_len = query_range_body(query_start_loc_ptr, b, CACHE)
    return b, q_start, q_len, tl.load(seq_lens_ptr + b, cache_modifier=CACHE)


request_meta_body = interpreter_body(request_meta)


@triton.jit
def _prefetch_l2(ptrs):
    # One ``prefetch.global.L2`` a pointer: the line comes into L2, no register waits for it.
    return tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs],
                                     dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def prefetch_keys_l2(first, kv_hi, b, kv_cache_ptr, block_table_ptr, kh, stride_ckv,
                      stride_cb, stride_co, stride_ch, stride_bt, PAGE_SIZE: tl.constexpr,
                      BLOCK_N: tl.constexpr, LINE: tl.constexpr, LINES: tl.constexpr):
    # Every cached key and value row of keys [first, kv_hi) into L2, LINES lines of LINE
    # elements a row (128 B each). Issued before the PDL wait: no kernel of this step writes
    # these rows. Keys past kv_hi take the address of page 0 (a real line: no fault).
    line = tl.arange(0, LINES) * LINE                                   # [L]
    for start in range(first, kv_hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)                               # [BN]
        n_ok = n < kv_hi
        page = tl.load(block_table_ptr + b * stride_bt + n // PAGE_SIZE, mask=n_ok, other=0,
                       cache_modifier=".cg")
        slot_off = page.to(tl.int64) * stride_cb + (n % PAGE_SIZE) * stride_co + kh * stride_ch
        rows = kv_cache_ptr + slot_off[:, None] + line[None, :]         # [BN, L] K rows' lines
        _prefetch_l2(rows)
        _prefetch_l2(rows + stride_ckv)                                 # the V rows'


prefetch_keys_l2_body = interpreter_body(prefetch_keys_l2)
