"""Attention metadata and the forward context that carries it to every layer.

The model's ``forward(input_ids, positions)`` takes only the flat token layout;
everything attention needs to find the paged KV cache (``slot_mapping``, the
gathered ``block_table``, ``query_start_loc``, ``seq_lens``) travels in an
``AttentionMetadata`` set around the forward pass, as vLLM does. See
notebooks/01_qwen3_and_paged_kv.ipynb.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Where the tokens of one step sit in the batch and in the paged KV cache.

    A batch holds ``num_reqs`` requests; request ``b`` owns the new tokens
    ``query_start_loc[b]:query_start_loc[b+1]`` of the flat token layout, whose
    positions are ``seq_lens[b] - query_len_b ... seq_lens[b] - 1``. Its keys and
    values before those tokens are already in the cache.

    Attributes:
        query_start_loc: ``[num_reqs + 1]`` int32, prefix sums of new tokens.
        seq_lens: ``[num_reqs]`` int32, cached prefix + new tokens (0 for padding rows).
        block_table: ``[num_reqs, max_blocks_per_req]`` int32, KV block ids per request.
        slot_mapping: ``[num_tokens]`` int64, cache slot of each new token
            (``block_id * block_size + offset``); -1 marks a padding token (not written).
        max_query_len: the longest query in the batch (a bound is fine).
        max_seq_len: the longest ``seq_lens`` entry (a bound is fine).
        req_order: optional ``[num_reqs]`` int32, a permutation of the requests in the order
            attention's programs take them (``attention.longest_first``); ``None``: batch
            order. It changes which program computes what, never a result.
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    max_query_len: int
    max_seq_len: int
    req_order: torch.Tensor | None = None

    @property
    def num_reqs(self) -> int:
        return self.seq_lens.shape[0]


_current: AttentionMetadata | None = None


@contextmanager
def set_forward_context(attn_metadata: AttentionMetadata):
    """Make ``attn_metadata`` visible to every attention layer inside the block."""
    global _current
    prev, _current = _current, attn_metadata
    try:
        yield
    finally:
        _current = prev


def get_attn_metadata() -> AttentionMetadata:
    """The metadata of the forward pass in progress (raises outside one)."""
    if _current is None:
        raise RuntimeError("attention ran outside set_forward_context(): no AttentionMetadata")
    return _current
