"""The EAGLE proposer: a one-layer head that drafts from the target's own hidden states.

A draft model guesses the next tokens from the tokens alone; an EAGLE head reads what the
target already computed, its last-layer hidden state ``h_p`` (``eagle_head.py``), so one
small layer suffices. Per target step, on the device and in stream order:

1. **mirror** (one pass over the target step's tokens, variable shape, eager): token ``j``
   at position ``p`` of state row ``r`` gives the head the pair ``(token_ids[r, p + 1],
   h_p)``: the *next* token, read from the state table after verification appended the
   accepted run, beside the target's hidden state of ``j``. The pair is valid while
   ``p + 1 < total_len[r]``; that covers every prefill token and every accepted draft,
   and excludes exactly the rejected drafts (their hidden states saw wrong tokens), whose
   KV writes are masked (slot -1) and later overwritten. So the accepted tokens' features
   come in as the draft model's accepted tokens do: the same step's pass, no bookkeeping.
   The head's output at each request's last valid token (position ``total_len - 2``, the
   pair with the bonus / correction token) gives **draft 1**.
2. **K - 1 chained single-token steps** (static shapes: batch ``[B]``, the seam for CUDA
   graphs): the head's own output feature and the last draft go back in at the next
   position. Each draft is sampled with the target's sampler and (seed, position) noise
   (coupled drafts, as ``draft_model.py``), keeping q for ``probabilistic`` verification.

The hidden states come from the runner as the tensor ``ModelState.run`` returned (no copy,
no sync). The head's paged KV cache uses the target's block ids, block tables and state
rows; the only CPU input is each slot's KV capacity. K forwards per step (the draft model
needs K + 1). Eager for now: ``_chain_step`` reads and writes only ``[B]``-shaped tensors
so a graph per padded batch size can capture it (``mrv2/cuda_graphs.py``); the CPU path
is the same code. See notebooks/09_speculative_decoding.ipynb.
"""

from __future__ import annotations

import numpy as np
import torch

from mrv2.forward_context import AttentionMetadata, set_forward_context
from mrv2.models.qwen3 import bind_kv_cache, kv_cache_shape, model_dims
from mrv2.sample import SamplingMetadata
from mrv2.spec_decode.config import check_eagle_compatible
from mrv2.spec_decode.draft_model import batch_rows, filtered_probs
from mrv2.spec_decode.eagle_head import load_eagle_head
from mrv2.state import to_device_async


class EagleProposer:
    """K drafts per row from an EAGLE-1 head over the target's hidden states.

    Args:
        path: the head's folder (``eagle_head.load_eagle_head``).
        target: the target's ``ModelState`` (its embedding and lm_head are shared).
        target_hf_config: the target's Hugging Face config (checked against the head's).
        num_blocks, block_size: the target's KV pool (the head's cache mirrors it).
        max_model_len: the longest sequence.
        dtype, device: as the target's.
        keep_probs: keep each draft's filtered distribution q (``kept_probs``).

    Raises:
        ValueError: a head that does not fit the target (``check_eagle_compatible``) or a
            bad checkpoint.
    """

    def __init__(self, path: str, target, target_hf_config, num_blocks: int, block_size: int,
                 max_model_len: int, dtype: torch.dtype, device: torch.device,
                 keep_probs: bool = False):
        from mrv2.spec_decode.eagle_head import read_head_config

        check_eagle_compatible(target_hf_config, read_head_config(path), max_model_len)
        self.device = torch.device(device)
        self.head, cfg = load_eagle_head(path, dtype, self.device)
        self.kv_caches = [torch.zeros(kv_cache_shape(cfg, num_blocks, block_size), dtype=dtype,
                                      device=self.device)    # [2, blocks, bs, H_kv, D]
                          for _ in range(model_dims(cfg).num_layers)]
        bind_kv_cache(self.head, self.kv_caches)
        self.target = target
        self.max_model_len, self.block_size = max_model_len, block_size
        self.vocab_size = model_dims(target_hf_config).vocab_size
        self.keep_probs = keep_probs
        self.probs: torch.Tensor | None = None  # [R, K, V] float32, made at the first propose

    # -- shared pieces of the target ------------------------------------------------------

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """``[N, H]`` embeddings (the head's own table if it has one, else the target's)."""
        if self.head.embed_tokens is not None:
            return self.head.embed_tokens(token_ids)
        return self.target.model.get_input_embeddings(token_ids)

    def compute_logits(self, features: torch.Tensor) -> torch.Tensor:
        """``[N, V]`` logits through the target's lm_head (or the head's own)."""
        if self.head.lm_head is not None:
            return self.head.lm_head(features)
        return self.target.compute_logits(features)

    def _forward(self, token_ids, features, positions, md: AttentionMetadata) -> torch.Tensor:
        with set_forward_context(md):
            return self.head(self.embed(token_ids), features, positions)   # [N, H]

    # -- q for probabilistic verification ---------------------------------------------------

    def _probs_buffer(self, state) -> torch.Tensor:
        if self.probs is None:  # one q [K, V] per state row
            self.probs = torch.zeros(*state.draft_token_ids.shape, self.vocab_size,
                                     dtype=torch.float32, device=self.device)
        return self.probs

    def kept_probs(self, idx_mapping: torch.Tensor, state) -> torch.Tensor:
        """q ``[B * K, V]`` of the drafts now in the rows ``idx_mapping`` (``[B]``)."""
        return self._probs_buffer(state)[idx_mapping.long()].view(-1, self.vocab_size)

    # -- one target step's proposals ------------------------------------------------------

    def mirror(self, batch, state, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Step 1: the head over the target step's tokens (see the module docstring).

        Args:
            batch: the target step's ``InputBatch``.
            state: the ``RequestStateTable``, after verification appended the runs.
            hidden: ``[>= T, H]`` the target's hidden states of the step.

        Returns:
            ``(features [B, H], positions [B] int64)`` of each request's last valid pair.
        """
        num_reqs, num_tokens = batch.num_reqs, batch.num_tokens
        rows = batch.idx_mapping[:num_reqs].long()                          # [B]
        qsl = batch.query_start_loc[:num_reqs + 1].long()                   # [B + 1]
        pos = batch.positions[:num_tokens].long()                           # [T]
        req = torch.searchsorted(qsl[1:], torch.arange(num_tokens, device=pos.device),
                                 right=True)                                # [T] batch slot
        total = state.total_len[rows].long()                                # [B]
        valid = pos + 1 < total[req]                                        # [T]
        nxt = state.token_ids[rows[req], (pos + 1).clamp(max=self.max_model_len - 1)]  # [T]
        md = batch.attn_metadata
        # NOTE: rejected drafts write no KV (slot -1); their query rows are computed and
        # ignored. Valid pairs form a prefix of each request's tokens, so causal attention
        # of a valid query reads only valid keys.
        mirror_md = AttentionMetadata(
            query_start_loc=md.query_start_loc[:num_reqs + 1], seq_lens=md.seq_lens[:num_reqs],
            block_table=md.block_table[:num_reqs],
            slot_mapping=torch.where(valid, md.slot_mapping[:num_tokens], -1),
            max_query_len=md.max_query_len, max_seq_len=md.max_seq_len)
        feats = self._forward(nxt.to(torch.int32), hidden[:num_tokens],
                              batch.positions[:num_tokens], mirror_md)      # [T, H]
        # The last valid pair of each request: position total_len - 2 (a partial prefill
        # chunk: its last token).
        first = pos[qsl[:-1]]                                               # [B]
        n = qsl[1:] - qsl[:-1]                                              # [B]
        last = qsl[:-1] + torch.minimum((total - 2 - first).clamp(min=0), n - 1)  # [B]
        return feats[last], pos[last]

    def _chain_step(self, tok, feat, pos32, slots, block_table, max_seq_len: int):
        """One chained step on ``[B]``-shaped tensors: ``(features [B, H], logits [B, V])``.

        Static shapes, no host values but ``max_seq_len`` (a bound): the unit a CUDA graph
        per padded batch size would capture.
        """
        b = tok.shape[0]
        md = AttentionMetadata(
            query_start_loc=torch.arange(b + 1, dtype=torch.int32, device=tok.device),
            seq_lens=pos32 + 1, block_table=block_table, slot_mapping=slots,
            max_query_len=1, max_seq_len=max_seq_len)
        feat = self._forward(tok.to(torch.int32), feat, pos32, md)           # [B, H]
        return feat, self.compute_logits(feat)                              # [B, V]

    def propose(self, batch, runner, k: int, meta: SamplingMetadata,
                hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Mirror the target step, then K - 1 chained steps; ``[B, K]`` int32 drafts.

        Args:
            batch: the target step's ``InputBatch`` (its buffers still hold its inputs).
            runner: the ``ModelRunner`` (state table, block tables, sampler).
            k: K.
            meta: the batch's sampling flags (greedy / top-k-top-p).
            hidden: ``[>= T, H]`` the target's hidden states of this step (on the device).
        """
        if hidden is None:
            raise ValueError("the EAGLE proposer needs the target's hidden states")
        state, num_reqs = runner.state, batch.num_reqs
        idx_mapping = batch.idx_mapping[:num_reqs]
        rows = idx_mapping.long()
        rows_np = np.asarray(batch_rows(runner, batch), dtype=np.int64)
        capacity = to_device_async(runner.block_tables.num_blocks[rows_np] * self.block_size,
                                   self.device)                             # [B]
        temp = state.temperature[rows]                                      # [B]
        feat, pos = self.mirror(batch, state, hidden)                       # [B, H], [B]
        logits = self.compute_logits(feat)                                  # [B, V]
        query_start_loc = torch.arange(num_reqs + 1, dtype=torch.int32, device=self.device)
        max_seq_len = min(batch.attn_metadata.max_seq_len + k, self.max_model_len)
        drafts, probs = [], []
        tok = live = None  # draft i's token and liveness, from step i - 1
        for i in range(k):
            if i > 0:  # a chained step at the next position, from the last draft
                pos = pos + 1                                               # [B]
                live = (pos < self.max_model_len) & (pos < capacity)
                pos32 = pos.clamp(max=self.max_model_len - 1).to(torch.int32)
                slots = runner.block_tables.compute_slot_mappings(
                    idx_mapping, query_start_loc, pos32, num_reqs, num_reqs)  # [B]
                feat, logits = self._chain_step(tok, feat, pos32, torch.where(live, slots, -1),
                                                batch.block_table[:num_reqs], max_seq_len)
            if meta.needs_top_k_top_p:
                logits = logits.float()
            # NOTE: the token sampled from the pair at p sits at p + 2 (the pair's token is
            # p + 1): the target's noise at that position, so coupled drafts.
            tok = runner.sampler.sample_tokens(logits, idx_mapping, state, pos + 2, meta)  # [B]
            drafts.append(tok if i == 0 else torch.where(live, tok, -1))
            if self.keep_probs:  # the logits are masked in place by top-k / top-p / min-p
                probs.append(filtered_probs(logits, temp, tok))             # [B, V]
        if self.keep_probs and num_reqs:
            self._probs_buffer(state)[rows] = torch.stack(probs, dim=1)     # [B, K, V]
        return torch.stack(drafts, dim=1).to(torch.int32)                   # [B, K]
