"""Per-row block tables, gathered into a static input table each step.

V1 reordered its block table together with the persistent batch. Here each row
of the state table (see state.py) owns one row of KV block ids for the life of
its request; a step never moves them. Instead a kernel *gathers* the rows of the
scheduled requests (``idx_mapping``: batch slot -> row) into a static input block
table that attention (and a captured CUDA graph) reads, and another kernel turns
positions into ``slot_mapping``. New block ids are staged on the CPU and written
in one kernel launch per step. See notebooks/03_gather_block_tables.ipynb.
"""

from __future__ import annotations

import numpy as np
import torch

from mrv2.kernels.block_table import (
    NUM_WRITE_META,
    apply_block_writes,
    compute_slot_mappings,
    gather_block_tables,
)
from mrv2.state import packed_rows, to_device_async


class BlockTables:
    """KV block ids per state row, plus the static per-step outputs.

    Args:
        max_num_reqs: rows (same as the state table's).
        max_num_blocks_per_req: columns: ``ceil(max_model_len / block_size)``.
        block_size: tokens per KV block.
        max_num_tokens: the largest padded token count of one step.
        device: where the tables live.

    Attributes:
        block_table: int32 ``[max_num_reqs, max_num_blocks_per_req]`` by state row.
        num_blocks: int64 numpy ``[max_num_reqs]``: valid ids per row (CPU).
        input_block_table: int32 ``[max_num_reqs, max_num_blocks_per_req]``, the
            static gathered table (by batch slot).
        slot_mapping: int64 ``[max_num_tokens]``, the static slot-mapping buffer.
    """

    def __init__(self, max_num_reqs: int, max_num_blocks_per_req: int, block_size: int,
                 max_num_tokens: int, device: torch.device | str):
        for name, value in (("max_num_reqs", max_num_reqs), ("block_size", block_size),
                            ("max_num_blocks_per_req", max_num_blocks_per_req),
                            ("max_num_tokens", max_num_tokens)):
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        self.max_num_reqs = max_num_reqs
        self.max_num_blocks_per_req = max_num_blocks_per_req
        self.block_size = block_size
        self.max_num_tokens = max_num_tokens
        self.device = torch.device(device)

        shape = (max_num_reqs, max_num_blocks_per_req)
        self.block_table = torch.zeros(shape, dtype=torch.int32, device=self.device)
        self.input_block_table = torch.zeros(shape, dtype=torch.int32, device=self.device)
        self.slot_mapping = torch.full((max_num_tokens,), -1, dtype=torch.int64,
                                       device=self.device)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)
        # row -> (first column, ids) still to be written; one run per row.
        self._staged: dict[int, tuple[int, list[int]]] = {}

    @property
    def has_staged_writes(self) -> bool:
        return bool(self._staged)

    def append_block_ids(self, row: int, block_ids: list[int], overwrite: bool) -> None:
        """Stage new block ids for ``row`` (written by ``apply_staged_writes``).

        Args:
            row: the state row of the request.
            block_ids: KV block ids to add.
            overwrite: True for a request new to this row (its ids start at column
                0); False to append after the row's current blocks.
        """
        if not 0 <= row < self.max_num_reqs:
            raise ValueError(f"row {row} is outside [0, {self.max_num_reqs})")
        block_ids = [int(b) for b in block_ids]
        first = 0 if overwrite else int(self.num_blocks[row])
        if first + len(block_ids) > self.max_num_blocks_per_req:
            raise ValueError(f"row {row} would hold {first + len(block_ids)} blocks; at most "
                             f"max_num_blocks_per_req={self.max_num_blocks_per_req} fit")
        if any(b < 0 or b >= 2**31 for b in block_ids):
            raise ValueError(f"row {row}: block ids must be in [0, 2**31), got {block_ids}")
        self.num_blocks[row] = first + len(block_ids)
        staged = self._staged.get(row)
        if overwrite or staged is None:
            # NOTE: an overwrite drops any run staged earlier this step, so each row
            # has one run and the programs of the write kernel never overlap.
            self._staged[row] = (first, block_ids)
        else:
            staged[1].extend(block_ids)  # the staged run ends where these begin
        if not self._staged[row][1]:
            del self._staged[row]

    def clear_row(self, row: int) -> None:
        """Forget the blocks of ``row`` (its request finished or was preempted)."""
        self.num_blocks[row] = 0
        self._staged.pop(row, None)

    def apply_staged_writes(self) -> None:
        """Write all staged block ids in one host->device copy and one kernel launch."""
        if not self._staged:
            return
        rows = sorted(self._staged)
        n = len(rows)
        packed, meta, tail, starts = packed_rows(                        # meta [n, 4], tail [L]
            NUM_WRITE_META, [len(self._staged[r][1]) for r in rows])
        for i, row in enumerate(rows):
            first, ids = self._staged[row]
            meta[i] = (row, first, len(ids), starts[i])
            tail[starts[i]:starts[i] + len(ids)] = ids
        self._staged.clear()
        apply_block_writes(to_device_async(packed, self.device), n, self.block_table)

    def gather_block_tables(self, idx_mapping: torch.Tensor, num_reqs: int) -> torch.Tensor:
        """Gather the rows of this step's requests into the static input table.

        Args:
            idx_mapping: int32 ``[num_reqs_padded]`` device, batch slot -> state row;
                entries past ``num_reqs`` are don't-care.
            num_reqs: real requests (a CPU int).

        Returns:
            int32 ``[num_reqs_padded, max_num_blocks_per_req]``, a view of
            ``input_block_table``; padding rows are zero.
        """
        if not 0 <= num_reqs <= idx_mapping.shape[0] <= self.max_num_reqs:
            raise ValueError(f"need 0 <= num_reqs ({num_reqs}) <= num_reqs_padded "
                             f"({idx_mapping.shape[0]}) <= max_num_reqs ({self.max_num_reqs})")
        return gather_block_tables(idx_mapping, num_reqs, self.block_table,
                                   self.input_block_table)

    def compute_slot_mappings(self, idx_mapping: torch.Tensor, query_start_loc: torch.Tensor,
                              positions: torch.Tensor, num_reqs: int,
                              num_tokens_padded: int) -> torch.Tensor:
        """KV-cache slot of every token of the step.

        Args:
            idx_mapping: int32 ``[>= num_reqs]`` device, batch slot -> state row.
            query_start_loc: int32 ``[>= num_reqs + 1]`` device.
            positions: int32 ``[>= num_tokens_padded]`` device.
            num_reqs: real requests; num_tokens_padded: tokens to fill (CPU ints).

        Returns:
            int64 ``[num_tokens_padded]``, a view of ``slot_mapping``:
            ``block_table[row, pos // block_size] * block_size + pos % block_size``
            for real tokens, -1 for padding tokens.
        """
        if not 0 <= num_tokens_padded <= self.max_num_tokens:
            raise ValueError(f"num_tokens_padded={num_tokens_padded} is outside "
                             f"[0, max_num_tokens={self.max_num_tokens}]")
        return compute_slot_mappings(idx_mapping, query_start_loc, positions, num_reqs,
                                     num_tokens_padded, self.block_table, self.block_size,
                                     self.slot_mapping)
