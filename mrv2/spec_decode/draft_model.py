"""The draft-model proposer: a small model with the target's tokenizer, on its own KV cache.

The draft shares everything but weights and KV with the target: the same state rows, the
same KV block ids (its own paged cache has as many blocks as the target's, so a slot means
the same token in both), the same gathered block table. Per target step:

1. **mirror**: one forward pass over the target step's very inputs (``input_ids``,
   ``positions``, ``slot_mapping``) fills the draft's KV for every token the target saw
   (prefill chunks included);
2. **K chained single-token steps** from the row's next token (``token_ids[row,
   num_computed]``: the bonus or correction token after verification): each samples the
   next draft with the *target's* sampler and (seed, position) noise, so a draft that
   agrees with the target's distribution proposes the target's very sample (coupled noise:
   sampled requests keep a high acceptance under ``exact`` verification).

In ``probabilistic`` mode (``keep_probs``) the proposer also keeps, per state row, the
filtered draft distribution q ``[K, V]`` each draft was sampled from (the target row's
temperature / top-k / top-p / min-p over the draft's logits; greedy rows: a point mass at
the draft): ``probabilistic_verify`` needs q(x). The drafts may keep the (seed, position)
stream-0 noise: a Gumbel-max sample is an exact sample of q whatever the noise, and the
verification draws its uniforms and residual noise from streams 1 and 2.

Everything is on the device; the only CPU input is each slot's KV capacity (allocated
blocks x block size): a chained step past it writes nothing (a worse draft, never a
wrong output, since verification is exact). The scheduler allocates K lookahead slots so
that this rarely happens.

**CUDA graphs.** The draft's ``1 + K`` forward passes per target step are hundreds of tiny
launches, several times the target's own step when run eagerly. With graphs on, the
proposer holds two ``CudaGraphManager`` of its own (``capture_cuda_graphs``):

* the **mirror** replays the draft's graph of the very key the target step replayed
  (decode, speculating decode or prefill): the same static input buffers, so the padded
  batch the target saw is the padded batch the draft sees;
* the **chain** is one graph per decode batch size holding the *whole* K-step loop:
  gathers from the state rows, slot mappings, K forwards, the sampler and, with
  ``keep_probs``, the q writes. Its static inputs are the runner's ``idx_mapping``, the
  gathered block table, the state table and this proposer's capacity buffer; padding
  slots get capacity 0, so they write no KV, no q (a scratch row) and draft -1. The
  sampling flags of the batch would change the kernels, so the graph always samples the
  general way (top-k / top-p / min-p filter, then Gumbel-max: a greedy row's argmax),
  right for every batch; the eager path keeps the batch's flags.

A batch larger than every graph runs eagerly, as on the CPU. The pattern (a manager per
proposer, ``capture(prepare, forward)`` once, ``run(key, eager)`` per step, padding
slots neutralised by a device-side mask) is what another proposer (EAGLE) reuses.
"""

from __future__ import annotations

import numpy as np
import torch

from mrv2.cuda_graphs import CudaGraphManager
from mrv2.forward_context import AttentionMetadata
from mrv2.kernels.gumbel import GREEDY_TEMPERATURE
from mrv2.model_state import ModelState
from mrv2.sample import SamplingMetadata
from mrv2.state import to_device_async

#: The chain graph's sampling flags: the general path, right for any batch (see above).
GRAPH_META = SamplingMetadata(all_greedy=False, needs_top_k_top_p=True)


class KeptProbs:
    """The drafts' filtered distributions q, kept for probabilistic verification.

    A proposer sets ``probs = None``, ``vocab_size`` and ``device``. The buffer holds one
    ``[K, V]`` q per state row (the rows of ``state.draft_token_ids``) and a scratch row
    that the padding slots of a graph write instead of a live row.
    """

    probs: torch.Tensor | None
    vocab_size: int
    device: torch.device

    def _probs_buffer(self, state) -> torch.Tensor:
        if self.probs is None:  # [R + 1, K, V] float32; row R: scratch
            num_rows, k = state.draft_token_ids.shape
            self.probs = torch.zeros(num_rows + 1, k, self.vocab_size,
                                     dtype=torch.float32, device=self.device)
        return self.probs

    def kept_probs(self, idx_mapping: torch.Tensor, state) -> torch.Tensor:
        """q ``[B * K, V]`` of the drafts now in the rows ``idx_mapping`` (``[B]``).

        Args:
            idx_mapping: int32 ``[B]`` the batch's state rows.
            state: the ``RequestStateTable`` (its ``draft_token_ids`` gives ``[R, K]``).
        """
        return self._probs_buffer(state)[idx_mapping.long()].view(-1, self.vocab_size)

    def _store_probs(self, state, rows: torch.Tensor, capacity: torch.Tensor,
                     probs: list[torch.Tensor], first: int = 0) -> None:
        """Write a chain's q (``K - first`` tensors ``[B, V]``) at draft positions ``first..``.

        NOTE: padding slots (capacity 0) write the scratch row, never a live row's q.
        """
        buf = self._probs_buffer(state)
        dest = torch.where(capacity > 0, rows, buf.shape[0] - 1)            # [B]
        buf[dest, first:] = torch.stack(probs, dim=1)                       # [B, K - first, V]


class ChainSlots:
    """The chained steps' per-slot static inputs, shared by the draft model and EAGLE.

    A proposer sets ``device``, ``block_size`` and ``_capacity = None``. Then
    ``_capacity`` (``[R_max]`` int64) holds each batch slot's KV capacity in tokens (0: a
    padding slot, nothing live) and ``_query_start_loc`` (``[R_max + 1]`` int32) the arange
    of one query token per slot: with the runner's ``idx_mapping`` and gathered block table
    they are everything a chain graph reads besides the state table.
    """

    _capacity: torch.Tensor | None
    _query_start_loc: torch.Tensor | None
    device: torch.device
    block_size: int

    def _slot_buffers(self, max_num_reqs: int) -> None:
        if self._capacity is None:
            self._capacity = torch.zeros(max_num_reqs, dtype=torch.int64, device=self.device)
            self._query_start_loc = torch.arange(max_num_reqs + 1, dtype=torch.int32,
                                                 device=self.device)

    def _load_capacity(self, runner, batch, num_rows: int) -> None:
        """Each slot's capacity (allocated blocks x block size; padding slots up to
        ``num_rows``: 0) into the static buffer, in one host->device copy (no sync)."""
        capacity = np.zeros(num_rows, dtype=np.int64)                       # [B_pad]
        rows_np = np.asarray(batch_rows(runner, batch), dtype=np.int64)
        capacity[:batch.num_reqs] = runner.block_tables.num_blocks[rows_np] * self.block_size
        self._capacity[:num_rows].copy_(to_device_async(capacity, self.device),
                                        non_blocking=True)

    def _chain_slots(self, runner, num_rows: int) -> tuple[torch.Tensor, ...]:
        """``(idx_mapping [B], rows [B] int64, capacity [B], query_start_loc [B + 1],
        block_table [B, blocks])`` of the first ``num_rows`` slots (static buffers only)."""
        idx_mapping = runner.buffers.idx_mapping[:num_rows]                 # [B]
        return (idx_mapping, idx_mapping.long(), self._capacity[:num_rows],
                self._query_start_loc[:num_rows + 1],
                runner.block_tables.input_block_table[:num_rows])           # [B, blocks]


def one_token_step(runner, idx_mapping: torch.Tensor, query_start_loc: torch.Tensor,
                   block_table: torch.Tensor, pos: torch.Tensor, capacity: torch.Tensor,
                   max_model_len: int, max_seq_len: int
                   ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """The attention metadata of one chained draft step: one query token per batch slot.

    Args:
        runner: the ``ModelRunner`` (its block tables give the slot mapping).
        idx_mapping: ``[B]`` the slots' state rows; ``query_start_loc``: ``[B + 1]`` arange.
        block_table: ``[B, blocks]`` the gathered block table.
        pos: ``[B]`` int64 position of each slot's token.
        capacity: ``[B]`` each slot's KV capacity in tokens (0: padding, nothing live).
        max_model_len, max_seq_len: the bounds (``max_seq_len`` for the attention launch).

    Returns:
        ``live`` ``[B]`` bool (the slot has a KV slot: its draft counts), ``pos32`` ``[B]``
        int32 (clamped), and the step's metadata (slots not live write no KV).
    """
    live = (pos < max_model_len) & (pos < capacity)                          # [B]
    pos32 = pos.clamp(max=max_model_len - 1).to(torch.int32)                 # [B]
    num_rows = pos.shape[0]
    slots = runner.block_tables.compute_slot_mappings(
        idx_mapping, query_start_loc, pos32, num_rows, num_rows)            # [B]
    md = AttentionMetadata(
        query_start_loc=query_start_loc, seq_lens=pos32 + 1, block_table=block_table,
        slot_mapping=torch.where(live, slots, -1), max_query_len=1, max_seq_len=max_seq_len)
    return live, pos32, md


class DraftModelProposer(KeptProbs, ChainSlots):
    """K drafts per row from a small model (see the module docstring).

    Args:
        path: the draft's Hugging Face folder.
        target_vocab_size: the target's vocabulary (the draft must have the same).
        num_blocks, block_size: the target's KV pool (the draft's cache mirrors it).
        max_model_len: the longest sequence.
        dtype, device: as the target's.
        keep_probs: keep each draft's filtered distribution q (``kept_probs``).
    """

    def __init__(self, path: str, target_vocab_size: int, num_blocks: int, block_size: int,
                 max_model_len: int, dtype: torch.dtype, device: torch.device,
                 keep_probs: bool = False):
        from mrv2.models.loader import load_model

        model, cfg = load_model(path, dtype, device)
        draft_vocab = ModelState.model_dims(cfg).vocab_size
        if draft_vocab != target_vocab_size:
            raise ValueError(f"speculative_config['model']={path!r} has vocab size "
                             f"{draft_vocab}, the target {target_vocab_size}: "
                             "the draft must share the target's tokenizer")
        # Its own paged KV cache, indexed by the target's block ids.
        self.kv_caches = ModelState.make_kv_caches(model, cfg, num_blocks, block_size, dtype,
                                                   torch.device(device))
        self.model_state = ModelState(model, max_model_len)
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.device = torch.device(device)
        self.keep_probs = keep_probs
        self.vocab_size = target_vocab_size
        self.probs: torch.Tensor | None = None  # [R + 1, K, V] float32; row R: scratch
        self.graphs: CudaGraphManager | None = None        # the mirror's, by target key
        self.chain_graphs: CudaGraphManager | None = None  # the K-step loop's, by batch size
        self._capacity: torch.Tensor | None = None         # [max_num_reqs] int64, static
        self._query_start_loc: torch.Tensor | None = None  # [max_num_reqs + 1] int32 arange

    def _static_buffers(self, runner) -> None:
        self._slot_buffers(runner.max_num_reqs)
        if self.keep_probs:
            self._probs_buffer(runner.state)

    def capture_cuda_graphs(self, runner, make_dummy_batch, k: int,
                            progress: bool = False) -> None:
        """Capture the mirror at every key of the target and the K-step loop per size.

        Args:
            runner: the ``ModelRunner`` whose ``cuda_graphs`` gives the keys (and
                ``emulate``); its static buffers are the graphs' inputs.
            make_dummy_batch: writes an all-padding batch of a key's shape (the runner's).
            k: K.
            progress: show a progress bar.
        """
        target = runner.cuda_graphs
        self._static_buffers(runner)
        self.graphs = CudaGraphManager(target.sizes, target.prefill_sizes, target.spec_sizes,
                                       emulate=target.emulate)
        self.model_state.capture_cuda_graphs(self.graphs, make_dummy_batch, progress)
        self.chain_graphs = CudaGraphManager(target.sizes, emulate=target.emulate)

        def prepare(size: int) -> int:
            make_dummy_batch(size)   # idx_mapping -> row 0, zeroed block-table rows
            self._capacity.zero_()   # nothing live: the warm-up writes no KV and no q
            return size

        self.chain_graphs.capture(
            prepare, lambda size, _: self._chain(runner, k, size, GRAPH_META, self.max_model_len),
            progress=progress)

    def propose(self, batch, runner, k: int, meta: SamplingMetadata,
                graph_size=None) -> torch.Tensor:
        """Mirror the target step, then K chained steps; ``[B, K]`` int32 drafts.

        Args:
            batch: the target step's ``InputBatch`` (its buffers still hold its inputs).
            runner: the ``ModelRunner`` (state table, block tables, sampler).
            k: K.
            meta: the batch's sampling flags (greedy / top-k-top-p; eager steps only).
            graph_size: the graph key the target step replayed (``None``: it ran eagerly
                on an unpadded batch); the mirror replays the draft's graph of that key.
        """
        num_reqs = batch.num_reqs
        self._static_buffers(runner)
        # 1. The target's inputs, through the draft: its KV for every token of the step.
        self.model_state.run(batch, graph_size)
        # 2. Chained single-token steps from the next token of each row.
        key = (None if self.chain_graphs is None
               else self.chain_graphs.padded_size(num_reqs, num_reqs))
        self._load_capacity(runner, batch, num_reqs if key is None else key)
        if key is None:
            max_seq_len = min(batch.attn_metadata.max_seq_len + k, self.max_model_len)
            return self._chain(runner, k, num_reqs, meta, max_seq_len)
        drafts = self.chain_graphs.run(
            key, lambda: self._chain(runner, k, key, GRAPH_META, self.max_model_len))
        return drafts[:num_reqs]                                            # [B, K]

    def _chain(self, runner, k: int, num_rows: int, meta: SamplingMetadata,
               max_seq_len: int) -> torch.Tensor:
        """The K chained steps over the first ``num_rows`` batch slots (static buffers only:
        the body of the chain graph); ``[num_rows, K]`` int32 drafts, -1 where not live."""
        state = runner.state
        idx_mapping, rows, capacity, query_start_loc, block_table = self._chain_slots(
            runner, num_rows)
        start = state.num_computed_tokens[rows].long()                      # [B]
        tok = state.token_ids[rows, start.clamp(max=self.max_model_len - 1)]  # [B]
        temp = state.temperature[rows]                                      # [B]
        drafts, probs = [], []
        for i in range(k):
            pos = start + i                                                 # [B]
            live, pos32, step_md = one_token_step(
                runner, idx_mapping, query_start_loc, block_table, pos, capacity,
                self.max_model_len, max_seq_len)
            hidden = self.model_state.forward(tok.to(torch.int32), pos32, step_md)
            logits = self.model_state.compute_logits(hidden)                # [B, V]
            if meta.needs_top_k_top_p:
                logits = logits.float()
            # NOTE: the target's sampler and noise at the draft's position: coupled drafts.
            tok = runner.sampler.sample_tokens(logits, idx_mapping, state, pos + 1, meta)  # [B]
            drafts.append(torch.where(live, tok, -1))
            if self.keep_probs:  # the logits are masked in place by top-k / top-p / min-p
                probs.append(filtered_probs(logits, temp, tok))             # [B, V]
        if self.keep_probs and num_rows:
            self._store_probs(state, rows, capacity, probs)                 # q of drafts 1..K
        return torch.stack(drafts, dim=1).to(torch.int32)                   # [B, K]


def filtered_probs(masked: torch.Tensor, temperature: torch.Tensor, sampled: torch.Tensor
                   ) -> torch.Tensor:
    """The distribution a row was sampled from: ``softmax(masked / T)``; greedy: one-hot.

    Args:
        masked: ``[B, V]`` logits after the top-k / top-p / min-p mask.
        temperature: ``[B]`` each row's temperature (below ``GREEDY_TEMPERATURE``: greedy).
        sampled: ``[B]`` the row's sample (a greedy row's argmax).

    Returns:
        ``[B, V]`` float32.
    """
    greedy = temperature < GREEDY_TEMPERATURE                               # [B]
    s = masked.float() / torch.where(greedy, 1.0, temperature)[:, None]    # [B, V]
    p = torch.softmax(s, dim=-1)
    one_hot = torch.nn.functional.one_hot(sampled.long(), s.shape[1]).to(torch.float32)
    return torch.where(greedy[:, None], one_hot, p)


def batch_rows(runner, batch) -> list[int]:
    """The state rows of the batch, on the CPU (the runner knows them)."""
    return [runner.state.row_of(r) for r in batch.req_ids]

