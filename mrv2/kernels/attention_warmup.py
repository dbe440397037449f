"""Compile every launch variant of paged attention that a runner can pick, before serving.

``paged_attention`` picks its launch per batch on the host (``_pick_config``: block sizes,
warps, pipeline stages, the flash-decoding split count), and every distinct choice is a
separate Triton compilation of ``_paged_attention_kernel`` (plus ``_merge_splits_kernel``
per split count) the first time a step needs it: about 1.4 s each on the H200, inside
that step, with every stream of the server waiting behind it.

A trickle of requests meets only a few variants; a burst meets others. In job T and U
(H200, ``bench serve`` at rate inf) each burst still stalled 1.3-1.6 s on one such
compile after the engine's warm-up burst: prompts split across steps leave tails of 2-16
tokens beside decodes, which take the decode launch at ``max_query_len`` > 1, with a
split count that depends on the batch and the context. There are only ~20 such
variants for a model, so ``launch_variants`` lists them by walking the picker over every
batch size, context class and query length it distinguishes, and ``precompile`` launches
each once on a one-token dummy problem (the compiled binary depends only on the launch's
constexprs and the arguments' dtypes and alignments, which the dummy shares with the
real calls: it uses the runner's own KV cache and a block table of the real width).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import triton

from mrv2.forward_context import AttentionMetadata
from mrv2.kernels import attention, decode_attention


def _contexts(max_model_len: int) -> list[int]:
    """Context lengths at which the picker's choice can change (one per class)."""
    points = {1, max_model_len}
    points.update(range(16, min(max_model_len, 1024) + 1, 16))    # split caps: cdiv(len, 64)
    points.update(range(512, max_model_len + 1, 256))             # parts of >= 512 keys
    table = attention.load_table()
    if table is not None:
        points.update(e["context"] for e in table["entries"])
    p = 1
    while p <= max_model_len:
        points.update((p, max(1, p - 1)))
        p *= 2
    return sorted(c for c in points if 1 <= c <= max_model_len)


def launch_variants(num_heads: int, num_kv_heads: int, head_dim: int, max_num_reqs: int,
                    max_model_len: int, max_query_len: int = 32,
                    pick: Callable[..., dict] | None = None, min_num_reqs: int = 1) -> list[dict]:
    """Every distinct launch configuration ``paged_attention`` may pick for this model.

    Args:
        num_heads, num_kv_heads, head_dim: the model's attention shape.
        max_num_reqs: the most requests in a step.
        max_model_len: the longest context.
        max_query_len: query lengths up to this are walked (a longer one takes the
            prefill launch, whose choice does not depend on the length).
        pick: the picker walked (``attention._pick_config``'s signature; default that one,
            ``decode_attention.pick_config`` for the fused decode kernel).
        min_num_reqs: the fewest requests walked (``attention.ORDER_MIN_REQS`` for the
            launches that read a request order).

    Returns:
        The configurations (dicts of ``_pick_config``'s keys), each once.
    """
    group_pad = triton.next_power_of_2(num_heads // num_kv_heads)
    block_d = max(16, triton.next_power_of_2(head_dim))
    seen: dict[tuple, dict] = {}
    contexts = _contexts(max_model_len)
    # NOTE: a query length matters only through its power-of-two class (block_q) and the
    # decode/prefill and single-token boundaries: both ends of each class are walked.
    q_lens = sorted({q for p in (1, 2, 4, 8, 16, 32) for q in (p, p + 1)
                     if q <= max_query_len})
    for num_reqs in range(min_num_reqs, max_num_reqs + 1):
        for q_len in q_lens:
            for ctx in contexts:
                if ctx < q_len:
                    continue
                cfg = (pick or attention._pick_config)(num_reqs, num_kv_heads, group_pad,
                                                       q_len, ctx, block_d)
                seen.setdefault(tuple(sorted(cfg.items())), cfg)
    return list(seen.values())


def _dummy_metadata(device: torch.device, block_table_width: int) -> AttentionMetadata:
    """One request of one token at position 0, its KV slot -1 (nothing is written)."""
    return AttentionMetadata(
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32, device=device),
        seq_lens=torch.ones(1, dtype=torch.int32, device=device),
        block_table=torch.zeros(1, block_table_width, dtype=torch.int32, device=device),
        slot_mapping=torch.full((1,), -1, dtype=torch.int64, device=device),
        max_query_len=1, max_seq_len=1)


def precompile(kv_cache: torch.Tensor, num_heads: int, block_table_width: int,
               variants: list[dict], dtype: torch.dtype | None = None,
               progress: bool = False, ordered: bool = False) -> int:
    """Launch ``paged_attention`` once per variant on a one-token dummy problem.

    Args:
        kv_cache: a layer's cache ``[2, num_blocks, block_size, num_kv_heads, head_dim]``
            (only its block 0 is read; nothing is written).
        num_heads: query heads.
        block_table_width: the runner's block-table width (its stride is specialised on).
        variants: from ``launch_variants``.
        dtype: the queries' dtype (default: the cache's).
        progress: a tqdm bar.
        ordered: launch with a request order (``attention.longest_first``'s variant).

    Returns:
        How many variants were launched.
    """
    device, head_dim = kv_cache.device, kv_cache.shape[-1]
    dtype = dtype or kv_cache.dtype
    md = _dummy_metadata(device, block_table_width)
    if ordered:
        md = dataclasses.replace(md, req_order=attention.request_order(md.seq_lens))
    q = torch.zeros(1, num_heads, head_dim, dtype=dtype, device=device)  # [1, H, D]
    it = variants
    if progress:
        from tqdm.auto import tqdm
        it = tqdm(variants, desc="compiling attention variants", leave=False)
    for cfg in it:
        attention.paged_attention(q, kv_cache, md, head_dim ** -0.5, out=torch.empty_like(q),
                                  config=cfg)
    return len(variants)


def precompile_decode_rope(kv_cache: torch.Tensor, num_heads: int, block_table_width: int,
                           variants: list[dict], cos_sin_cache: torch.Tensor,
                           norm_weight: torch.Tensor | None, dtype: torch.dtype | None = None
                           ) -> int:
    """Launch ``decode_attention.decode_rope_attention`` once per decode variant on a
    one-token dummy (slot -1: nothing written), for models whose decode steps take it
    (``MRV2_FUSED_ROPE_ATTENTION=1``).

    Args:
        kv_cache, num_heads, block_table_width, dtype: as :func:`precompile`.
        variants: ``launch_variants(..., max_query_len=1)``: the decode launches.
        cos_sin_cache: the model's RoPE table (its row stride is specialised on).
        norm_weight: the q-norm weight (its dtype), or ``None`` for a model without q/k-norm.

    Returns:
        How many launches were made.
    """
    device, head_dim, num_kv_heads = kv_cache.device, kv_cache.shape[-1], kv_cache.shape[3]
    dtype = dtype or kv_cache.dtype
    md = _dummy_metadata(device, block_table_width)
    qkv = torch.zeros(1, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, device=device)
    positions = torch.zeros(1, dtype=torch.int64, device=device)
    for cfg in variants:
        decode_attention.decode_rope_attention(
            qkv, positions, cos_sin_cache, norm_weight, norm_weight, 1e-6, kv_cache, md,
            head_dim ** -0.5, num_heads, num_kv_heads, config=cfg)
    return len(variants)


def precompile_decode_heads(kv_cache: torch.Tensor, num_heads: int, block_table_width: int,
                            dtype: torch.dtype | None = None, ordered: bool = False) -> int:
    """Launch ``decode_heads.decode_heads_attention`` on a one-token dummy (its one launch a
    model, ``MRV2_DECODE_HEADS=1``), and with a request order too when ``ordered``.

    Returns:
        How many launches were made.
    """
    from mrv2.kernels import decode_heads
    device, head_dim = kv_cache.device, kv_cache.shape[-1]
    md = _dummy_metadata(device, block_table_width)
    q = torch.zeros(1, num_heads, head_dim, dtype=dtype or kv_cache.dtype, device=device)
    mds = [md] + ([dataclasses.replace(md, req_order=attention.request_order(md.seq_lens))]
                  if ordered else [])
    for m in mds:
        decode_heads.decode_heads_attention(q, kv_cache, m, head_dim ** -0.5, torch.empty_like(q))
    return len(mds)
