"""V1's block table: KV block ids by *batch row*, moved with the persistent batch.

Row ``i`` of the table belongs to whichever request sits in row ``i`` of the
persistent batch (input_batch.py), so when the batch condenses or swaps rows, the
block-id rows are copied too. The table lives in a numpy view of a (pinned) CPU
tensor and is copied to the device each step; ``slot_mapping`` is computed on the
CPU with numpy from the step's positions. Compare mrv2/block_table.py, where rows
never move and a kernel gathers them. See notebooks/03_gather_block_tables.ipynb.
"""

from __future__ import annotations

import numpy as np
import torch


class BlockTable:
    """KV block ids per persistent-batch row, with a device mirror.

    Args:
        max_num_reqs: rows (the persistent batch's capacity).
        max_num_blocks_per_req: columns: ``ceil(max_model_len / block_size)``.
        block_size: tokens per KV block.
        max_num_batched_tokens: size of the slot-mapping buffers.
        device: where the mirror lives.

    Attributes:
        block_table: int32 ``[max_num_reqs, max_num_blocks_per_req]`` on the device.
        block_table_np: the same shape in numpy: the CPU truth.
        num_blocks_per_row: int32 numpy ``[max_num_reqs]``: valid ids per row.
        slot_mapping: int64 ``[max_num_batched_tokens]`` on the device (-1: no slot).
    """

    def __init__(self, max_num_reqs: int, max_num_blocks_per_req: int, block_size: int,
                 max_num_batched_tokens: int, device: torch.device):
        self.block_size = block_size
        self.max_num_blocks_per_req = max_num_blocks_per_req
        pin = device.type == "cuda"
        shape = (max_num_reqs, max_num_blocks_per_req)
        self.block_table = torch.zeros(shape, dtype=torch.int32, device=device)
        self.block_table_cpu = torch.zeros(shape, dtype=torch.int32, pin_memory=pin)
        self.block_table_np = self.block_table_cpu.numpy()   # a view: writes go to the tensor
        self.num_blocks_per_row = np.zeros(max_num_reqs, dtype=np.int32)
        self.slot_mapping = torch.full((max_num_batched_tokens,), -1, dtype=torch.int64,
                                       device=device)
        self.slot_mapping_cpu = torch.zeros(max_num_batched_tokens, dtype=torch.int64,
                                            pin_memory=pin)
        self.slot_mapping_np = self.slot_mapping_cpu.numpy()

    # -- row edits (all on the CPU) ---------------------------------------------------

    def add_row(self, block_ids: list[int], row: int) -> None:
        """Give ``row`` to a request whose KV blocks are ``block_ids``."""
        self.num_blocks_per_row[row] = 0
        self.append_row(block_ids, row)

    def append_row(self, block_ids: list[int], row: int) -> None:
        """Append newly allocated block ids to ``row``."""
        start = self.num_blocks_per_row[row]
        end = start + len(block_ids)
        if end > self.max_num_blocks_per_req:
            raise ValueError(f"row {row} would hold {end} blocks; at most "
                             f"{self.max_num_blocks_per_req} fit")
        self.block_table_np[row, start:end] = block_ids
        self.num_blocks_per_row[row] = end

    def move_row(self, src: int, tgt: int) -> None:
        """Copy ``src``'s ids into ``tgt`` (condense fills a hole with the last row)."""
        n = self.num_blocks_per_row[src]
        self.block_table_np[tgt, :n] = self.block_table_np[src, :n]
        self.num_blocks_per_row[tgt] = n

    def swap_row(self, a: int, b: int) -> None:
        """Exchange two rows (reordering the batch)."""
        n = max(self.num_blocks_per_row[a], self.num_blocks_per_row[b])
        # NOTE: fancy indexing on the right makes a copy, so the swap is safe in one line.
        self.block_table_np[[a, b], :n] = self.block_table_np[[b, a], :n]
        self.num_blocks_per_row[[a, b]] = self.num_blocks_per_row[[b, a]]

    # -- per step -----------------------------------------------------------------------

    def compute_slot_mapping(self, req_indices: np.ndarray, positions: np.ndarray) -> None:
        """Cache slot of each token, into ``slot_mapping_np[:num_tokens]``.

        Args:
            req_indices: ``[num_tokens]`` batch row of each token.
            positions: ``[num_tokens]`` absolute position of each token.
        """
        num_tokens = len(positions)
        # Flat index into the table: row * max_blocks + block number within the row.
        flat = req_indices * self.max_num_blocks_per_req + positions // self.block_size  # [T]
        block_numbers = self.block_table_np.ravel()[flat]                               # [T]
        np.add(block_numbers * self.block_size, positions % self.block_size,
               out=self.slot_mapping_np[:num_tokens])

    def commit(self, num_reqs: int, num_tokens: int) -> None:
        """Copy the first ``num_reqs`` rows and the slot mapping to the device (async).

        NOTE: the pinned CPU buffers are written again next step while these copies
        may still run; V1 is safe only because every step ends with a blocking
        device-to-host copy of the sampled ids, which orders everything before it.
        """
        self.block_table[:num_reqs].copy_(self.block_table_cpu[:num_reqs], non_blocking=True)
        self.slot_mapping[:num_tokens].copy_(self.slot_mapping_cpu[:num_tokens],
                                             non_blocking=True)
        self.slot_mapping[num_tokens:].fill_(-1)  # a padded (graph) batch writes no slot
