"""Static input buffers and the per-step ``InputBatch`` view built in them.

Every per-step input lives in a buffer allocated once at the largest size, so a
captured CUDA graph can read the same addresses every step; a step's inputs are
views of the first ``num_reqs_padded`` / ``num_tokens_padded`` entries. The CPU
sends only ``idx_mapping`` (batch slot -> state row) and the token counts, through
double-buffered pinned memory; everything else is computed on the device from the
state table (kernels/input_prep.py, block_table.py). See
notebooks/04_triton_input_prep.ipynb.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mrv2.block_table import BlockTables
from mrv2.forward_context import AttentionMetadata
from mrv2.kernels.input_prep import prepare_inputs
from mrv2.state import RequestStateTable


class InputBuffers:
    """The step's static device buffers and their pinned CPU staging.

    Args:
        max_num_reqs: the most requests (batch slots) in one step.
        max_num_tokens: the most (padded) tokens in one step.
        device: where the buffers live.

    Attributes (device, int32):
        idx_mapping, num_scheduled_tokens, seq_lens, logits_indices: ``[max_num_reqs]``.
        query_start_loc: ``[max_num_reqs + 1]``.
        input_ids, positions: ``[max_num_tokens]``.
    """

    def __init__(self, max_num_reqs: int, max_num_tokens: int, device: torch.device | str):
        if max_num_reqs <= 0 or max_num_tokens <= 0:
            raise ValueError("max_num_reqs and max_num_tokens must be positive, got "
                             f"{max_num_reqs} and {max_num_tokens}")
        self.max_num_reqs = max_num_reqs
        self.max_num_tokens = max_num_tokens
        self.device = torch.device(device)

        def zeros(n):
            return torch.zeros(n, dtype=torch.int32, device=self.device)

        # idx_mapping and num_scheduled_tokens share one [2, max_num_reqs] buffer so
        # that one host->device copy per step carries both.
        self._host_inputs = zeros((2, max_num_reqs))
        self.idx_mapping, self.num_scheduled_tokens = self._host_inputs.unbind(0)
        self.query_start_loc = zeros(max_num_reqs + 1)
        self.seq_lens = zeros(max_num_reqs)
        self.logits_indices = zeros(max_num_reqs)
        self.input_ids = zeros(max_num_tokens)
        self.positions = zeros(max_num_tokens)

        # NOTE: two pinned staging sets used in turn: step N writes set N % 2 while the
        # copy of step N-1 may still be reading the other. Safe as long as the step
        # loop waits on step N-1's output event before preparing step N+1, as the
        # engine does (it runs at most one step ahead).
        pin = self.device.type == "cuda"
        self._staging = [torch.zeros((2, max_num_reqs), dtype=torch.int32, pin_memory=pin)
                         for _ in range(2)]
        self._staging_np = [s.numpy() for s in self._staging]   # views, for fast writes
        self._step = 0
        # (n, inference mode) -> the views of the first n slots / tokens (see req_views).
        self._req_views: dict[tuple[int, bool], tuple[torch.Tensor, ...]] = {}
        self._token_views: dict[tuple[int, bool], tuple[torch.Tensor, ...]] = {}

    def req_views(self, n: int) -> tuple[torch.Tensor, ...]:
        """``(idx_mapping, num_scheduled_tokens, query_start_loc, seq_lens, logits_indices)``
        of the first ``n`` batch slots (``query_start_loc``: ``n + 1`` entries).

        NOTE: memoised per size: every slice is an op with its own host cost (~2-5 us on
        a GPU), a step takes a dozen, and a step's sizes repeat (its CUDA graph's). Keyed
        by inference mode too, so a view made inside it is never reused outside.
        """
        key = (n, torch.is_inference_mode_enabled())
        views = self._req_views.get(key)
        if views is None:
            views = self._req_views[key] = (
                self.idx_mapping[:n], self.num_scheduled_tokens[:n],
                self.query_start_loc[:n + 1], self.seq_lens[:n], self.logits_indices[:n])
        return views

    def token_views(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(input_ids, positions)`` of the first ``n`` tokens (memoised as ``req_views``)."""
        key = (n, torch.is_inference_mode_enabled())
        views = self._token_views.get(key)
        if views is None:
            views = self._token_views[key] = (self.input_ids[:n], self.positions[:n])
        return views

    def stage_and_copy(self, rows: list[int], num_scheduled: list[int],
                       num_reqs_padded: int) -> None:
        """Write ``rows`` / ``num_scheduled`` to pinned memory, then copy non-blocking.

        Padding slots get row 0 and count 0. Never waits for the device.
        """
        staging = self._staging_np[self._step % 2]                  # [2, max_num_reqs]
        num_reqs = len(rows)
        staging[0, :num_reqs] = rows
        staging[1, :num_reqs] = num_scheduled
        staging[:, num_reqs:num_reqs_padded] = 0
        # NOTE: the whole (small, contiguous) buffer: a strided slice would go through
        # an unpinned temporary and the copy would no longer be asynchronous.
        self._host_inputs.copy_(self._staging[self._step % 2], non_blocking=True)
        self._step += 1


@dataclass
class InputBatch:
    """Everything one step's forward pass and sampler read (device views).

    Shapes: ``B = num_reqs_padded``, ``T = num_tokens_padded``. Slots
    ``b >= num_reqs`` and tokens ``t >= num_tokens`` are padding.
    """

    num_reqs: int
    num_reqs_padded: int
    num_tokens: int
    num_tokens_padded: int
    req_ids: list[str]
    idx_mapping: torch.Tensor           # [B] int32, batch slot -> state row
    num_scheduled_tokens: torch.Tensor  # [B] int32 (0 for padding slots)
    input_ids: torch.Tensor             # [T] int32
    positions: torch.Tensor             # [T] int32
    query_start_loc: torch.Tensor       # [B + 1] int32
    seq_lens: torch.Tensor              # [B] int32
    logits_indices: torch.Tensor        # [B] int32, last token of each slot
    slot_mapping: torch.Tensor          # [T] int64, -1 for padding tokens
    block_table: torch.Tensor           # [B, max_num_blocks_per_req] int32
    attn_metadata: AttentionMetadata


def prepare_input_batch(buffers: InputBuffers, state: RequestStateTable,
                        block_tables: BlockTables, req_ids: list[str], rows: list[int],
                        num_scheduled: list[int], max_query_len: int, max_seq_len: int,
                        num_reqs_padded: int | None = None,
                        num_tokens_padded: int | None = None) -> InputBatch:
    """Prepare one step's inputs on the device, without waiting for it.

    First applies the staged writes of ``state`` and ``block_tables`` (no-ops when
    nothing is staged), then: idx_mapping + counts -> pinned -> device, one
    ``prepare_inputs`` launch, the block-table gather, the slot mapping.

    Args:
        buffers: the static buffers.
        state, block_tables: the request-state table and its block tables.
        req_ids: ``[num_reqs]`` request ids in batch order.
        rows: ``[num_reqs]`` their state rows (``idx_mapping`` on the CPU).
        num_scheduled: ``[num_reqs]`` new tokens per request this step (each >= 1).
        max_query_len, max_seq_len: bounds the scheduler knows (for attention).
        num_reqs_padded, num_tokens_padded: padded sizes (for CUDA graphs);
            default to the real ones.

    Returns:
        The ``InputBatch``, views of the static buffers.
    """
    num_reqs = len(rows)
    if len(req_ids) != num_reqs or len(num_scheduled) != num_reqs:
        raise ValueError(f"req_ids ({len(req_ids)}), rows ({num_reqs}) and num_scheduled "
                         f"({len(num_scheduled)}) must have the same length")
    num_tokens = sum(num_scheduled)
    num_reqs_padded = num_reqs if num_reqs_padded is None else num_reqs_padded
    num_tokens_padded = num_tokens if num_tokens_padded is None else num_tokens_padded
    if not num_reqs <= num_reqs_padded <= buffers.max_num_reqs:
        raise ValueError(f"need num_reqs ({num_reqs}) <= num_reqs_padded ({num_reqs_padded}) "
                         f"<= max_num_reqs ({buffers.max_num_reqs})")
    if not num_tokens <= num_tokens_padded <= buffers.max_num_tokens:
        raise ValueError(f"need num_tokens ({num_tokens}) <= num_tokens_padded "
                         f"({num_tokens_padded}) <= max_num_tokens ({buffers.max_num_tokens})")

    state.apply_staged_writes()
    block_tables.apply_staged_writes()
    buffers.stage_and_copy(rows, num_scheduled, num_reqs_padded)
    # [B], [B], [B + 1], [B], [B]; and [T], [T]
    idx_mapping, num_scheduled_tokens, query_start_loc, seq_lens, logits_indices = (
        buffers.req_views(num_reqs_padded))
    input_ids, positions = buffers.token_views(num_tokens_padded)
    prepare_inputs(idx_mapping, num_scheduled_tokens, num_reqs, num_tokens_padded, state,
                   query_start_loc=buffers.query_start_loc, seq_lens=buffers.seq_lens,
                   input_ids=buffers.input_ids, positions=buffers.positions,
                   logits_indices=buffers.logits_indices)
    block_table = block_tables.gather_block_tables(idx_mapping, num_reqs)   # [B, max_blocks]
    slot_mapping = block_tables.compute_slot_mappings(
        idx_mapping, query_start_loc, positions, num_reqs, num_tokens_padded)  # [T]
    attn_metadata = AttentionMetadata(
        query_start_loc=query_start_loc, seq_lens=seq_lens, block_table=block_table,
        slot_mapping=slot_mapping, max_query_len=max_query_len, max_seq_len=max_seq_len)
    return InputBatch(
        num_reqs=num_reqs, num_reqs_padded=num_reqs_padded, num_tokens=num_tokens,
        num_tokens_padded=num_tokens_padded, req_ids=list(req_ids),
        idx_mapping=idx_mapping, num_scheduled_tokens=num_scheduled_tokens,
        input_ids=input_ids, positions=positions,
        query_start_loc=query_start_loc, seq_lens=seq_lens, logits_indices=logits_indices,
        slot_mapping=slot_mapping, block_table=block_table, attn_metadata=attn_metadata)
