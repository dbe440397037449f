"""Decode attention for large batches: one program walks several KV heads' keys in ONE loop.

``paged_attention`` launches one program per (request, KV head) for a decode step: 2,048
programs at batch 256 for Qwen3-0.6B (8 KV heads), 4 of them an SM at once (242 registers a
thread, ``scripts/occupancy_sm90.py``), so 4 waves. At short contexts (the host-bound
workload's 32-160 keys: two 64-key tiles) each program is mostly its fixed part: the step's
metadata, the page numbers, the first tile's latency, the epilogue; the programs of a wave
start together, so the SM's loads pause in the same places. Measured in the model (H200,
PDL off, job 15A): ~43 us a layer for ~24 us of KV bytes.

Here a program takes ``HEADS`` KV heads of one request and walks all their key tiles as one
flat loop (head after head), so Triton's software pipeline keeps ``num_stages`` tiles in
flight across the head boundaries; the metadata is read once per program and the page
numbers come from L1 after the first head. A head's output is stored on its last tile and
the online-softmax state reset for the next. One token per request (decode launches only,
``max_query_len == 1``); no splits (large batches have programs enough).

Numerics are ``paged_attention``'s (its tile step, ``attention_tile.py``): fp32 scores and sums, P rounded to
V's dtype before P @ V, the output rounded once.

OFF: measured and slower (H200, Qwen3-0.6B shape, ``bench decode`` at 256 requests and 96
keys, job 18B, ``decode_steps_b256_*_job18B-*.json``): attention 1.21 ms a step with
``paged_attention``'s launch, 1.85 with 8 heads a program, 1.23 with 2; the host-bound
workload with 8 heads gave V2 0.86x the tokens/s. Kept as a tested record
(``MRV2_DECODE_HEADS=1``; ``HEADS`` through ``scripts/bench_with.py --set
mrv2.kernels.decode_heads:HEADS=2``), and only for contexts up to ``MAX_SEQ_LEN``: with 8
heads a long request's program is 8 times longer, which a mix of long contexts would pay for
at its tail. See notebooks/01_qwen3_and_paged_kv.ipynb.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from mrv2.forward_context import AttentionMetadata
from mrv2.kernels import pdl
from mrv2.kernels.attention_tile import _LOG2E, _attend_tile_body
from mrv2.kernels.pdl import GDC_CALLS
from mrv2.platform import TRITON_INTERPRET, env_switch

#: Off unless ``MRV2_DECODE_HEADS=1`` (tests turn it on in the interpreter).
ENABLED: bool = env_switch("MRV2_DECODE_HEADS", False)
#: Decode launches of at least this many requests take it (up to 32 the model runs the
#: fused ``decode_attention`` kernel instead) ...
MIN_REQS = 33
#: ... whose contexts are bounded by this many keys (``max_seq_len``: in a CUDA graph the
#: model's length). The fixed part of a program is what this saves, a large share only of
#: short programs; at long, mixed contexts one program a request would end the launch with
#: a few long programs (the 8-times-longer tail above), so they keep ``paged_attention``.
MAX_SEQ_LEN = 512
#: KV heads a program walks (the largest power of two dividing the model's KV heads, up to
#: this), its key tile, warps and pipeline depth (job 18B measured 8 and 2 heads at this launch).
HEADS = 8
LAUNCH = {"block_n": 64, "num_warps": 4, "num_stages": 3}


def use_decode_heads(md: AttentionMetadata, num_splits: int | None = None,
                     config: dict | None = None) -> bool:
    """Whether ``paged_attention`` hands this launch here: on, a decode launch of at least
    ``MIN_REQS`` requests up to ``MAX_SEQ_LEN`` keys, no split or launch override asked
    for. Host ints only."""
    return (ENABLED and md.max_query_len == 1 and md.num_reqs >= MIN_REQS
            and md.max_seq_len <= MAX_SEQ_LEN and num_splits is None and not config)


def heads_per_program(num_kv_heads: int, heads: int | None = None) -> int:
    """The largest power of two dividing ``num_kv_heads`` and at most ``heads`` (``HEADS``)."""
    cap = HEADS if heads is None else heads
    h = 1
    while h * 2 <= cap and num_kv_heads % (h * 2) == 0:
        h *= 2
    return h


@triton.jit
def _decode_heads_kernel(
    q_ptr, kv_cache_ptr, block_table_ptr, query_start_loc_ptr, seq_lens_ptr,  # inputs
    out_ptr,                                                                  # output
    qk_scale,                                                                 # sizes
    stride_qt, stride_qh, stride_qd, stride_ot, stride_oh, stride_od,        # strides
    stride_ckv, stride_cb, stride_co, stride_ch, stride_cd, stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    HEADS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr, PDL: tl.constexpr = False,
    req_order_ptr=None, HAS_ORDER: tl.constexpr = False,
):
    # NOTE: with PDL the kernel before wrote q and the new keys: wait first, then let the
    # next kernel launch (mrv2/kernels/pdl.py); every program, before any early return.
    if PDL and GDC_CALLS:
        gdc_wait()
        gdc_launch_dependents()
    # Program = (request, HEADS KV heads). Request b decodes token t.
    if HAS_ORDER:  # longest_first's request of this slot
        b = tl.load(req_order_ptr + tl.program_id(0))
    else:
        b = tl.program_id(0)
    kh0 = tl.program_id(1) * HEADS
    t = tl.load(query_start_loc_ptr + b)
    if tl.load(query_start_loc_ptr + b + 1) - t <= 0:  # graph padding: no token
        return
    seq_len = tl.load(seq_lens_ptr + b)
    n_tiles = (seq_len + BLOCK_N - 1) // BLOCK_N

    m = tl.arange(0, BLOCK_M)                                           # [BM] group rows
    d = tl.arange(0, BLOCK_D)                                           # [BD]
    d_ok = d < HEAD_DIM
    d_off = d * stride_cd                                               # [BD] in the cache
    mask = (m < GROUP)[:, None] & d_ok[None, :]                         # [BM, BD]
    pos = tl.zeros([BLOCK_M], dtype=tl.int32) + seq_len - 1             # [BM] the token's
    kv_dt = kv_cache_ptr.dtype.element_ty
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # One flat loop over (head, key tile): the pipeline runs on across head boundaries.
    for it in range(HEADS * n_tiles):
        hh = it // n_tiles
        start = (it - hh * n_tiles) * BLOCK_N
        kh = kh0 + hh
        head = kh * GROUP + m                                           # [BM] q heads
        q = tl.load(q_ptr + t * stride_qt + head[:, None] * stride_qh + d[None, :] * stride_qd,
                    mask=mask, other=0.0).to(kv_dt)                     # [BM, BD]
        # paged_attention's tile step: the decode token sees every key below seq_len.
        acc, m_i, l_i = _attend_tile_body(
            acc, m_i, l_i, q, start, seq_len, pos, b, kv_cache_ptr, block_table_ptr, qk_scale,
            kh, d_off, d_ok, stride_ckv, stride_cb, stride_co, stride_ch, stride_bt,
            PAGE_SIZE, BLOCK_N, True, DOT_PRECISION)
        # The head's last tile: store its rows, start the next head afresh.
        # NOTE: as a [BM] vector: the interpreter rejects a scalar bool in a store mask.
        last = (tl.zeros([BLOCK_M], dtype=tl.int32) + start + BLOCK_N) >= seq_len  # [BM]
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + t * stride_ot + head[:, None] * stride_oh + d[None, :] * stride_od,
                 o.to(out_ptr.dtype.element_ty), mask=mask & last[:, None])
        m_i = tl.where(last, -1.0e30, m_i)
        l_i = tl.where(last, 0.0, l_i)
        acc = tl.where(last[:, None], 0.0, acc)


def decode_heads_attention(q: torch.Tensor, kv_cache: torch.Tensor, md: AttentionMetadata,
                           scale: float, out: torch.Tensor, *, heads: int | None = None,
                           config: dict | None = None) -> torch.Tensor:
    """``paged_attention`` of a decode step (one token per request), ``HEADS`` KV heads a
    program in one loop.

    Args:
        q: ``[T, H, D]`` the step's queries (normed, rotated); kv_cache: ``[2, blocks,
            block_size, H_kv, D]`` with the new tokens' keys already written.
        md: the step's metadata (``max_query_len`` 1); scale: the softmax scale.
        out: ``[T, H, D]``: rows of tokens no request covers are left as they were.
        heads: KV heads a program (default ``heads_per_program``); config: ``block_n``,
            ``num_warps``, ``num_stages`` overrides of ``LAUNCH``.

    Returns:
        ``out``.
    """
    if md.max_query_len != 1:
        raise ValueError(f"decode_heads_attention is for decode steps (max_query_len 1), got "
                         f"max_query_len {md.max_query_len}")
    T, num_heads, head_dim = q.shape
    num_kv_heads = kv_cache.shape[3]
    if kv_cache.shape[-1] != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"q {tuple(q.shape)} does not fit kv_cache {tuple(kv_cache.shape)}")
    h = heads_per_program(num_kv_heads, heads)
    if heads is not None and h != heads:
        raise ValueError(f"heads must be a power of two dividing {num_kv_heads} KV heads, "
                         f"got {heads}")
    if T == 0 or md.num_reqs == 0:
        return out
    cfg = {**LAUNCH, **(config or {})}
    group = num_heads // num_kv_heads
    fp32 = q.dtype == torch.float32 or kv_cache.dtype == torch.float32
    use_pdl = pdl.use_pdl(q.device)
    opts = {} if TRITON_INTERPRET else {"num_warps": cfg["num_warps"],
                                        "num_stages": cfg["num_stages"]}
    _decode_heads_kernel[(md.num_reqs, num_kv_heads // h)](
        q, kv_cache, md.block_table, md.query_start_loc, md.seq_lens, out,
        scale * _LOG2E, *q.stride(), *out.stride(), *kv_cache.stride(),
        md.block_table.stride(0),
        GROUP=group, HEAD_DIM=head_dim, PAGE_SIZE=kv_cache.shape[2], HEADS=h,
        BLOCK_M=max(16, triton.next_power_of_2(group)), BLOCK_N=cfg["block_n"],
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        DOT_PRECISION="ieee" if fp32 else "tf32", PDL=use_pdl,
        req_order_ptr=md.req_order, HAS_ORDER=md.req_order is not None,
        **opts, **pdl.launch_kwargs(use_pdl))
    return out
