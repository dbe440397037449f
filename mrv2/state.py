"""Stable request-state table: one fixed row per live request.

V1 kept a persistent batch whose row order *was* the batch: adding or removing a
request swapped and condensed rows, and a ``CachedRequestState`` copy of every
request lived on the CPU. Here a request gets a row from a free list when it is
admitted and keeps it until it finishes; nothing ever moves. The device tensors
are the only truth (``num_computed_tokens``, the sampled tokens appended to
``token_ids``): after admission the CPU never reads them back, it only *writes*
new rows, staged and applied in one kernel launch per step. Each step then gathers
the rows it needs through ``idx_mapping`` (batch slot -> row). See
notebooks/02_stable_state_table.ipynb.
"""

from __future__ import annotations

import numpy as np
import torch

from mrv2.kernels.state_writes import FLOAT_PARAMS, NUM_META, apply_state_writes

#: Neutral sampling parameters: a key missing from ``add_request``'s ``sampling``
#: takes this value. ``top_k=-1`` means off; penalties 1.0/0/0 change nothing.
SAMPLING_DEFAULTS: dict[str, float | int] = {
    "temperature": 1.0, "top_k": -1, "top_p": 1.0, "min_p": 0.0, "seed": 0,
    "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
}

_INT32_MAX = 2**31 - 1


def to_device_async(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """Copy a freshly packed numpy array to ``device`` without blocking the CPU.

    Args:
        array: a contiguous numpy array the caller will not touch again.
        device: the target device.

    Returns:
        The device tensor (the very same memory when ``device`` is the CPU).
    """
    t = torch.from_numpy(array)
    if device.type != "cuda":
        return t
    # NOTE: a fresh pinned tensor per call: torch's caching host allocator only
    # reuses its memory after the copy that reads it has finished, so the CPU can
    # never overwrite bytes an in-flight copy is still reading.
    return t.pin_memory().to(device, non_blocking=True)


def packed_rows(num_meta: int, lengths) -> tuple[np.ndarray, np.ndarray, np.ndarray,
                                                     np.ndarray]:
    """The layout every staged write uses: ``n`` header rows, then all payloads back to back.

    One int32 buffer means one host->device copy for the whole batch of writes; the kernel
    finds row ``i``'s payload at ``tail[starts[i]:starts[i] + lengths[i]]``.

    Args:
        num_meta: int32 header fields per row.
        lengths: payload length of each of the ``n`` rows.

    Returns:
        ``(packed [n * num_meta + L], meta [n, num_meta], tail [L], starts [n])``:
        ``meta`` and ``tail`` are views of ``packed`` for the caller to fill,
        ``starts`` (int64) the offset of each payload in ``tail``.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    n = lengths.size
    starts = np.zeros(n, dtype=np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    packed = np.empty(n * num_meta + int(lengths.sum()), dtype=np.int32)
    return packed, packed[:n * num_meta].reshape(n, num_meta), packed[n * num_meta:], starts


class RequestStateTable:
    """Per-request device state in fixed rows, handed out from a CPU free list.

    Args:
        max_num_reqs: rows in the table (the most requests alive at once).
        max_model_len: the longest sequence (prompt + output) a row can hold.
        device: where the table lives.
        num_speculative_tokens: K, the draft slots per row (0: no speculative decoding).

    Attributes (device tensors, ``R = max_num_reqs``):
        token_ids: int32 ``[R, max_model_len]``, prefill tokens then sampled tokens.
        prompt_len, prefill_len, total_len, num_computed_tokens, last_sampled_token,
        top_k: int32 ``[R]``.
        float_params: f32 ``[len(FLOAT_PARAMS), R]``; ``temperature``, ``top_p``,
            ``min_p``, ``repetition_penalty``, ``presence_penalty``,
            ``frequency_penalty`` are its rows (``[R]`` views).
        seed: int64 ``[R]``.
        draft_token_ids: int32 ``[R, K]``, the proposer's drafts for each row's next step
            (-1: no draft); the same drafts also sit in ``token_ids`` just past
            ``total_len``, where the next step's ``prepare_inputs`` reads them
            (``mrv2/spec_decode/``).
    """

    def __init__(self, max_num_reqs: int, max_model_len: int, device: torch.device | str,
                 num_speculative_tokens: int = 0):
        if max_num_reqs <= 0 or max_model_len <= 0:
            raise ValueError("max_num_reqs and max_model_len must be positive, got "
                             f"{max_num_reqs} and {max_model_len}")
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.device = torch.device(device)

        def zeros(*shape, dtype=torch.int32):
            return torch.zeros(*shape, dtype=dtype, device=self.device)

        self.token_ids = zeros(max_num_reqs, max_model_len)            # [R, max_model_len]
        self.prompt_len = zeros(max_num_reqs)                          # [R]
        self.prefill_len = zeros(max_num_reqs)                         # [R]
        self.total_len = zeros(max_num_reqs)                           # [R]
        self.num_computed_tokens = zeros(max_num_reqs)                 # [R]
        self.last_sampled_token = torch.full((max_num_reqs,), -1, dtype=torch.int32,
                                             device=self.device)       # [R]
        self.top_k = torch.full((max_num_reqs,), -1, dtype=torch.int32, device=self.device)
        self.float_params = zeros(len(FLOAT_PARAMS), max_num_reqs, dtype=torch.float32)
        for i, name in enumerate(FLOAT_PARAMS):
            self.float_params[i] = float(SAMPLING_DEFAULTS[name])
        # Named [R] views, in the order of FLOAT_PARAMS.
        (self.temperature, self.top_p, self.min_p, self.repetition_penalty,
         self.presence_penalty, self.frequency_penalty) = self.float_params.unbind(0)
        self.seed = zeros(max_num_reqs, dtype=torch.int64)             # [R]
        # NOTE: never reset per request: a row's drafts are only read by a step that
        # speculates, and the proposer writes them in every step the row takes part in.
        self.draft_token_ids = torch.full((max_num_reqs, num_speculative_tokens), -1,
                                          dtype=torch.int32, device=self.device)  # [R, K]

        # The CPU side: who owns which row, and nothing else.
        # NOTE: pop() takes from the end, so row 0 is handed out first and a freed
        # row is the next one reused.
        self._free_rows: list[int] = list(range(max_num_reqs - 1, -1, -1))
        self.req_ids: list[str | None] = [None] * max_num_reqs   # by row, None when free
        self._row_of: dict[str, int] = {}
        # row -> (token ids, prompt_len, top_k, float params, seed, num_computed_tokens),
        # until applied.
        self._staged: dict[int, tuple[np.ndarray, int, int, list[float], int, int]] = {}

    @property
    def num_free_rows(self) -> int:
        """Rows a new request could take now."""
        return len(self._free_rows)

    @property
    def num_reqs(self) -> int:
        """Live requests (rows in use)."""
        return len(self._row_of)

    @property
    def has_staged_writes(self) -> bool:
        return bool(self._staged)

    def row_of(self, req_id: str) -> int:
        """The row of a live request (``KeyError`` naming it when unknown)."""
        try:
            return self._row_of[req_id]
        except KeyError:
            raise KeyError(f"request {req_id!r} has no row in the state table") from None

    def rows_of(self, req_ids) -> list[int]:
        """The rows of live requests, in order (``KeyError`` naming the first unknown one).

        NOTE: one C-level map over the dict, not a ``row_of`` call per request: it runs
        for every request of every step.
        """
        try:
            return list(map(self._row_of.__getitem__, req_ids))
        except KeyError as exc:
            raise KeyError(f"request {exc.args[0]!r} has no row in the state table") from None

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._row_of

    def add_request(self, req_id: str, prefill_token_ids: list[int], prompt_len: int,
                    sampling: dict[str, float | int] | None = None,
                    num_computed_tokens: int = 0) -> int:
        """Give ``req_id`` a row and stage its initial state (applied next step).

        Args:
            req_id: a request id not already in the table.
            prefill_token_ids: the tokens to prefill: the prompt, or for a preempted
                request re-entering as new, the prompt followed by its earlier output.
            prompt_len: how many of ``prefill_token_ids`` are the prompt.
            sampling: some of the keys of ``SAMPLING_DEFAULTS``; missing keys (or
                ``None`` values) take the neutral defaults.
            num_computed_tokens: tokens whose KV is already in the request's blocks (a
                prefix-cache hit); the device copy starts there. At most
                ``len(prefill_token_ids) - 1``: at least one token is computed.

        Returns:
            The row, which the request keeps until ``remove_request``.
        """
        if req_id in self._row_of:
            raise ValueError(f"request {req_id!r} is already in the state table "
                             f"(row {self._row_of[req_id]})")
        if not self._free_rows:
            raise RuntimeError(f"state table is full: all {self.max_num_reqs} rows are in "
                               f"use; cannot add request {req_id!r}")
        ids = np.asarray(prefill_token_ids, dtype=np.int64).reshape(-1)
        if not 0 < ids.size <= self.max_model_len:
            raise ValueError(f"request {req_id!r} has {ids.size} tokens to prefill; it "
                             f"needs between 1 and max_model_len={self.max_model_len}")
        if ids.min() < 0 or ids.max() > _INT32_MAX:
            raise ValueError(f"request {req_id!r} has a token id outside [0, 2**31)")
        if not 0 < prompt_len <= ids.size:
            raise ValueError(f"request {req_id!r}: prompt_len={prompt_len} must be in "
                             f"[1, {ids.size}] (the number of prefill tokens)")
        if not 0 <= num_computed_tokens < ids.size:
            raise ValueError(f"request {req_id!r}: num_computed_tokens={num_computed_tokens} "
                             f"must be in [0, {ids.size - 1}] (one token at least is computed)")
        params = dict(SAMPLING_DEFAULTS)
        for key, value in (sampling or {}).items():
            if key not in SAMPLING_DEFAULTS:
                raise ValueError(f"unknown sampling parameter {key!r} for request "
                                 f"{req_id!r}; expected some of {sorted(SAMPLING_DEFAULTS)}")
            if value is not None:
                params[key] = value
        seed = int(params["seed"])
        if not -2**63 <= seed < 2**63:
            raise ValueError(f"request {req_id!r}: seed={seed} does not fit in int64")

        row = self._free_rows.pop()
        self._row_of[req_id] = row
        self.req_ids[row] = req_id
        floats = [float(params[name]) for name in FLOAT_PARAMS]
        self._staged[row] = (ids.astype(np.int32), int(prompt_len), int(params["top_k"]),
                             floats, seed, int(num_computed_tokens))
        return row

    def remove_request(self, req_id: str) -> int:
        """Free the row of ``req_id`` (finished or preempted); returns that row.

        The device contents of the row are left as they are: the next owner's staged
        write overwrites everything it reads.
        """
        row = self.row_of(req_id)
        del self._row_of[req_id]
        self.req_ids[row] = None
        # NOTE: a request added and removed within one step must not be written.
        self._staged.pop(row, None)
        self._free_rows.append(row)
        return row

    def apply_staged_writes(self) -> None:
        """Write every staged new row into the device table in one kernel launch.

        Three packed host->device copies (ints + token ids, floats, seeds), then one
        scatter kernel. A no-op when nothing is staged. Never reads the device.
        """
        if not self._staged:
            return
        rows = sorted(self._staged)
        n = len(rows)
        packed_ints, meta, tail, starts = packed_rows(              # meta [n, NUM_META], tail [L]
            NUM_META, [self._staged[r][0].size for r in rows])
        packed_floats = np.empty((n, len(FLOAT_PARAMS)), dtype=np.float32)
        packed_seeds = np.empty(n, dtype=np.int64)
        for i, row in enumerate(rows):
            ids, prompt_len, top_k, floats, seed, num_computed = self._staged[row]
            meta[i] = (row, starts[i], ids.size, prompt_len, top_k, num_computed)
            tail[starts[i]:starts[i] + ids.size] = ids
            packed_floats[i] = floats
            packed_seeds[i] = seed
        self._staged.clear()
        apply_state_writes(
            to_device_async(packed_ints, self.device),
            to_device_async(packed_floats, self.device),
            to_device_async(packed_seeds, self.device), n,
            token_ids=self.token_ids, prompt_len=self.prompt_len,
            prefill_len=self.prefill_len, total_len=self.total_len,
            num_computed_tokens=self.num_computed_tokens,
            last_sampled_token=self.last_sampled_token, top_k=self.top_k,
            float_params=self.float_params, seed=self.seed,
        )


def apply_scheduler_output(sched, state: RequestStateTable, block_tables,
                           sampling_states=None) -> None:
    """Free, add and extend rows as one ``SchedulerOutput`` says; one launch per table.

    Finished / preempted requests give their rows back (sorted: the rows a run hands out
    never depend on set order), new ones take rows and their block ids, running ones
    append new block ids; then every staged write is applied.

    Args:
        sched: the step's ``SchedulerOutput``.
        state: the ``RequestStateTable``.
        block_tables: the ``BlockTables``.
        sampling_states: the sampler's ``SamplingStates`` (``None``: default sampling).
    """
    for req_id in sorted(sched.finished_req_ids):
        if req_id in state:
            row = state.remove_request(req_id)
            if sampling_states is not None:
                sampling_states.remove_request(row)
    for new in sched.new_reqs:
        sp = new.request.sampling_params if new.request is not None else None
        params = sampling_states.table_params(sp) if sampling_states is not None else None
        row = state.add_request(new.req_id, new.prefill_token_ids, new.prompt_len, params,
                                num_computed_tokens=new.num_computed_tokens)
        block_tables.append_block_ids(row, new.block_ids, overwrite=True)
        if sampling_states is not None:
            sampling_states.add_request(row, sp, new.prefill_token_ids, new.prompt_len)
    for req_id, block_ids in sched.new_block_ids.items():
        block_tables.append_block_ids(state.row_of(req_id), block_ids, overwrite=False)
    state.apply_staged_writes()
    block_tables.apply_staged_writes()
    if sampling_states is not None:
        sampling_states.apply_staged_writes()
