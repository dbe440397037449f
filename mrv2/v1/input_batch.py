"""V1's persistent batch: row order *is* the batch order and the block-table layout.

``InputBatch`` keeps one row per request that runs this step, in CPU numpy arrays
(token ids, token counts, ``num_computed_tokens``, sampling knobs) plus the
block table (block_table.py). A new request takes the first empty row; a removed
one leaves a hole, and ``condense()`` moves the last rows into the holes so the
live rows are ``0..num_reqs-1`` again; ``swap_states`` exchanges two rows to put
them in the scheduler's order. Every move copies a request's token ids, block ids
and knobs: host work that grows with churn in the batch. Compare mrv2/state.py,
where a request's row never moves. See notebooks/02_stable_state_table.ipynb.
"""

from __future__ import annotations

import numpy as np
import torch

from mrv2.v1.block_table import BlockTable
from mrv2.v1.request_state import CachedRequestState
from mrv2.v1.sampler import SamplingMetadata


class InputBatch:
    """The persistent batch of the V1 runner (CPU arrays + device mirrors).

    Args:
        max_num_reqs: rows.
        max_model_len: columns of ``token_ids_cpu``.
        max_num_batched_tokens: token budget of one step (slot-mapping size).
        block_size: tokens per KV block.
        vocab_size: the model's vocabulary (``top_k`` off is stored as ``vocab_size``).
        device: where the sampling knobs and the block table are mirrored.
    """

    def __init__(self, max_num_reqs: int, max_model_len: int, max_num_batched_tokens: int,
                 block_size: int, vocab_size: int, device: torch.device):
        self.max_num_reqs, self.vocab_size, self.device = max_num_reqs, vocab_size, device
        self._pin = device.type == "cuda"
        self._req_ids: list[str | None] = []      # row -> request id; None marks a hole
        self.req_id_to_index: dict[str, int] = {}
        self._holes: list[int] = []               # empty rows below len(_req_ids)

        self.token_ids_cpu = np.zeros((max_num_reqs, max_model_len), dtype=np.int32)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_computed_tokens_cpu = np.zeros(max_num_reqs, dtype=np.int32)
        self.block_table = BlockTable(max_num_reqs, -(-max_model_len // block_size), block_size,
                                      max_num_batched_tokens, device)

        # Sampling knobs: numpy view, pinned CPU tensor, device copy (refreshed on change).
        self.temperature_cpu, self._temperature_cpu_t, self.temperature = \
            self._mirrored(torch.float32)
        self.top_p_cpu, self._top_p_cpu_t, self.top_p = self._mirrored(torch.float32)
        self.top_k_cpu, self._top_k_cpu_t, self.top_k = self._mirrored(torch.int32)
        self.min_p_cpu, self._min_p_cpu_t, self.min_p = self._mirrored(torch.float32)
        # Per-request facts kept by id (they need no moving) or by row (they do).
        self.greedy_reqs: set[str] = set()
        self.random_reqs: set[str] = set()
        self.top_p_reqs: set[str] = set()
        self.top_k_reqs: set[str] = set()
        self.min_p_reqs: set[str] = set()
        self.num_logprobs: dict[str, int] = {}
        self.generators: dict[int, torch.Generator] = {}
        self.min_tokens: dict[int, tuple[int, set[int]]] = {}
        self.req_output_token_ids: list[list[int] | None] = [None] * max_num_reqs
        # Arrays whose rows move with their request (token ids and the table separately).
        self._row_arrays = [self.num_tokens, self.num_prompt_tokens, self.num_computed_tokens_cpu,
                            self.temperature_cpu, self.top_p_cpu, self.top_k_cpu, self.min_p_cpu]
        self.batch_changed = True

    def _mirrored(self, dtype: torch.dtype):
        cpu = torch.zeros(self.max_num_reqs, dtype=dtype, pin_memory=self._pin)
        return cpu.numpy(), cpu, torch.zeros(self.max_num_reqs, dtype=dtype, device=self.device)

    # -- views ----------------------------------------------------------------------------

    @property
    def num_reqs(self) -> int:
        return len(self.req_id_to_index)

    @property
    def req_ids(self) -> list[str]:
        """Live request ids in row order (call after ``condense``: no holes)."""
        return [r for r in self._req_ids if r is not None]

    # -- add / remove -------------------------------------------------------------------

    def add_request(self, state: CachedRequestState) -> int:
        """Write ``state`` into the first empty row.

        Returns:
            The row it got.
        """
        if state.req_id in self.req_id_to_index:
            raise ValueError(f"request {state.req_id!r} is already in the batch")
        if self._holes:
            row = self._holes.pop(self._holes.index(min(self._holes)))
            self._req_ids[row] = state.req_id
        else:
            row = len(self._req_ids)
            if row >= self.max_num_reqs:
                raise ValueError(f"the batch is full ({self.max_num_reqs} rows)")
            self._req_ids.append(state.req_id)
        self.req_id_to_index[state.req_id] = row
        n_prompt, n_out = state.num_prompt_tokens, len(state.output_token_ids)
        self.token_ids_cpu[row, :n_prompt] = state.prompt_token_ids
        self.token_ids_cpu[row, n_prompt:n_prompt + n_out] = state.output_token_ids
        self.num_tokens[row] = n_prompt + n_out
        self.num_prompt_tokens[row] = n_prompt
        self.num_computed_tokens_cpu[row] = state.num_computed_tokens
        self.block_table.add_row(state.block_ids, row)
        self._add_sampling(state, row)
        self.batch_changed = True
        return row

    def _add_sampling(self, state: CachedRequestState, row: int) -> None:
        sp, req_id = state.sampling_params, state.req_id
        if sp.greedy:
            self.temperature_cpu[row] = 0.0  # NOTE: the sampler divides by 1 on such rows
            self.greedy_reqs.add(req_id)
        else:
            self.temperature_cpu[row] = sp.temperature
            self.random_reqs.add(req_id)
        self.top_p_cpu[row] = sp.top_p
        if sp.top_p < 1.0:
            self.top_p_reqs.add(req_id)
        k_on = 0 < sp.top_k < self.vocab_size
        self.top_k_cpu[row] = sp.top_k if k_on else self.vocab_size
        if k_on:
            self.top_k_reqs.add(req_id)
        self.min_p_cpu[row] = sp.min_p
        if sp.min_p > 0.0:
            self.min_p_reqs.add(req_id)
        if sp.logprobs is not None:
            self.num_logprobs[req_id] = self.vocab_size if sp.logprobs == -1 else sp.logprobs
        if state.generator is not None:
            self.generators[row] = state.generator
        if sp.min_tokens > 0 and sp.all_stop_token_ids:
            self.min_tokens[row] = (sp.min_tokens, set(sp.all_stop_token_ids))
        self.req_output_token_ids[row] = state.output_token_ids  # shared with the state

    def remove_request(self, req_id: str) -> int | None:
        """Empty ``req_id``'s row, leaving a hole (``None`` if it is not in the batch)."""
        row = self.req_id_to_index.pop(req_id, None)
        if row is None:
            return None
        self._req_ids[row] = None
        self._holes.append(row)
        for s in (self.greedy_reqs, self.random_reqs, self.top_p_reqs, self.top_k_reqs,
                  self.min_p_reqs):
            s.discard(req_id)
        self.num_logprobs.pop(req_id, None)
        self.generators.pop(row, None)
        self.min_tokens.pop(row, None)
        self.req_output_token_ids[row] = None
        self.batch_changed = True
        return row

    # -- moving rows ----------------------------------------------------------------------

    def condense(self) -> None:
        """Move the last live rows into the holes so the live rows are ``0..num_reqs-1``."""
        num_reqs = self.num_reqs
        last = len(self._req_ids) - 1
        for hole in sorted(self._holes):
            if hole >= num_reqs:
                break  # every later hole lies past the live rows: nothing to fill
            while self._req_ids[last] is None:
                last -= 1
            self._move_row(last, hole)
            last -= 1
        self._holes.clear()
        del self._req_ids[num_reqs:]

    def _move_row(self, src: int, tgt: int) -> None:
        req_id = self._req_ids[src]
        self._req_ids[tgt], self._req_ids[src] = req_id, None
        self.req_id_to_index[req_id] = tgt
        n = self.num_tokens[src]
        self.token_ids_cpu[tgt, :n] = self.token_ids_cpu[src, :n]
        for a in self._row_arrays:
            a[tgt] = a[src]
        self.block_table.move_row(src, tgt)
        for d in (self.generators, self.min_tokens):
            if src in d:
                d[tgt] = d.pop(src)
        self.req_output_token_ids[tgt] = self.req_output_token_ids[src]
        self.req_output_token_ids[src] = None
        self.batch_changed = True

    def swap_states(self, i1: int, i2: int) -> None:
        """Exchange rows ``i1`` and ``i2`` (both live) with everything they hold."""
        id1, id2 = self._req_ids[i1], self._req_ids[i2]
        self._req_ids[i1], self._req_ids[i2] = id2, id1
        self.req_id_to_index[id1], self.req_id_to_index[id2] = i2, i1
        n = max(self.num_tokens[i1], self.num_tokens[i2])
        self.token_ids_cpu[[i1, i2], :n] = self.token_ids_cpu[[i2, i1], :n]  # [2, n] copy
        for a in self._row_arrays:
            a[[i1, i2]] = a[[i2, i1]]
        self.block_table.swap_row(i1, i2)
        for d in (self.generators, self.min_tokens):
            v1, v2 = d.pop(i1, None), d.pop(i2, None)
            if v1 is not None:
                d[i2] = v1
            if v2 is not None:
                d[i1] = v2
        out = self.req_output_token_ids
        out[i1], out[i2] = out[i2], out[i1]
        self.batch_changed = True

    # -- sampling metadata --------------------------------------------------------------

    def make_sampling_metadata(self) -> SamplingMetadata:
        """The sampler's view of rows ``0..num_reqs-1``; knobs re-copied only on change."""
        n = self.num_reqs
        if self.batch_changed:
            # NOTE: non-blocking from pinned memory; safe because each V1 step ends in a sync.
            for cpu, dev in ((self._temperature_cpu_t, self.temperature),
                             (self._top_p_cpu_t, self.top_p), (self._top_k_cpu_t, self.top_k),
                             (self._min_p_cpu_t, self.min_p)):
                dev[:n].copy_(cpu[:n], non_blocking=True)
            self.batch_changed = False
        all_greedy = not self.random_reqs
        return SamplingMetadata(
            temperature=None if all_greedy else self.temperature[:n],
            all_greedy=all_greedy, all_random=not self.greedy_reqs,
            top_p=self.top_p[:n] if self.top_p_reqs else None,
            top_k=self.top_k[:n] if self.top_k_reqs else None,
            min_p=self.min_p[:n] if self.min_p_reqs else None,
            generators=self.generators,
            max_num_logprobs=max(self.num_logprobs.values()) if self.num_logprobs else None,
            min_tokens=self.min_tokens, output_token_ids=self.req_output_token_ids[:n])
