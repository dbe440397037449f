"""The EAGLE proposer: a one-layer head that drafts from the target's own hidden states.

A draft model guesses the next tokens from the tokens alone; an EAGLE head reads what the
target already computed, its last-layer hidden state ``h_p`` (``eagle_head.py``), so one
small layer suffices. Per target step, on the device and in stream order:

1. **mirror** (one pass over the target step's tokens; with graphs, a graph per target
   key reading the target graph's static hidden-state output): token ``j``
   at position ``p`` of state row ``r`` gives the head the pair ``(token_ids[r, p + 1],
   h_p)``: the *next* token, read from the state table after verification appended the
   accepted run, beside the target's hidden state of ``j``. The pair is valid while
   ``p + 1 < total_len[r]``; that covers every prefill token and every accepted draft,
   and excludes exactly the rejected drafts (their hidden states saw wrong tokens), whose
   KV writes are masked (slot -1) and later overwritten. So the accepted tokens' features
   come in as the draft model's accepted tokens do: the same step's pass, no bookkeeping.
   The head's output at each request's last valid token (position ``total_len - 2``, the
   pair with the bonus / correction token) gives **draft 1**.
2. **the chain** (``_chain``: static buffers and ``[B]`` shapes, the seam for CUDA
   graphs): draft 1 from the mirror's feature, then K - 1 single-token steps where the
   head's own output feature and the last draft go back in at the next position. Each
   draft is sampled with the target's sampler and (seed, position) noise (coupled drafts, as ``draft_model.py``), keeping q for ``probabilistic`` verification.

The hidden states come from the runner as the tensor ``ModelState.run`` returned (no copy,
no sync). The head's paged KV cache uses the target's block ids, block tables and state
rows; the only CPU input is each slot's KV capacity. K forwards per step (the draft model
needs K + 1). ``_chain`` reads only fixed buffers and has ``[B]`` shapes, so on a GPU
``capture_cuda_graphs`` records it once per decode graph size (as the draft model's chain)
and a step replays the graph of its padded batch; the CPU path is the same code, eager. See notebooks/09_speculative_decoding.ipynb.
"""

from __future__ import annotations

import torch

from mrv2.forward_context import AttentionMetadata, set_forward_context
from mrv2.models.qwen3 import bind_kv_cache, kv_cache_shape, model_dims
from mrv2.sample import SamplingMetadata
from mrv2.spec_decode.config import check_eagle_compatible
from mrv2.spec_decode.draft_model import ChainSlots, KeptProbs, filtered_probs, one_token_step
from mrv2.spec_decode.eagle_head import load_eagle_head

#: The sampling flags a captured chain uses: the general path, right for every row.
_GRAPH_META = SamplingMetadata(all_greedy=False, needs_top_k_top_p=True)


class EagleProposer(KeptProbs, ChainSlots):
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
        self.probs: torch.Tensor | None = None  # [R + 1, K, V] float32, made at first use
        self._feat: torch.Tensor | None = None  # the chain's static inputs (_static_buffers)
        self._capacity: torch.Tensor | None = None  # the slots' (ChainSlots)
        self.graphs = None        # a CudaGraphManager of the mirror, by the target's key
        self.chain_graphs = None  # a CudaGraphManager of the chain (capture_cuda_graphs)

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

    # -- one target step's proposals ------------------------------------------------------

    def mirror(self, batch, state, hidden: torch.Tensor, graph_size=None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Step 1: the head over the target step's tokens (see the module docstring).

        Args:
            batch: the target step's ``InputBatch``.
            state: the ``RequestStateTable``, after verification appended the runs.
            hidden: ``[>= T, H]`` the target's hidden states of the step.
            graph_size: the target step's graph key: run over its padded shapes and bounds
                (the body of the mirror's graph); ``None``: the real sizes.

        Returns:
            ``(features [B, H], positions [B] int64)`` of each request's last valid pair
            (``B``, ``T``: padded with ``graph_size``; padding slots give garbage).
        """
        if graph_size is None:
            num_reqs, num_tokens, md = batch.num_reqs, batch.num_tokens, batch.attn_metadata
        else:
            num_reqs, num_tokens = batch.num_reqs_padded, batch.num_tokens_padded
            md = self.target.prepare_attn(batch, graph_size)  # the graph's host bounds
        rows = batch.idx_mapping[:num_reqs].long()                          # [B]
        qsl = batch.query_start_loc[:num_reqs + 1].long()                   # [B + 1]
        pos = batch.positions[:num_tokens].long()                           # [T]
        # NOTE: padding tokens (t >= qsl[B]) would search past the last slot: clamp (their
        # KV slot is -1 anyway); real tokens are unchanged.
        req = torch.searchsorted(qsl[1:], torch.arange(num_tokens, device=pos.device),
                                 right=True).clamp(max=num_reqs - 1)        # [T] batch slot
        total = state.total_len[rows].long()                                # [B]
        valid = pos + 1 < total[req]                                        # [T]
        nxt = state.token_ids[rows[req], (pos + 1).clamp(max=self.max_model_len - 1)]  # [T]
        # NOTE: a prefix-cache hit reuses the head's KV of the cached blocks too; the pair at
        # a block's last position holds the *next* block's first token, so a request that
        # shares the block but not that token gets a slightly worse draft (never a wrong
        # output: verification decides). Rejected drafts write no KV (slot -1); their query rows are computed and
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
        first = pos[qsl[:-1].clamp(max=num_tokens - 1)]                     # [B]
        n = qsl[1:] - qsl[:-1]                                              # [B]
        last = qsl[:-1] + torch.minimum((total - 2 - first).clamp(min=0), n - 1)  # [B]
        return feats[last], pos[last]

    def _static_buffers(self, runner) -> None:
        """The chained steps' inputs, in fixed buffers (``[max_num_reqs]`` rows)."""
        if self._feat is None:
            n, hidden = runner.max_num_reqs, self.head.fc.out_features
            self._feat = torch.zeros(n, hidden, dtype=self.head.fc.weight.dtype,
                                     device=self.device)                   # [R_max, H]
            self._pos = torch.zeros(n, dtype=torch.int64, device=self.device)
        self._slot_buffers(runner.max_num_reqs)

    def propose(self, batch, runner, k: int, meta: SamplingMetadata, graph_size=None,
                hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Mirror the target step, then the chain (drafts 1 .. K); ``[B, K]`` int32.

        Args:
            batch: the target step's ``InputBatch`` (its buffers still hold its inputs).
            runner: the ``ModelRunner`` (state table, block tables, sampler).
            k: K.
            meta: the batch's sampling flags (greedy / top-k-top-p).
            graph_size: the target step's graph key (``None``: eager); the mirror replays
                its graph of that key when the target replayed its own.
            hidden: ``[>= T, H]`` the target's hidden states of this step (on the device).
        """
        if hidden is None:
            raise ValueError("the EAGLE proposer needs the target's hidden states")
        num_reqs = batch.num_reqs
        self._static_buffers(runner)
        key = (None if self.chain_graphs is None
               else self.chain_graphs.padded_size(num_reqs, num_reqs))
        # Padding slots get capacity 0: nothing live (their drafts are dropped).
        self._load_capacity(runner, batch, num_reqs if key is None else key)
        feat, pos = self._run_mirror(batch, runner, hidden, graph_size)     # [B, H], [B]
        # NOTE: draft 1 (logits of the mirror's feature, its sample) is the chain's first
        # step, so a graph replays it too: the mirror only fills the chain's inputs.
        self._feat[:num_reqs].copy_(feat)
        self._pos[:num_reqs].copy_(pos)
        if key is None:
            max_seq_len = min(batch.attn_metadata.max_seq_len + k, self.max_model_len)
            return self._chain(runner, k, num_reqs, meta, max_seq_len)        # [B, K]
        return self.chain_graphs.run(key, lambda: self._chain(
            runner, k, key, _GRAPH_META, self.max_model_len))[:num_reqs]     # [B, K]

    def _run_mirror(self, batch, runner, hidden: torch.Tensor, graph_size
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The mirror: its graph of the target's key, or eagerly; ``[B, H]``, ``[B]``."""
        num_reqs = batch.num_reqs
        if graph_size is None or self.graphs is None:
            return self.mirror(batch, runner.state, hidden)
        if not self.graphs.emulate:
            # NOTE: the graph reads the target graph's static output; a step whose hidden
            # states live elsewhere (the target ran eagerly) must not replay it.
            captured = runner.cuda_graphs.graphs.get(graph_size)
            if captured is None or captured[1].data_ptr() != hidden.data_ptr():
                self.graphs.num_eager["mismatch"] += 1
                return self.mirror(batch, runner.state, hidden)
        feat, pos = self.graphs.run(graph_size, lambda: self.mirror(
            batch, runner.state, hidden, graph_size))                      # [B_pad, H], [B_pad]
        return feat[:num_reqs], pos[:num_reqs]

    def capture_cuda_graphs(self, runner, make_dummy_batch, k: int,
                            progress: bool = False) -> None:
        """Capture the mirror at every key of the target, and the chain (drafts 1 .. K) per
        decode graph size of the runner (GPU only; ``emulate``: nothing captured).

        The mirror's graph of a key reads the target graph's static hidden-state output of
        that key (captured first, ``ModelRunner.capture_cuda_graphs``), as the draft model's
        mirror replays the target's key. Chain graphs sample with the general path (top-k /
        top-p / min-p on: correct for every row, greedy ones included). Nothing is captured
        without the runner's graphs.

        Args:
            runner: the ``ModelRunner`` (its ``cuda_graphs`` sizes and static buffers).
            make_dummy_batch: writes an all-padding batch of a size (the runner's).
            k: K.
            progress: show a progress bar.
        """
        target = runner.cuda_graphs
        if not target.sizes:
            return
        from mrv2.cuda_graphs import CudaGraphManager

        self._static_buffers(runner)
        if self.keep_probs:
            self._probs_buffer(runner.state)
        self.graphs = CudaGraphManager(target.sizes, target.prefill_sizes, target.spec_sizes,
                                       emulate=target.emulate)
        self.graphs.capture(make_dummy_batch, lambda batch, key: self.mirror(
            batch, runner.state, target.graphs[key][1], key), progress=progress)
        graphs = CudaGraphManager(list(target.sizes), emulate=target.emulate)

        def prepare(size: int) -> int:
            make_dummy_batch(size)   # idx_mapping -> padding rows, zeroed block-table rows
            self._capacity.zero_()   # nothing live: the warm-up writes no KV and no q
            return size

        graphs.capture(prepare, lambda size, _: self._chain(runner, k, size, _GRAPH_META,
                                                            self.max_model_len),
                       progress=progress)
        self.chain_graphs = graphs

    def _chain(self, runner, k: int, num_rows: int, meta: SamplingMetadata,
               max_seq_len: int) -> torch.Tensor:
        """Drafts 1 .. K over the first ``num_rows`` batch slots, from the static buffers.

        Draft 1 is sampled from the mirror's feature (``_feat``, at ``_pos``); drafts 2 .. K
        each run the head one position on, with its own output feature and the last draft.
        Every input is a fixed buffer (``_feat``, ``_pos``, ``_capacity``, the runner's
        ``idx_mapping`` and gathered block table) and every shape is ``[num_rows]``: the
        body a CUDA graph per padded batch size can capture, as the draft model's chain is
        (padding slots: capacity 0, nothing live, nothing written).

        Returns:
            ``[num_rows, K]`` int32 drafts, -1 where not live.
        """
        state = runner.state
        idx_mapping, rows, capacity, query_start_loc, block_table = self._chain_slots(
            runner, num_rows)
        feat, pos = self._feat[:num_rows], self._pos[:num_rows]
        temp = state.temperature[rows]                                      # [B]
        live = capacity > 0                                                 # [B] real slots
        drafts, probs, tok = [], [], None
        for i in range(k):
            if i > 0:
                pos = pos + 1                                               # [B]
                live, pos32, md = one_token_step(
                    runner, idx_mapping, query_start_loc, block_table, pos, capacity,
                    self.max_model_len, max_seq_len)
                # The head's own feature and the last draft, one position on.
                feat = self._forward(tok.to(torch.int32), feat, pos32, md)   # [B, H]
            logits = self.compute_logits(feat)                              # [B, V]
            if meta.needs_top_k_top_p:
                logits = logits.float()
            # NOTE: the token sampled from the pair at p sits at p + 2 (the pair's token is
            # at p + 1): the target's noise at that position, so coupled drafts.
            tok = runner.sampler.sample_tokens(logits, idx_mapping, state, pos + 2, meta)
            drafts.append(torch.where(live, tok, -1))
            if self.keep_probs:  # the logits are masked in place by top-k / top-p / min-p
                probs.append(filtered_probs(logits, temp, tok))             # [B, V]
        if self.keep_probs and num_rows:
            self._store_probs(state, rows, capacity, probs)                 # q of drafts 1..K
        return torch.stack(drafts, dim=1).to(torch.int32)                   # [B, K]
