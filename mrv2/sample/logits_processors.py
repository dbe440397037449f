"""Batch-level, GPU-native logits processors.

V1's logits processors were Python callables run per request on the CPU, which
needed each request's token history on the host (a sync every step); MRV2 in vLLM
0.18 dropped them. Here a processor sees the whole ``[B, V]`` batch at once and
reads what it needs from the state table on the device through ``idx_mapping``;
its own per-row settings are CPU bookkeeping staged to the device at admission.

Contract of ``LogitsProcessor.apply``: it must not synchronise with the device (no
``.item()``, ``.tolist()``, ``bool(tensor)``, ``nonzero``, boolean-mask indexing, or
host copies of device tensors), so the step loop stays async. A GPU test runs the
built-ins under ``torch.cuda.set_sync_debug_mode("error")``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np
import torch
import triton
import triton.language as tl

from mrv2.state import to_device_async


class LogitsProcessor(ABC):
    """One batch-level logits edit.

    Lifecycle, all called by the runner: ``add_request`` / ``remove_request`` when a
    row is taken / freed (CPU only, staged), ``apply_staged_writes`` once per step
    after the state table's own, then ``apply`` on the step's logits before sampling.
    """

    def add_request(self, row: int, prompt_token_ids: list[int], sampling_params) -> None:
        """Note a new request in ``row`` (CPU bookkeeping; stage any device write)."""

    def remove_request(self, row: int) -> None:
        """Forget ``row`` (and any staged write for it)."""

    def apply_staged_writes(self) -> None:
        """Write staged per-row settings to the device (no sync)."""

    @abstractmethod
    def apply(self, logits: torch.Tensor, idx_mapping: torch.Tensor, state) -> torch.Tensor:
        """Edit the logits of a batch, without synchronising.

        Args:
            logits: ``[B, V]`` float logits (may be modified in place).
            idx_mapping: int32 ``[>= B]`` batch slot -> state-table row.
            state: the ``RequestStateTable`` (``token_ids``, ``total_len``, ... on the device).

        Returns:
            ``[B, V]`` logits (``logits`` itself or a new tensor).
        """


# --- no-repeat n-gram ---------------------------------------------------------------

@triton.jit
def _no_repeat_ngram_kernel(
    logits_ptr, idx_mapping_ptr, enabled_ptr, token_ids_ptr, total_len_ptr,  # inputs
    vocab_size,                                                             # sizes
    logits_stride, token_ids_stride,                                        # strides
    N: tl.constexpr, BLOCK: tl.constexpr,
):
    b = tl.program_id(0)  # one program per batch slot
    row = tl.load(idx_mapping_ptr + b).to(tl.int64)
    total = tl.load(total_len_ptr + row)
    # Windows token_ids[s : s + N] with s + N <= total: their first N - 1 tokens are
    # compared with the last N - 1 tokens; on a match, token s + N - 1 is banned.
    num_windows = tl.where(tl.load(enabled_ptr + row) != 0, total - N + 1, 0)
    ids_row = token_ids_ptr + row * token_ids_stride
    for s0 in range(0, num_windows, BLOCK):
        s = s0 + tl.arange(0, BLOCK)
        ok = s < num_windows
        match = ok
        for j in tl.static_range(N - 1):
            suffix_j = tl.load(ids_row + total - (N - 1) + j)
            match = match & (tl.load(ids_row + s + j, mask=ok, other=-1) == suffix_j)
        nxt = tl.load(ids_row + s + N - 1, mask=match, other=0)
        match = match & (nxt < vocab_size)
        # Duplicate bans all store the same -inf: no atomics needed.
        tl.store(logits_ptr + b * logits_stride + nxt,
                 tl.full([BLOCK], float("-inf"), tl.float32).to(logits_ptr.dtype.element_ty),
                 mask=match)


class NoRepeatNGramLogitsProcessor(LogitsProcessor):
    """Ban every token that would complete an ``n``-gram already in the row's tokens.

    Reads prompt + output from ``state.token_ids[row, :total_len]`` on the device
    (Hugging Face's ``no_repeat_ngram_size``; ``n = 1`` bans every token seen).

    Args:
        n: the n-gram size (>= 1).
        max_num_reqs: rows of the state table.
        device: where the per-row enable flags live.
        enabled_for: ``SamplingParams -> bool``, which requests it applies to (all
            when ``None``).

    NOTE: one program scans a row's whole history each step (``O(total_len * n)``
    loads); fine for thousands of tokens, and rows with the flag off cost 2 loads.
    """

    def __init__(self, n: int, max_num_reqs: int, device: torch.device | str,
                 enabled_for=None):
        if n < 1:
            raise ValueError(f"NoRepeatNGramLogitsProcessor.n must be >= 1, got {n}")
        self.n = n
        self.device = torch.device(device)
        self.enabled_for = enabled_for
        self.enabled = torch.zeros(max_num_reqs, dtype=torch.int8, device=self.device)  # [R]
        self._staged: dict[int, int] = {}

    def add_request(self, row, prompt_token_ids, sampling_params) -> None:
        self._staged[row] = int(self.enabled_for is None or bool(self.enabled_for(sampling_params)))

    def remove_request(self, row) -> None:
        self._staged.pop(row, None)

    def apply_staged_writes(self) -> None:
        if not self._staged:
            return
        rows = sorted(self._staged)
        values = np.array([self._staged[r] for r in rows], dtype=np.int8)
        self._staged.clear()
        self.enabled.index_copy_(0, to_device_async(np.array(rows, dtype=np.int64), self.device),
                                 to_device_async(values, self.device))

    def apply(self, logits, idx_mapping, state):
        num_reqs, vocab_size = logits.shape
        if num_reqs:
            _no_repeat_ngram_kernel[(num_reqs,)](
                logits, idx_mapping, self.enabled, state.token_ids, state.total_len,
                vocab_size, logits.stride(0), state.token_ids.stride(0),
                N=self.n, BLOCK=min(1024, triton.next_power_of_2(state.token_ids.shape[1])))
        return logits


def no_repeat_ngram_banned_ref(tokens: list[int], n: int) -> set[int]:
    """Plain-Python specification: the tokens that would repeat an ``n``-gram of ``tokens``."""
    if len(tokens) < n - 1:
        return set()
    suffix = tuple(tokens[len(tokens) - (n - 1):]) if n > 1 else ()
    return {tokens[s + n - 1] for s in range(len(tokens) - n + 1)
            if tuple(tokens[s:s + n - 1]) == suffix}


# --- a fixed ban list --------------------------------------------------------------

class TokenBanLogitsProcessor(LogitsProcessor):
    """Never generate ``banned_ids`` (every row).

    Args:
        banned_ids: token ids (``< V``), the same for all requests.
        device: where the id list lives.
    """

    def __init__(self, banned_ids: list[int], device: torch.device | str):
        if not banned_ids or min(banned_ids) < 0:
            raise ValueError(f"banned_ids must be a non-empty list of token ids, got {banned_ids!r}")
        self.banned = torch.tensor(sorted(set(banned_ids)), dtype=torch.int64,
                                   device=device)   # [K]

    def apply(self, logits, idx_mapping, state):
        # NOTE: index_fill_ with a device index never syncs (logits[:, mask] = ... would).
        return logits.index_fill_(1, self.banned, float("-inf"))


def apply_logits_processors(processors: list[LogitsProcessor], logits: torch.Tensor,
                            idx_mapping: torch.Tensor, state) -> torch.Tensor:
    """Run ``processors`` in order on ``[B, V]`` logits (no sync if none syncs)."""
    for p in processors:
        logits = p.apply(logits, idx_mapping, state)
    return logits
