"""Repetition, presence and frequency penalties from per-row histories kept on the device.

V1 rebuilt each request's output-token history on the CPU and copied it over every
step. Here each state-table row owns two device arrays that the step loop updates
in place: a prompt-token mask and output-token counts. Admission writes them once
(staged, one launch per step), each step counts its appended tokens (one launch,
before ``post_update``), and the penalties read them through ``idx_mapping`` (one
launch). The penalty values themselves live in ``RequestStateTable.float_params``.
"""

from __future__ import annotations

import numpy as np
import torch

from mrv2.kernels.penalties import (
    NUM_META,
    apply_penalties,
    apply_penalty_writes,
    update_output_counts,
)
from mrv2.state import packed_rows, to_device_async


def uses_penalties(sampling_params) -> bool:
    """Whether a request's ``SamplingParams`` change logits through penalties (CPU)."""
    return (sampling_params.repetition_penalty != 1.0 or sampling_params.presence_penalty != 0.0
            or sampling_params.frequency_penalty != 0.0)


class PenaltyState:
    """Per-row prompt masks and output-token counts, on the device.

    Args:
        max_num_reqs: rows (the state table's ``max_num_reqs``).
        vocab_size: V.
        device: where the arrays live.

    Attributes:
        prompt_mask: int8 ``[R, V]``, 1 where the token appears in the row's prompt.
        output_counts: int32 ``[R, V]``, how often each token was generated.

    NOTE: ``[R, V]`` is large (R=256, V=151,936: 155 MB of counts + 39 MB of mask);
    the caller may create this object only when some request uses penalties.
    """

    def __init__(self, max_num_reqs: int, vocab_size: int, device: torch.device | str):
        if max_num_reqs <= 0 or vocab_size <= 0:
            raise ValueError("max_num_reqs and vocab_size must be positive, got "
                             f"{max_num_reqs} and {vocab_size}")
        self.max_num_reqs = max_num_reqs
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.prompt_mask = torch.zeros(max_num_reqs, vocab_size, dtype=torch.int8,
                                       device=self.device)     # [R, V]
        self.output_counts = torch.zeros(max_num_reqs, vocab_size, dtype=torch.int32,
                                         device=self.device)   # [R, V]
        # row -> (prompt ids, output ids), until applied.
        self._staged: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    @property
    def has_staged_writes(self) -> bool:
        return bool(self._staged)

    def _check_ids(self, row: int, ids, what: str) -> np.ndarray:
        arr = np.asarray(ids, dtype=np.int64).reshape(-1)
        if arr.size and (arr.min() < 0 or arr.max() >= self.vocab_size):
            raise ValueError(f"row {row}: {what} hold a token id outside [0, {self.vocab_size})")
        return arr.astype(np.int32)

    def add_request(self, row: int, prompt_token_ids, output_token_ids=()) -> None:
        """Stage a row's history (applied by the next ``apply_staged_writes``).

        Args:
            row: the request's state-table row.
            prompt_token_ids: its prompt.
            output_token_ids: tokens it generated before (a preempted request coming
                back: its prefill is prompt + these); empty for a new request.
        """
        if not 0 <= row < self.max_num_reqs:
            raise ValueError(f"row {row} is outside [0, {self.max_num_reqs})")
        self._staged[row] = (self._check_ids(row, prompt_token_ids, "prompt_token_ids"),
                             self._check_ids(row, output_token_ids, "output_token_ids"))

    def remove_request(self, row: int) -> None:
        """Forget a staged write for ``row`` (its device contents are simply overwritten
        by the next owner's staged write)."""
        # NOTE: a request added and removed within one step must not be written.
        self._staged.pop(row, None)

    def apply_staged_writes(self) -> None:
        """Write every staged row (one host->device copy, one launch; never reads back)."""
        if not self._staged:
            return
        rows = sorted(self._staged)
        n = len(rows)
        packed, meta, tail, starts = packed_rows(                  # meta [n, NUM_META], tail [L]
            NUM_META, [self._staged[r][0].size + self._staged[r][1].size for r in rows])
        longest = 1
        for i, row in enumerate(rows):
            prompt, output = self._staged[row]
            start = starts[i]
            meta[i] = (row, start, prompt.size, output.size)
            tail[start:start + prompt.size] = prompt                # the prompt, then the output
            tail[start + prompt.size:start + prompt.size + output.size] = output
            longest = max(longest, prompt.size, output.size)
        self._staged.clear()
        apply_penalty_writes(to_device_async(packed, self.device), n,
                             prompt_mask=self.prompt_mask, output_counts=self.output_counts,
                             max_tokens_per_row=longest)

    def update(self, idx_mapping: torch.Tensor, num_scheduled_tokens: torch.Tensor,
               sampled_token_ids: torch.Tensor, num_reqs: int, state) -> None:
        """Count the tokens this step appends (one launch, no sync).

        Args:
            idx_mapping, num_scheduled_tokens: int32 ``[B_pad]`` as for ``post_update``.
            sampled_token_ids: ``[B_pad]`` the step's samples.
            num_reqs: real requests (a CPU int).
            state: the ``RequestStateTable``.

        NOTE: call it right *before* ``post_update`` (see ``update_output_counts``).
        """
        update_output_counts(idx_mapping, num_scheduled_tokens, sampled_token_ids, num_reqs,
                             state, self.output_counts)

    def apply(self, logits: torch.Tensor, idx_mapping: torch.Tensor, state) -> torch.Tensor:
        """Apply the rows' penalties to ``[B, V]`` logits in place (one launch, no sync).

        Args:
            logits: ``[B, V]`` raw logits (before temperature).
            idx_mapping: ``[>= B]`` batch slot -> state row.
            state: the ``RequestStateTable`` (reads its penalty views).

        Returns:
            ``logits``.
        """
        return apply_penalties(logits, idx_mapping, self.prompt_mask, self.output_counts,
                               state.repetition_penalty, state.presence_penalty,
                               state.frequency_penalty)
