"""Block-table kernels: staged writes, the per-step gather, and slot mappings.

Every state row owns one row of KV block ids that never moves. Each step a kernel
*gathers* the rows of the scheduled requests (``idx_mapping``: batch slot -> row)
into a static input block table, and another turns each new token's position into
its KV-cache slot. Each kernel sits beside a plain torch reference, its executable
specification. See notebooks/03_gather_block_tables.ipynb.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: Fields per staged row at the head of the packed block-id writes.
NUM_WRITE_META = 4  # (row, first column, number of ids, start in the flat ids)


#: Lanes per loop iteration of the copy loops. NOTE: a fixed block, not one sized to
#: the data: every distinct constexpr (and every int argument Triton specialises on,
#: ==1 or divisible by 16) is a separate compiled kernel, and a compile met for the
#: first time mid-run costs ~0.3 s of that run. The sizes are listed in
#: ``do_not_specialize`` for the same reason.
COPY_BLOCK = 1024


def _block(n: int, cap: int = 1024) -> int:
    """A power-of-two block covering ``n`` in one pass when it can (few programs)."""
    return min(cap, triton.next_power_of_2(max(n, 16)))


# --- Staged writes: append or overwrite block ids of some rows (one launch) -------

@triton.jit(do_not_specialize=["num_staged"])
def _apply_block_writes_kernel(
    packed_ptr,                       # inputs: int32 [n * NUM_META + L]
    block_table_ptr,                  # outputs: int32 [R, max_blocks]
    num_staged, block_table_stride,   # sizes, strides
    NUM_META: tl.constexpr, BLOCK: tl.constexpr,
):
    i = tl.program_id(0)  # one program per staged row
    # Load this row's header: where its ids go and where they sit in the flat tail.
    meta = packed_ptr + i * NUM_META
    row = tl.load(meta + 0).to(tl.int64)
    col = tl.load(meta + 1)
    num_ids = tl.load(meta + 2)
    src = packed_ptr + num_staged * NUM_META + tl.load(meta + 3)
    # Copy the ids into block_table[row, col:col + num_ids].
    dst = block_table_ptr + row * block_table_stride + col
    for k in range(0, num_ids, BLOCK):
        offs = k + tl.arange(0, BLOCK)
        mask = offs < num_ids
        tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


def apply_block_writes(packed: torch.Tensor, num_staged: int, block_table: torch.Tensor) -> None:
    """Write ``num_staged`` packed (row, column, ids) runs into ``block_table``.

    Args:
        packed: int32 ``[num_staged * NUM_WRITE_META + L]``: ``(row, first_col,
            num_ids, start)`` per staged row, then all their ids back to back
            (``start`` indexes that flat tail).
        num_staged: staged rows (a CPU int); 0 launches nothing.
        block_table: int32 ``[R, max_blocks]``, written in place.
    """
    if num_staged == 0:
        return
    _apply_block_writes_kernel[(num_staged,)](
        packed, block_table, num_staged, block_table.stride(0),
        NUM_META=NUM_WRITE_META, BLOCK=COPY_BLOCK)


# --- Gather: the static input block table of one step ------------------------------

@triton.jit(do_not_specialize=["num_reqs"])
def _gather_block_tables_kernel(
    idx_mapping_ptr, block_table_ptr,     # inputs
    out_ptr,                              # outputs
    num_reqs, max_blocks,                 # sizes
    block_table_stride, out_stride,       # strides
    BLOCK: tl.constexpr,
):
    b = tl.program_id(0)  # one program per batch slot, padding slots included
    is_real = b < num_reqs
    row = tl.load(idx_mapping_ptr + b, mask=is_real, other=0).to(tl.int64)
    src = block_table_ptr + row * block_table_stride
    dst = out_ptr + b.to(tl.int64) * out_stride
    # NOTE: padding slots write zeros (a captured graph may read them). The scalar
    # is_real is folded into a bound: the interpreter mishandles block & scalar masks.
    real_cols = tl.where(is_real, max_blocks, 0)
    for k in range(0, max_blocks, BLOCK):
        cols = k + tl.arange(0, BLOCK)
        mask = cols < max_blocks
        ids = tl.load(src + cols, mask=cols < real_cols, other=0)
        tl.store(dst + cols, ids, mask=mask)


def gather_block_tables(idx_mapping: torch.Tensor, num_reqs: int, block_table: torch.Tensor,
                        out: torch.Tensor) -> torch.Tensor:
    """``out[b] = block_table[idx_mapping[b]]`` for ``b < num_reqs``, zeros after.

    Args:
        idx_mapping: int32 ``[B_pad]`` batch slot -> state row (entries past
            ``num_reqs`` are never read).
        num_reqs: real batch slots (a CPU int).
        block_table: int32 ``[R, max_blocks]`` per-row block ids.
        out: int32 ``[>= B_pad, max_blocks]`` the static input buffer.

    Returns:
        ``out[:B_pad]``, a view.
    """
    num_reqs_padded = idx_mapping.shape[0]
    max_blocks = block_table.shape[1]
    if num_reqs_padded > 0:
        _gather_block_tables_kernel[(num_reqs_padded,)](
            idx_mapping, block_table, out, num_reqs, max_blocks,
            block_table.stride(0), out.stride(0), BLOCK=_block(max_blocks))
    return out[:num_reqs_padded]


def gather_block_tables_ref(idx_mapping: torch.Tensor, num_reqs: int,
                            block_table: torch.Tensor) -> torch.Tensor:
    """Plain-torch specification of ``gather_block_tables`` (returns a new tensor)."""
    out = torch.zeros(idx_mapping.shape[0], block_table.shape[1], dtype=block_table.dtype,
                      device=block_table.device)
    out[:num_reqs] = block_table[idx_mapping[:num_reqs].long()]
    return out


# --- Slot mapping: the KV-cache slot of every new token ----------------------------

@triton.jit(do_not_specialize=["num_reqs", "num_tokens_padded"])
def _compute_slot_mappings_kernel(
    idx_mapping_ptr, query_start_loc_ptr, positions_ptr, block_table_ptr,  # inputs
    slot_mapping_ptr,                                                       # outputs
    num_reqs, num_tokens_padded, max_blocks, block_size,                    # sizes
    block_table_stride,                                                     # strides
    BLOCK: tl.constexpr,
):
    b = tl.program_id(0)  # one program per real request, plus one for padding tokens
    is_real = b < num_reqs
    # The tokens of slot b; the last program takes [total, num_tokens_padded).
    start = tl.load(query_start_loc_ptr + b)
    end = tl.load(query_start_loc_ptr + b + 1, mask=is_real, other=0)
    end = tl.where(is_real, end, num_tokens_padded)
    row = tl.load(idx_mapping_ptr + b, mask=is_real, other=0).to(tl.int64)
    # NOTE: the scalar is_real is folded into a bound (the interpreter mishandles
    # `block_mask & scalar_mask`): the padding program reads nothing.
    real_end = tl.where(is_real, end, start)
    for k in range(start, end, BLOCK):
        t = k + tl.arange(0, BLOCK)
        mask = t < end
        real = t < real_end
        pos = tl.load(positions_ptr + t, mask=real, other=0)
        col = pos // block_size
        block_id = tl.load(block_table_ptr + row * block_table_stride + col,
                           mask=real & (col < max_blocks), other=0)
        slot = block_id.to(tl.int64) * block_size + pos % block_size
        # NOTE: -1 tells the KV-cache write to skip a padding token.
        slot = tl.where(is_real, slot, -1)
        tl.store(slot_mapping_ptr + t, slot, mask=mask)


def compute_slot_mappings(idx_mapping: torch.Tensor, query_start_loc: torch.Tensor,
                          positions: torch.Tensor, num_reqs: int, num_tokens_padded: int,
                          block_table: torch.Tensor, block_size: int,
                          out: torch.Tensor) -> torch.Tensor:
    """Slot of each new token: ``table[row, pos // block_size] * block_size + pos % block_size``.

    Args:
        idx_mapping: int32 ``[>= num_reqs]`` batch slot -> state row.
        query_start_loc: int32 ``[>= num_reqs + 1]`` prefix sums of new tokens.
        positions: int32 ``[>= num_tokens_padded]`` position of each token.
        num_reqs: real requests; num_tokens_padded: tokens to fill (CPU ints).
        block_table: int32 ``[R, max_blocks]`` the per-row table (not the gathered one).
        block_size: tokens per KV block.
        out: int64 ``[>= num_tokens_padded]`` the static slot-mapping buffer.

    Returns:
        ``out[:num_tokens_padded]``, a view; padding tokens (index >=
        ``query_start_loc[num_reqs]``) hold -1.
    """
    _compute_slot_mappings_kernel[(num_reqs + 1,)](
        idx_mapping, query_start_loc, positions, block_table, out,
        num_reqs, num_tokens_padded, block_table.shape[1], block_size,
        block_table.stride(0), BLOCK=COPY_BLOCK)
    return out[:num_tokens_padded]


def compute_slot_mappings_ref(idx_mapping: torch.Tensor, query_start_loc: torch.Tensor,
                              positions: torch.Tensor, num_reqs: int,
                              num_tokens_padded: int, block_table: torch.Tensor,
                              block_size: int) -> torch.Tensor:
    """Plain-torch specification of ``compute_slot_mappings`` (a new int64 tensor)."""
    out = torch.full((num_tokens_padded,), -1, dtype=torch.int64)
    qsl = query_start_loc.tolist()
    for b in range(num_reqs):
        row = int(idx_mapping[b])
        for t in range(qsl[b], qsl[b + 1]):
            pos = int(positions[t])
            out[t] = int(block_table[row, pos // block_size]) * block_size + pos % block_size
    return out
