"""Draft slots in the state table: write the next drafts, then append the accepted run.

MRV2 keeps the drafts where the input-prep kernel already looks: the proposer's K drafts
for row ``r`` go to ``token_ids[r, total_len : total_len + K]`` (and, with -1 for "no
draft", to ``draft_token_ids[r]``). A speculating decode of ``1 + K`` scheduled tokens
then reads ``[last sampled, d1 .. dK]`` at positions ``num_computed .. num_computed + K``
through the unchanged ``prepare_inputs``; slot mapping and block tables need nothing new.

After verification, ``spec_post_update`` does on the device what ``post_update`` does for
one token: it advances ``num_computed_tokens`` by the tokens whose KV is now valid (the
scheduled ones minus the rejected drafts), appends the ``a + 1`` output tokens, moves
``total_len`` and ``last_sampled_token``. No accepted count ever reaches the CPU. Each
kernel sits beside its plain torch reference. See notebooks/09_speculative_decoding.ipynb.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: Batch slots per program (fixed: one compiled variant for every batch size).
BLOCK = 128


@triton.jit(do_not_specialize=["num_reqs"])
def _spec_post_update_kernel(
    idx_mapping_ptr, num_scheduled_ptr, num_spec_ptr, out_tokens_ptr, num_sampled_ptr,  # in
    token_ids_ptr, num_computed_ptr, total_len_ptr, last_sampled_ptr,   # outputs (in place)
    num_reqs, max_model_len,                                            # sizes
    token_ids_stride, out_stride,                                       # strides
    BLOCK: tl.constexpr, WIDTH: tl.constexpr,
):
    # Load: many slots per program; their rows are distinct, so stores never collide.
    b = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)                      # [BLOCK]
    mask = b < num_reqs
    row = tl.load(idx_mapping_ptr + b, mask=mask, other=0).to(tl.int64)
    n = tl.load(num_scheduled_ptr + b, mask=mask, other=0)
    k = tl.load(num_spec_ptr + b, mask=mask, other=0)
    m = tl.load(num_sampled_ptr + b, mask=mask, other=1)                    # a + 1
    # Compute: the rejected drafts' KV is not valid: they do not count as computed.
    num_computed = tl.load(num_computed_ptr + row, mask=mask, other=0) + n - k + (m - 1)
    total = tl.load(total_len_ptr + row, mask=mask, other=0)
    tl.store(num_computed_ptr + row, num_computed, mask=mask)
    # Store: append the run only when the step reached the end of the known tokens (a
    # partial prefill chunk samples nothing real); a full row keeps what fits.
    append = mask & (num_computed >= total) & (total < max_model_len)
    j = tl.arange(0, WIDTH)                                                 # [WIDTH]
    run = j[None, :] < m[:, None]                                           # [BLOCK, WIDTH]
    toks = tl.load(out_tokens_ptr + b[:, None].to(tl.int64) * out_stride + j[None, :],
                   mask=mask[:, None] & run, other=0)
    dst = total[:, None] + j[None, :]
    tl.store(token_ids_ptr + row[:, None] * token_ids_stride + dst, toks,
             mask=append[:, None] & run & (dst < max_model_len))
    tl.store(total_len_ptr + row, tl.minimum(total + m, max_model_len), mask=append)
    last = tl.sum(tl.where(j[None, :] == (m - 1)[:, None], toks, 0), axis=1)
    tl.store(last_sampled_ptr + row, last, mask=append)


def spec_post_update(idx_mapping: torch.Tensor, num_scheduled_tokens: torch.Tensor,
                     num_spec_tokens: torch.Tensor, output_token_ids: torch.Tensor,
                     num_sampled: torch.Tensor, num_reqs: int, state) -> None:
    """After verification: advance ``num_computed_tokens``, append each slot's run.

    Args:
        idx_mapping, num_scheduled_tokens: int32 ``[>= num_reqs]`` as for ``post_update``.
        num_spec_tokens: int32 ``[>= num_reqs]`` K_b, the drafts slot ``b`` verified.
        output_token_ids: int32 ``[B, K + 1]`` the run (first ``num_sampled[b]`` valid).
        num_sampled: int32 ``[B]`` a_b + 1 (1 for a slot that did not speculate).
        num_reqs: real slots (a CPU int).
        state: the ``RequestStateTable``, updated in place on the device.
    """
    if num_reqs == 0:
        return
    width = output_token_ids.shape[1]
    _spec_post_update_kernel[(triton.cdiv(num_reqs, BLOCK),)](
        idx_mapping, num_scheduled_tokens, num_spec_tokens, output_token_ids, num_sampled,
        state.token_ids, state.num_computed_tokens, state.total_len, state.last_sampled_token,
        num_reqs, state.token_ids.shape[1], state.token_ids.stride(0),
        output_token_ids.stride(0), BLOCK=BLOCK, WIDTH=max(2, triton.next_power_of_2(width)))


def spec_post_update_ref(idx_mapping, num_scheduled_tokens, num_spec_tokens, output_token_ids,
                         num_sampled, num_reqs: int, token_ids, num_computed_tokens, total_len,
                         last_sampled_token) -> None:
    """Plain-torch specification of ``spec_post_update`` (loops; updates in place)."""
    max_model_len = token_ids.shape[1]
    for b in range(num_reqs):
        row, m = int(idx_mapping[b]), int(num_sampled[b])
        num_computed_tokens[row] += (int(num_scheduled_tokens[b]) - int(num_spec_tokens[b])
                                     + m - 1)
        total = int(total_len[row])
        if int(num_computed_tokens[row]) >= total and total < max_model_len:
            for j in range(m):
                if total + j < max_model_len:
                    token_ids[row, total + j] = int(output_token_ids[b, j])
            total_len[row] = min(total + m, max_model_len)
            last_sampled_token[row] = int(output_token_ids[b, m - 1])


@triton.jit(do_not_specialize=["num_reqs"])
def _write_draft_slots_kernel(
    idx_mapping_ptr, drafts_ptr, total_len_ptr,                # inputs
    token_ids_ptr, draft_token_ids_ptr,                        # outputs
    num_reqs, max_model_len, num_spec,                         # sizes
    token_ids_stride, drafts_stride, draft_buf_stride,         # strides
    BLOCK: tl.constexpr, WIDTH: tl.constexpr,
):
    # Load the drafts of BLOCK slots.
    b = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = b < num_reqs
    row = tl.load(idx_mapping_ptr + b, mask=mask, other=0).to(tl.int64)
    total = tl.load(total_len_ptr + row, mask=mask, other=0)
    j = tl.arange(0, WIDTH)
    cols = mask[:, None] & (j[None, :] < num_spec)
    d = tl.load(drafts_ptr + b[:, None].to(tl.int64) * drafts_stride + j[None, :],
                mask=cols, other=-1)
    # Store: the -1 buffer as is; the token slots a valid id (0) where there is no draft.
    tl.store(draft_token_ids_ptr + row[:, None] * draft_buf_stride + j[None, :], d, mask=cols)
    dst = total[:, None] + j[None, :]
    tl.store(token_ids_ptr + row[:, None] * token_ids_stride + dst, tl.maximum(d, 0),
             mask=cols & (dst < max_model_len))


def write_draft_slots(drafts: torch.Tensor, idx_mapping: torch.Tensor, num_reqs: int,
                      state) -> None:
    """Write each slot's drafts past its ``total_len`` and into ``state.draft_token_ids``.

    Args:
        drafts: int32 ``[num_reqs, K]`` (-1: no draft).
        idx_mapping: int32 ``[>= num_reqs]`` batch slot -> row.
        num_reqs: real slots (a CPU int).
        state: the ``RequestStateTable`` (its ``draft_token_ids`` is ``[R, K]``).
    """
    num_spec = state.draft_token_ids.shape[1]
    if num_reqs == 0 or num_spec == 0:
        return
    drafts = drafts.to(torch.int32)
    _write_draft_slots_kernel[(triton.cdiv(num_reqs, BLOCK),)](
        idx_mapping, drafts, state.total_len, state.token_ids, state.draft_token_ids,
        num_reqs, state.token_ids.shape[1], num_spec, state.token_ids.stride(0),
        drafts.stride(0), state.draft_token_ids.stride(0),
        BLOCK=BLOCK, WIDTH=max(2, triton.next_power_of_2(num_spec)))


def write_draft_slots_ref(drafts, idx_mapping, num_reqs: int, total_len, token_ids,
                          draft_token_ids) -> None:
    """Plain-torch specification of ``write_draft_slots`` (in place)."""
    max_model_len = token_ids.shape[1]
    for b in range(num_reqs):
        row, total = int(idx_mapping[b]), int(total_len[int(idx_mapping[b])])
        for j in range(draft_token_ids.shape[1]):
            d = int(drafts[b, j])
            draft_token_ids[row, j] = d
            if total + j < max_model_len:
                token_ids[row, total + j] = max(d, 0)
