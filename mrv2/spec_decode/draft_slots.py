"""Draft slots in the state table's token buffer, and the post-update of accepted tokens.

A speculating decode of row ``r`` with ``L = total_len[r]`` known tokens schedules 1 + K
query tokens at positions ``L - 1 .. L + K - 1``: its last known token and K drafts.
``write_draft_slots`` puts the drafts into ``token_ids[r, L:L + K]``, *past* ``total_len``
(scratch that no reader of known tokens looks at), so the unchanged ``prepare_inputs``
reads all 1 + K input ids from the row as it reads a prefill chunk. After verification,
``spec_post_update`` appends the ``num_output_tokens`` returned tokens (the accepted drafts,
then the target's own token) over those slots and advances ``num_computed_tokens`` by
``1 + num_accepted``: the KV of the rejected drafts lies past it and is simply overwritten
by a later step. Both run on the device; no count reaches the CPU.
See notebooks/09_speculative_decoding.ipynb.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: Slots per program (fixed: each distinct constexpr is one more compiled kernel).
BLOCK_B = 128


@triton.jit(do_not_specialize=["num_reqs", "num_spec", "max_model_len"])
def _write_draft_slots_kernel(
    idx_mapping_ptr, draft_ptr, total_len_ptr,                   # inputs
    token_ids_ptr,                                               # outputs
    num_reqs, num_spec, max_model_len,                           # sizes
    draft_stride, token_ids_stride,                              # strides
    BLOCK: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # Load BLOCK slots' drafts; store them (-1 -> placeholder id 0) at L, L + 1, ... of the row.
    b = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)                          # [BB]
    k = tl.arange(0, BLOCK_K)                                                  # [BK]
    b_mask = b < num_reqs
    row = tl.load(idx_mapping_ptr + b, mask=b_mask, other=0).to(tl.int64)
    length = tl.load(total_len_ptr + row, mask=b_mask, other=0)
    mask = b_mask[:, None] & (k < num_spec)[None, :]
    d = tl.load(draft_ptr + b[:, None].to(tl.int64) * draft_stride + k[None, :], mask=mask,
                other=0)
    pos = length[:, None] + k[None, :]                                         # [BB, BK]
    tl.store(token_ids_ptr + row[:, None] * token_ids_stride + pos, tl.maximum(d, 0),
             mask=mask & (pos < max_model_len))


def write_draft_slots(idx_mapping: torch.Tensor, draft_token_ids: torch.Tensor,
                      num_reqs: int, state) -> None:
    """Write each slot's drafts into its row's token buffer just past ``total_len``.

    Args:
        idx_mapping: int32 ``[>= B]`` batch slot -> state row (the speculating slots).
        draft_token_ids: int32 ``[>= B, K]``; -1 (no draft) becomes the placeholder id 0,
            whose query token is computed and never accepted.
        num_reqs: B, a CPU int.
        state: the ``RequestStateTable`` (``token_ids`` written, ``total_len`` read).
    """
    if num_reqs == 0:
        return
    k = draft_token_ids.shape[1]
    _write_draft_slots_kernel[(triton.cdiv(num_reqs, BLOCK_B),)](
        idx_mapping, draft_token_ids, state.total_len, state.token_ids,
        num_reqs, k, state.token_ids.shape[1], draft_token_ids.stride(0),
        state.token_ids.stride(0), BLOCK=BLOCK_B, BLOCK_K=triton.next_power_of_2(k))


@triton.jit(do_not_specialize=["num_reqs", "num_out_cols", "max_model_len"])
def _spec_post_update_kernel(
    idx_mapping_ptr, num_scheduled_ptr, num_draft_sched_ptr, out_ids_ptr, num_out_ptr,  # inputs
    token_ids_ptr, num_computed_ptr, total_len_ptr, last_sampled_ptr,      # outputs (in place)
    num_reqs, num_out_cols, max_model_len,                                 # sizes
    out_stride, token_ids_stride,                                          # strides
    BLOCK: tl.constexpr, BLOCK_K1: tl.constexpr,
):
    # Load the slot's counts: computed tokens advance by the non-draft tokens plus the
    # accepted drafts (num_output - 1); a plain slot (0 drafts, 1 output) is post_update.
    b = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)                          # [BB]
    j = tl.arange(0, BLOCK_K1)                                                 # [K1]
    b_mask = b < num_reqs
    row = tl.load(idx_mapping_ptr + b, mask=b_mask, other=0).to(tl.int64)
    n_sched = tl.load(num_scheduled_ptr + b, mask=b_mask, other=0)
    n_draft = tl.load(num_draft_sched_ptr + b, mask=b_mask, other=0)
    n_out = tl.load(num_out_ptr + b, mask=b_mask, other=1)
    num_computed = tl.load(num_computed_ptr + row, mask=b_mask, other=0) + n_sched - n_draft \
        + (n_out - 1)
    total = tl.load(total_len_ptr + row, mask=b_mask, other=0)
    tl.store(num_computed_ptr + row, num_computed, mask=b_mask)
    # Append the outputs only when the step reached the end of the known tokens (a partial
    # prefill chunk's sample is dropped), and only as far as the row has room.
    # NOTE: the interpreter refuses a block mask & a scalar mask: conditions stay [BB]-shaped.
    append = b_mask & (num_computed >= total)
    n_app = tl.where(append, tl.minimum(n_out, max_model_len - total), 0)      # [BB]
    n_app = tl.maximum(n_app, 0)
    ids = tl.load(out_ids_ptr + b[:, None].to(tl.int64) * out_stride + j[None, :],
                  mask=(j[None, :] < n_app[:, None]) & (j < num_out_cols)[None, :], other=0)
    tl.store(token_ids_ptr + row[:, None] * token_ids_stride + total[:, None] + j[None, :], ids,
             mask=j[None, :] < n_app[:, None])
    last = tl.sum(tl.where(j[None, :] == n_app[:, None] - 1, ids, 0), axis=1)  # [BB]
    tl.store(total_len_ptr + row, total + n_app, mask=n_app > 0)
    tl.store(last_sampled_ptr + row, last, mask=n_app > 0)


def spec_post_update(idx_mapping: torch.Tensor, num_scheduled_tokens: torch.Tensor,
                     num_draft_tokens_scheduled: torch.Tensor, output_token_ids: torch.Tensor,
                     num_output_tokens: torch.Tensor, num_reqs: int, state) -> None:
    """After verification: advance ``num_computed_tokens``; append the returned tokens.

    Args:
        idx_mapping, num_scheduled_tokens: int32 ``[>= B]`` as for ``post_update``.
        num_draft_tokens_scheduled: int32 ``[>= B]`` draft query tokens of each slot (K
            for a speculating decode, 0 for any other slot); known on the CPU.
        output_token_ids: int32 ``[>= B, C]`` returned tokens (``VerifyOutput``'s, or a
            plain slot's sample in column 0).
        num_output_tokens: int32 ``[>= B]`` (1 for a plain slot).
        num_reqs: B, a CPU int.
        state: the ``RequestStateTable``, updated in place on the device.
    """
    if num_reqs == 0:
        return
    cols = output_token_ids.shape[1]
    _spec_post_update_kernel[(triton.cdiv(num_reqs, BLOCK_B),)](
        idx_mapping, num_scheduled_tokens, num_draft_tokens_scheduled, output_token_ids,
        num_output_tokens, state.token_ids, state.num_computed_tokens, state.total_len,
        state.last_sampled_token, num_reqs, cols, state.token_ids.shape[1],
        output_token_ids.stride(0), state.token_ids.stride(0),
        BLOCK=BLOCK_B, BLOCK_K1=triton.next_power_of_2(cols))


def write_draft_slots_ref(idx_mapping, draft_token_ids, num_reqs, token_ids, total_len) -> None:
    """Plain-Python ``write_draft_slots`` (updates ``token_ids`` in place)."""
    for b in range(num_reqs):
        row, length = int(idx_mapping[b]), int(total_len[int(idx_mapping[b])])
        for i, d in enumerate(draft_token_ids[b].tolist()):
            if length + i < token_ids.shape[1]:
                token_ids[row, length + i] = max(d, 0)


def spec_post_update_ref(idx_mapping, num_scheduled_tokens, num_draft_tokens_scheduled,
                         output_token_ids, num_output_tokens, num_reqs, token_ids,
                         num_computed_tokens, total_len, last_sampled_token) -> None:
    """Plain-Python ``spec_post_update`` (updates the tensors in place)."""
    for b in range(num_reqs):
        row, n_out = int(idx_mapping[b]), int(num_output_tokens[b])
        num_computed_tokens[row] += (int(num_scheduled_tokens[b])
                                     - int(num_draft_tokens_scheduled[b]) + n_out - 1)
        total = int(total_len[row])
        if int(num_computed_tokens[row]) < total:
            continue
        n_app = max(min(n_out, token_ids.shape[1] - total), 0)
        if n_app:
            token_ids[row, total:total + n_app] = output_token_ids[b, :n_app]
            total_len[row] = total + n_app
            last_sampled_token[row] = int(output_token_ids[b, n_app - 1])
