"""Paged attention: causal attention of a step's new tokens over the paged KV cache.

One kernel serves every step, whatever it mixes: prefill chunks, decodes, draft tokens.
Request ``b`` owns the new tokens ``query_start_loc[b]:query_start_loc[b+1]`` at the
positions ``seq_lens[b] - q_len ... seq_lens[b] - 1``; its keys and values (prefix and
new tokens alike, ``write_kv_cache`` runs first) sit in the cache pages listed by
``block_table[b]``. The idea: never build a contiguous K/V copy; each program walks the
request's pages through the block table and keeps an online softmax (running max, sum
and weighted values in fp32), so a token attends to its whole context in one pass.
Grouped-query attention is free: the query heads sharing a KV head become extra rows of
the same ``tl.dot``, so each K/V page is read once per group. Small decode batches split
each sequence over several programs (flash-decoding) and merge the parts in a second
kernel; large decode batches with long contexts start their longest requests first
(``longest_first``). See notebooks/01_qwen3_and_paged_kv.ipynb.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from mrv2.forward_context import AttentionMetadata
from mrv2.kernels import decode_heads, pdl
from mrv2.kernels.attention_table import (
    choose_decode_config,
    decode_block_q,
    fold_rows,
    heuristic_decode_config,
    load_table,
)
from mrv2.kernels.attention_tile import (  # noqa: F401 (book)
    _LOG2E,
    _attend_tile,
    _attend_tile_body,
    query_range_body,
    request_meta_body,
    split_key_range_body,
)
from mrv2.kernels.pdl import GDC_CALLS
from mrv2.platform import TRITON_INTERPRET, env_switch


def paged_attention_ref(q: torch.Tensor, kv_cache: torch.Tensor,
                        attn_metadata: AttentionMetadata, scale: float,
                        out: torch.Tensor | None = None) -> torch.Tensor:
    """Plain torch reference of :func:`paged_attention` (the executable specification).

    Args:
        q: ``[num_tokens, num_heads, head_dim]`` queries of the new tokens.
        kv_cache: ``[2, num_blocks, block_size, num_kv_heads, head_dim]``.
        attn_metadata: where each request's tokens and pages are.
        scale: softmax scale, usually ``head_dim ** -0.5``.
        out: optional output buffer (as :func:`paged_attention`'s: rows no request covers
            are left untouched).

    Returns:
        ``[num_tokens, num_heads, head_dim]`` in ``q``'s dtype; without ``out``, rows no
        request covers are 0.
    """
    _, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.zeros_like(q)
    qsl = attn_metadata.query_start_loc.tolist()
    for b, seq_len in enumerate(attn_metadata.seq_lens.tolist()):
        start, end = qsl[b], qsl[b + 1]
        q_len = end - start
        if q_len <= 0 or seq_len <= 0:
            continue
        pages = attn_metadata.block_table[b, :triton.cdiv(seq_len, block_size)].long()
        k = kv_cache[0, pages].reshape(-1, num_kv_heads, head_dim)[:seq_len]  # [S, H_kv, D]
        v = kv_cache[1, pages].reshape(-1, num_kv_heads, head_dim)[:seq_len]  # [S, H_kv, D]
        k = k.float().repeat_interleave(group, dim=1)                          # [S, H, D]
        v = v.float().repeat_interleave(group, dim=1)                          # [S, H, D]
        s = torch.einsum("qhd,khd->hqk", q[start:end].float(), k) * scale      # [H, q_len, S]
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)        # [q_len]
        k_pos = torch.arange(seq_len, device=q.device)                          # [S]
        s = s.masked_fill(k_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        p = torch.softmax(s, dim=-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", p, v).to(q.dtype)
    return out


@triton.jit
def _paged_attention_kernel(
    q_ptr, kv_cache_ptr, block_table_ptr, query_start_loc_ptr, seq_lens_ptr,  # inputs
    out_ptr, part_acc_ptr, part_ml_ptr,                                       # outputs
    qk_scale,                                                                 # sizes
    stride_qt, stride_qh, stride_qd, stride_ot, stride_oh, stride_od,        # strides
    stride_ckv, stride_cb, stride_co, stride_ch, stride_cd, stride_bt,
    stride_pt, stride_ph, stride_ps, stride_mt, stride_mh, stride_ms,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr, KV_FOLD: tl.constexpr,
    ONE_LOOP: tl.constexpr, DECODE_ONE_LOOP: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, PDL: tl.constexpr = False,
    req_order_ptr=None, HAS_ORDER: tl.constexpr = False,                      # optional
    PART_TILES: tl.constexpr = 0, EARLY_META: tl.constexpr = False,
):
    # Program = (request, block of BLOCK_Q query tokens, KV_FOLD KV heads x split of the
    # keys). The compiled kernel takes one KV head (KV_FOLD = 1); the interpreter, which
    # pays per operation, folds several into one block-diagonal problem (see below).
    # Its request (req_order's slot: longest_first) and lengths; with EARLY_META before the wait.
    if EARLY_META:
        b, q_start, q_len, seq_len = request_meta_body(
            req_order_ptr, query_start_loc_ptr, seq_lens_ptr, HAS_ORDER, ".cg")
    # NOTE: with PDL the kernel before may have written q (and the cache): wait, then let the
    # next kernel launch (mrv2/kernels/pdl.py); every program, before any early return.
    if PDL and GDC_CALLS:
        gdc_wait()
        gdc_launch_dependents()
    if not EARLY_META:
        b, q_start, q_len, seq_len = request_meta_body(
            req_order_ptr, query_start_loc_ptr, seq_lens_ptr, HAS_ORDER, "")
    q_block = tl.program_id(1)
    kh0 = tl.program_id(2) // NUM_SPLITS * KV_FOLD
    split = tl.program_id(2) % NUM_SPLITS
    if q_block * BLOCK_Q >= q_len:  # padding rows and short queries stop here
        return
    ctx_len = seq_len - q_len

    # Rows of the dot (BLOCK_M = BLOCK_Q * KV_FOLD * GROUP_PAD): BLOCK_Q tokens x the
    # folded KV heads x the GQA group of query heads sharing each KV head.
    m = tl.arange(0, BLOCK_M)
    qi = q_block * BLOCK_Q + m // (KV_FOLD * GROUP_PAD)                 # [BLOCK_M] token in req
    m_kh = m // GROUP_PAD % KV_FOLD                                     # [BLOCK_M] folded KV head
    head = (kh0 + m_kh) * GROUP + m % GROUP_PAD                         # [BLOCK_M]
    row_ok = (qi < q_len) & (m % GROUP_PAD < GROUP)
    tok = q_start + qi                                                  # [BLOCK_M] flat token
    pos = ctx_len + qi                                                  # [BLOCK_M] abs position
    # Columns (BLOCK_E = KV_FOLD * BLOCK_D): the head dims of each folded KV head side by
    # side. A row's query fills only its own head's slice (zeros elsewhere), so Q @ K^T
    # is exact per head and P @ V yields each row's head in its own slice.
    e = tl.arange(0, KV_FOLD * BLOCK_D)
    d = e % BLOCK_D                                                     # [BLOCK_E] head dim
    e_kh = e // BLOCK_D                                                 # [BLOCK_E] folded KV head
    e_ok = d < HEAD_DIM
    e_off = e_kh * stride_ch + d * stride_cd                            # [BLOCK_E] in the cache
    mask = row_ok[:, None] & e_ok[None, :]                              # [BLOCK_M, BLOCK_E]
    if KV_FOLD > 1:
        mask = mask & (m_kh[:, None] == e_kh[None, :])
    q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh
                + d[None, :] * stride_qd, mask=mask, other=0.0)         # [BLOCK_M, BLOCK_E]
    q = q.to(kv_cache_ptr.dtype.element_ty)  # tl.dot wants both operands in one dtype

    # Key range of this program: [lo, hi); keys below full_end are visible to every row.
    kv_end = tl.minimum(seq_len, ctx_len + tl.minimum((q_block + 1) * BLOCK_Q, q_len))
    lo, hi = split_key_range_body(split, kv_end, NUM_SPLITS, BLOCK_N, PART_TILES)
    full_end = (ctx_len + q_block * BLOCK_Q + 1) // BLOCK_N * BLOCK_N
    if ONE_LOOP:  # NOTE: the interpreter pays per operation: mask every tile, one loop
        full_end = 0
    if DECODE_ONE_LOOP:  # a decode token's keys in one (pipelined) loop: see DECODE_ONE_LOOP
        full_end = tl.where(q_len == 1, 0, full_end)

    # Online softmax state in fp32 (a finite start keeps fully masked rows NaN-free).
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, KV_FOLD * BLOCK_D], dtype=tl.float32)
    for start in range(lo, tl.minimum(hi, full_end), BLOCK_N):
        acc, m_i, l_i = _attend_tile_body(
            acc, m_i, l_i, q, start, hi, pos, b, kv_cache_ptr, block_table_ptr, qk_scale,
            kh0, e_off, e_ok, stride_ckv, stride_cb, stride_co, stride_ch, stride_bt,
            PAGE_SIZE, BLOCK_N, False, DOT_PRECISION)
    for start in range(tl.maximum(lo, full_end), hi, BLOCK_N):
        acc, m_i, l_i = _attend_tile_body(
            acc, m_i, l_i, q, start, hi, pos, b, kv_cache_ptr, block_table_ptr, qk_scale,
            kh0, e_off, e_ok, stride_ckv, stride_cb, stride_co, stride_ch, stride_bt,
            PAGE_SIZE, BLOCK_N, True, DOT_PRECISION)

    if NUM_SPLITS == 1:
        # Normalise and store each row's own head slice in the output dtype.
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh
                 + d[None, :] * stride_od, out.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        # Store this split's unnormalised sums and its (max, sum) for the merge kernel.
        tl.store(part_acc_ptr + tok[:, None] * stride_pt + head[:, None] * stride_ph
                 + split * stride_ps + d[None, :], acc, mask=mask)
        ml_ptr = part_ml_ptr + tok * stride_mt + head * stride_mh + split * stride_ms
        tl.store(ml_ptr, m_i, mask=row_ok)
        tl.store(ml_ptr + 1, l_i, mask=row_ok)


@triton.jit
def _merge_splits_kernel(
    part_acc_ptr, part_ml_ptr, query_start_loc_ptr,  # inputs
    out_ptr,                                         # outputs
    stride_pt, stride_ph, stride_ps, stride_mt, stride_mh, stride_ms,  # strides
    stride_ot, stride_oh, stride_od,
    HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False,
    EARLY_META: tl.constexpr = False,
):
    # Program = (request, query token of the request, head).
    b, qi, h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if EARLY_META:  # step metadata: before the wait (EARLY_META)
        q_start, q_len = query_range_body(query_start_loc_ptr, b, ".cg")
    # NOTE: with PDL the parts come from the kernel before: wait first, then let the next
    # kernel launch (mrv2/kernels/pdl.py); every program, before any early return.
    if PDL and GDC_CALLS:
        gdc_wait()
        gdc_launch_dependents()
    if not EARLY_META:
        q_start, q_len = query_range_body(query_start_loc_ptr, b, "")
    if qi >= q_len:
        return
    tok = q_start + qi

    # Load every split's (max, sum) and weight it against the global max.
    s = tl.arange(0, BLOCK_S)
    s_ok = s < NUM_SPLITS
    ml_ptr = part_ml_ptr + tok * stride_mt + h * stride_mh + s * stride_ms
    m_s = tl.load(ml_ptr, mask=s_ok, other=-1.0e30)                    # [BLOCK_S]
    l_s = tl.load(ml_ptr + 1, mask=s_ok, other=0.0)
    w = tl.exp2(m_s - tl.max(m_s, 0))                                   # [BLOCK_S]
    l_tot = tl.sum(l_s * w, 0)

    # Merge the unnormalised partial outputs and store.
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    acc = tl.load(part_acc_ptr + tok * stride_pt + h * stride_ph + s[:, None] * stride_ps
                  + d[None, :], mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    out = tl.sum(acc * w[:, None], 0) / tl.where(l_tot > 0, l_tot, 1.0)  # [BLOCK_D]
    tl.store(out_ptr + tok * stride_ot + h * stride_oh + d * stride_od,
             out.to(out_ptr.dtype.element_ty), mask=d_ok)


@functools.cache
def _num_sms() -> int:
    return torch.cuda.get_device_properties(torch.cuda.current_device()) \
        .multi_processor_count if torch.cuda.is_available() else 1


def _pick_config(num_reqs: int, num_kv_heads: int, group_pad: int, max_query_len: int,
                 max_seq_len: int, block_d: int = 128) -> dict:
    """Block sizes, warps, split count and KV-head fold for one launch (host ints only,
    graph-safe). Compiled decode launches come from ``attention_table`` (a swept table,
    ``scripts/sweep_decode_attention.py``, or the heuristic there).
    """
    decode = max_query_len <= 16  # rows: the few query tokens x group, padded to tl.dot's 16
    block_q = decode_block_q(max_query_len, group_pad) if decode else max(1, 64 // group_pad)
    cfg = {"block_q": block_q, "block_n": 64, "num_splits": 1, "kv_fold": 1,
           "num_warps": 4, "num_stages": 2, "part_tiles": 0}
    if TRITON_INTERPRET:
        # NOTE: the interpreter pays per operation, not per element: few, wide tiles, and
        # as many KV heads per program as divide evenly (a power of two, <= 512 columns).
        cfg["block_n"] = max(64, min(512, triton.next_power_of_2(max(max_seq_len, 1))))
        if not decode:
            cfg["block_q"] = max(1, min(128, triton.next_power_of_2(max_query_len)) // group_pad)
        fold = num_kv_heads & -num_kv_heads  # the largest power of two dividing it
        cfg["kv_fold"] = max(1, min(fold, 512 // block_d))
        return cfg
    if decode:
        # The swept table when it was measured on this GPU's SM count, else the heuristic.
        table = load_table()
        if table is not None and table["num_sms"] == _num_sms() and max_query_len == 1:
            cfg.update(choose_decode_config(num_reqs, max_seq_len, num_kv_heads, table))
        else:
            cfg.update(heuristic_decode_config(num_reqs, max_seq_len, num_kv_heads, _num_sms(),
                                               max_query_len, block_q))
        fold_rows(cfg, max_query_len, group_pad, num_kv_heads)  # a table's kv_fold: its rows
        if max_query_len == 1:
            partition_launch(cfg, num_reqs, max_seq_len)
    return cfg


#: Split rules for decode launches of mixed contexts: ``{"lo", "hi", "min_seq_len"}`` and
#: either ``"keys"`` (fixed-size parts: vLLM's paged attention v2 idea) or ``"num_splits"``
#: (equal shares), optionally ``num_warps`` / ``num_stages``. The first rule whose
#: ``lo <= num_reqs <= hi`` and ``max_seq_len >= min_seq_len`` replaces the table's split.
#: Why: the table was swept on batches of ONE context, where 64+ requests want no split.
#: In a batch of mixed contexts (the standard workload's run from ~100 to ~2,000 keys) a
#: program's share is proportional to its request's length, so a launch of about one wave
#: (64 requests x 8 KV heads on 528 program slots) lasts as long as its longest program
#: while the others' slots empty. Fixed parts bound every program at ``keys`` (requests
#: shorter than the launch's ``max_seq_len`` leave their last parts empty: those programs
#: store an empty part); equal shares just make more, shorter programs. See
#: ``partition_launch`` and chapter 01.
#: EMPTY (no rule), measured no faster: the standard workload's decode GPU time (session 19,
#: job 19I, an H100 80GB; ``scripts/standard_steps.py --set``, one process a rule) was 6,638
#: ms with no rule (6,638 again in a later process), 6,646 with 4 equal shares at 33-128
#: requests (-1.1% to +1.5% in the buckets it touches) and 7,369 with parts of 256 keys at
#: 5-256 requests (1-23% slower at every batch size; 8 mostly empty parts a request at 2,048
#: keys, and a merge a layer). ``standard_steps_parts-*_job19I-*.json``.
DECODE_PARTITIONS: list[dict] = []


def partition_launch(cfg: dict, num_reqs: int, max_seq_len: int) -> dict:
    """``cfg`` (a decode launch) with the first matching ``DECODE_PARTITIONS`` rule applied,
    in place: ``part_tiles`` key tiles a split and ``num_splits`` = the parts of
    ``max_seq_len`` (a ``keys`` rule), or ``num_splits`` equal shares (``part_tiles`` 0).
    Unchanged when no rule matches or the rule leaves one split. Host ints only:
    graph-safe, and the warm-up walks it."""
    rule = next((r for r in DECODE_PARTITIONS if r["lo"] <= num_reqs <= r["hi"]
                 and max_seq_len >= r.get("min_seq_len", 0)), None)
    if rule is None:
        return cfg
    n_tiles = triton.cdiv(max(max_seq_len, 1), cfg["block_n"])
    if "keys" in rule:
        tiles = max(1, rule["keys"] // cfg["block_n"])
        splits = triton.cdiv(n_tiles, tiles)
    else:                      # equal shares: at least one key tile each
        tiles, splits = 0, min(rule["num_splits"], n_tiles)
    if splits > 1:
        cfg.update({k: rule[k] for k in ("num_warps", "num_stages") if k in rule})
        cfg.update(num_splits=splits, part_tiles=tiles)
    return cfg


def override_launch(cfg: dict, overrides: dict) -> dict:
    """``cfg`` (a picked launch) updated with ``overrides`` (a caller's or a benchmark's), in
    place. A split count given without ``part_tiles`` means equal shares (part_tiles 0), and
    one split has no parts (one compiled variant, whatever ``part_tiles`` said)."""
    if "num_splits" in overrides:
        cfg["part_tiles"] = 0
    cfg.update(overrides)
    if cfg["num_splits"] <= 1:
        cfg["part_tiles"] = 0
    return cfg


#: Each decode token's keys in ONE loop, every tile masked (``MRV2_DECODE_ONE_LOOP=1``), instead
#: of the full tiles first and the causal tile after. A loop is software-pipelined on its own
#: (``num_stages`` tiles in flight), so with two loops a short decode context pays its tile
#: latencies in series: at 96 keys (host-bound's mean) the first loop has one full tile and
#: the second the partial one, nothing overlaps. For a decode token (q_len 1) the causal mask
#: is just ``key < seq_len``, so masking every tile costs a compare a key. Chosen per program
#: at run time (``q_len == 1``): prefill programs of the same launch keep both loops.
#: OFF, measured slower: at batch 256 and 96 keys, 1.27 ms a step with it, 1.21 without (H200,
#: ``bench decode``, job 18B). The interpreter always runs one loop (``_ONE_LOOP``).
DECODE_ONE_LOOP: bool = env_switch("MRV2_DECODE_ONE_LOOP", False)

#: The step's metadata (request order, ``query_start_loc``, ``seq_lens``; in decode_attention
#: the token's position, angles, slot too) read BEFORE the PDL wait here, in the merge and in
#: decode_attention (``MRV2_ATTENTION_EARLY_META=0``: off): the input prep wrote it >= 2
#: launches back, so it completed (pdl.py: waits chain). H100, jobs 26EM-EM3: TPOT b1 / b4
#: -1.1 / -0.7%, b256's step -1.3%; b24 / b32 +2.4 / +3.9%: 17-32 requests go without it.
EARLY_META: bool = env_switch("MRV2_ATTENTION_EARLY_META", True)
EARLY_META_DECODE_MAX_REQS = 16


def early_meta(num_reqs: int, decode: bool) -> bool:
    """``EARLY_META`` for a launch (host ints): decode kernels and the merge skip 17-32."""
    return EARLY_META and not (decode and EARLY_META_DECODE_MAX_REQS < num_reqs <= 32)


#: The interpreter's single masked loop for every program (it pays per operation).
_ONE_LOOP: bool = TRITON_INTERPRET
#: ``longest_first`` orders decode batches of at least this many requests (up to 32 the model
#: takes ``decode_attention``'s fused kernel, which has no order; 33-63 were not measured with
#: one: a grid of 264-504 programs runs in about one wave of 4 programs an SM) ...
ORDER_MIN_REQS = 64
#: ... whose contexts may reach this many keys (``max_seq_len``: in a CUDA graph the model's
#: length). Short programs finish close together, so the order has little to win there and
#: still costs its sort (~19 us a step) and a load per program (+1% attention at 256 x 96).
ORDER_MIN_SEQ_LEN = 512
#: On a GPU unless ``MRV2_ATTENTION_ORDER=0``.
ORDER_ENABLED: bool = not TRITON_INTERPRET and env_switch("MRV2_ATTENTION_ORDER", True)


def may_order(num_reqs: int, max_seq_len: int) -> bool:
    """Whether a decode launch of ``num_reqs`` requests up to ``max_seq_len`` keys takes a
    request order (``longest_first``; the warm-up compiles those launches when it can)."""
    return ORDER_ENABLED and num_reqs >= ORDER_MIN_REQS and max_seq_len >= ORDER_MIN_SEQ_LEN


def longest_first(md: AttentionMetadata) -> AttentionMetadata:
    """``md`` with ``req_order``: the requests by descending ``seq_lens``, for a decode step of
    at least ``ORDER_MIN_REQS`` requests and ``ORDER_MIN_SEQ_LEN`` keys on a GPU (else ``md``
    unchanged).

    Why: a decode launch has one program per (request, KV head), far more than fit on the
    GPU at once, and the GPU starts them roughly in grid order. Contexts differ (the
    standard workload's run from ~110 to ~2,000 keys), so a long request whose programs
    start last finishes alone while most SMs idle. Started first, the long programs overlap
    the short ones and the launch ends with short programs: the longest-processing-time-
    first rule of scheduling. One argsort a step (on the GPU, no sync, inside the graph);
    every layer's launch reads the same order.

    Measured (H200, Qwen3-0.6B shape, standard workload, GPU ms of every decode step by
    batch size, order on / off in one job, 13E): 1.5-2.7% less at 64-256 requests (e.g.
    6.31 / 6.43 ms a step at 224-255 requests), the same below 64.
    """
    if (md.req_order is not None or md.max_query_len != 1
            or not may_order(md.num_reqs, md.max_seq_len) or not md.seq_lens.is_cuda):
        return md
    return dataclasses.replace(md, req_order=request_order(md.seq_lens))


def request_order(seq_lens: torch.Tensor) -> torch.Tensor:
    """``[num_reqs]`` int32: the request indices by descending length (padding rows, length
    0, last). NOTE: stable, so equal lengths keep batch order (a deterministic placement)."""
    return torch.argsort(seq_lens, descending=True, stable=True).to(torch.int32)


def split_buffers(out: torch.Tensor, splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``(part_acc [T, H, splits, D], part_ml [T, H, splits, 2])`` for the split parts
    of an attention launch writing ``out [T, H, D]`` (empty with one split: unused)."""
    if splits <= 1:
        empty = out.new_empty(0, 0, 0, 0, dtype=torch.float32)
        return empty, empty
    T, H, D = out.shape
    return (out.new_empty(T, H, splits, D, dtype=torch.float32),
            out.new_empty(T, H, splits, 2, dtype=torch.float32))


def merge_splits(part_acc: torch.Tensor, part_ml: torch.Tensor, md: AttentionMetadata,
                 out: torch.Tensor, use_pdl: bool) -> None:
    """Launch ``_merge_splits_kernel``: the parts in ``split_buffers``' tensors into ``out``."""
    splits, head_dim = part_acc.shape[2], out.shape[2]
    _merge_splits_kernel[(md.num_reqs, md.max_query_len, out.shape[1])](
        part_acc, part_ml, md.query_start_loc,
        out,
        *part_acc.stride()[:3], *part_ml.stride()[:3], *out.stride(),
        HEAD_DIM=head_dim, NUM_SPLITS=splits,
        BLOCK_S=triton.next_power_of_2(splits), BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        PDL=use_pdl, EARLY_META=early_meta(md.num_reqs, decode=True), **pdl.launch_kwargs(use_pdl),
    )


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, attn_metadata: AttentionMetadata,
                    scale: float, out: torch.Tensor | None = None, *,
                    num_splits: int | None = None, config: dict | None = None) -> torch.Tensor:
    """Causal attention of the new tokens over the paged KV cache (Triton).

    Args:
        q: ``[num_tokens, num_heads, head_dim]`` queries of the step's new tokens
            (``num_heads`` a multiple of the cache's ``num_kv_heads``).
        kv_cache: ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` holding every
            request's keys/values, the new tokens' included.
        attn_metadata: ``query_start_loc``, ``seq_lens``, ``block_table`` of the step and
            the bounds ``max_query_len``, ``max_seq_len``.
        scale: softmax scale, usually ``head_dim ** -0.5``.
        out: optional ``[num_tokens, num_heads, head_dim]`` output buffer; rows no request
            covers are left untouched.
        num_splits: split each sequence's keys over this many programs (flash-decoding);
            ``None`` lets the launcher choose.
        config: overrides of the launch configuration (``block_q``, ``block_n``,
            ``num_warps``, ``num_stages``), for benchmarks.

    Returns:
        ``out`` (allocated as zeros in ``q``'s dtype when not given).
    """
    num_tokens, num_heads, head_dim = q.shape
    _, _, page_size, num_kv_heads, kv_head_dim = kv_cache.shape
    if kv_head_dim != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"q {tuple(q.shape)} does not fit kv_cache {tuple(kv_cache.shape)}: "
                         "head_dim must match and num_heads be a multiple of num_kv_heads")
    if out is None:
        out = torch.zeros_like(q)
    md = attn_metadata
    num_reqs = md.num_reqs
    if num_tokens == 0 or num_reqs == 0 or md.max_query_len <= 0:
        return out
    if decode_heads.use_decode_heads(md, num_splits, config):  # opt-in: MRV2_DECODE_HEADS=1
        return decode_heads.decode_heads_attention(q, kv_cache, md, scale, out)
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    block_d = max(16, triton.next_power_of_2(head_dim))
    cfg = _pick_config(num_reqs, num_kv_heads, group_pad, md.max_query_len, md.max_seq_len,
                       block_d)
    cfg = override_launch(cfg, {**({} if num_splits is None else {"num_splits": num_splits}),
                                **(config or {})})
    if config and "kv_fold" in config:  # checked; the fold's rows unless block_q is given
        fold_rows(cfg, md.max_query_len, group_pad, num_kv_heads, refit="block_q" not in config)
    splits = cfg["num_splits"]
    part_acc, part_ml = split_buffers(out, splits)
    kv_fold = cfg["kv_fold"]
    fp32 = q.dtype == torch.float32 or kv_cache.dtype == torch.float32
    grid = (num_reqs, triton.cdiv(md.max_query_len, cfg["block_q"]),
            num_kv_heads // kv_fold * splits)
    use_pdl = pdl.use_pdl(q.device)
    _paged_attention_kernel[grid](
        q, kv_cache, md.block_table, md.query_start_loc, md.seq_lens,
        out, part_acc, part_ml,
        scale * _LOG2E,
        *q.stride(), *out.stride(), *kv_cache.stride(), md.block_table.stride(0),
        *part_acc.stride()[:3], *part_ml.stride()[:3],
        GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, PAGE_SIZE=page_size,
        NUM_SPLITS=splits, KV_FOLD=kv_fold, ONE_LOOP=_ONE_LOOP,
        DECODE_ONE_LOOP=DECODE_ONE_LOOP and not _ONE_LOOP,
        DOT_PRECISION="ieee" if fp32 else "tf32",
        BLOCK_Q=cfg["block_q"], BLOCK_M=cfg["block_q"] * kv_fold * group_pad,
        BLOCK_N=cfg["block_n"],
        BLOCK_D=block_d, PDL=use_pdl, req_order_ptr=md.req_order,
        HAS_ORDER=md.req_order is not None, PART_TILES=cfg["part_tiles"],
        EARLY_META=early_meta(md.num_reqs, decode=False),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl.launch_kwargs(use_pdl),
    )
    if splits > 1:
        merge_splits(part_acc, part_ml, md, out, use_pdl)
    return out
