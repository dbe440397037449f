"""GPU-native input preparation: the step's inputs built from the state table.

V1 built ``input_ids``, ``positions``, ``query_start_loc`` and ``seq_lens`` with
numpy on the CPU and copied them over, so the tokens sampled in step N had to
reach the CPU before step N+1 could be prepared. Here two kernels do it on the
device: ``prepare_inputs`` reads the state table through ``idx_mapping``
(batch slot -> state row), and ``post_update`` appends each sampled token to its
row, where the next ``prepare_inputs`` finds it. The sampled tokens never leave
the device on this path. Each kernel sits beside a plain torch reference.
See notebooks/04_triton_input_prep.ipynb.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

#: Lanes per loop iteration. NOTE: fixed, not sized to the batch: each distinct
#: constexpr (and each int argument Triton specialises on: ==1, divisible by 16) is
#: one more compiled kernel, met for the first time mid-run (~0.3 s of that run).
#: The size arguments are in ``do_not_specialize`` for the same reason.
BLOCK = 1024


# --- prepare_inputs ---------------------------------------------------------------

@triton.jit(do_not_specialize=["num_reqs", "num_reqs_padded", "num_tokens_padded"])
def _prepare_inputs_kernel(
    idx_mapping_ptr, num_scheduled_ptr, token_ids_ptr, num_computed_ptr,    # inputs
    query_start_loc_ptr, seq_lens_ptr, input_ids_ptr, positions_ptr,        # outputs
    logits_indices_ptr,
    num_reqs, num_reqs_padded, num_tokens_padded, max_model_len,           # sizes
    token_ids_stride,                                                      # strides
    BLOCK_B: tl.constexpr, BLOCK_T: tl.constexpr,
):
    # One program per batch slot, plus a last one (b == num_reqs_padded) that fills
    # the padding tokens.
    b = tl.program_id(0)
    is_real = b < num_reqs
    is_slot = b < num_reqs_padded
    # Stage 1: this slot's first token = the sum of the real counts before it.
    # NOTE: every program re-sums the prefix (O(B^2) loads in all, but one launch and
    # no separate cumsum pass); fine for B up to a few thousand.
    start = 0
    for k in range(0, num_reqs, BLOCK_B):
        offs = k + tl.arange(0, BLOCK_B)
        counts = tl.load(num_scheduled_ptr + offs, mask=offs < tl.minimum(num_reqs, b),
                         other=0)
        start += tl.sum(counts, axis=0)
    n = tl.load(num_scheduled_ptr + b, mask=is_real, other=0)
    row = tl.load(idx_mapping_ptr + b, mask=is_real, other=0).to(tl.int64)
    num_computed = tl.load(num_computed_ptr + row, mask=is_real, other=0)
    end = tl.where(is_slot, start + n, num_tokens_padded)

    # Stage 2: per-slot outputs (padding slots: query length 0, seq_len 0).
    tl.store(query_start_loc_ptr, 0, mask=b == 0)
    tl.store(query_start_loc_ptr + b + 1, start + n, mask=is_slot)
    tl.store(seq_lens_ptr + b, num_computed + n, mask=is_slot)
    tl.store(logits_indices_ptr + b, tl.where(is_real, tl.maximum(start + n - 1, 0), 0),
             mask=is_slot)

    # Stage 3: per-token outputs; a decode's one token is the last sampled one,
    # which post_update already wrote into token_ids on the device.
    # NOTE: the interpreter turns `block_mask & scalar_mask` into int32, which
    # tl.load refuses as a mask: fold scalar conditions into a bound instead.
    pos_limit = tl.where(is_real, max_model_len, 0)
    for k in range(start, end, BLOCK_T):
        t = k + tl.arange(0, BLOCK_T)
        mask = t < end
        pos = tl.where(is_real, num_computed + (t - start), 0)
        ids = tl.load(token_ids_ptr + row * token_ids_stride + pos,
                      mask=mask & (pos < pos_limit), other=0)
        tl.store(positions_ptr + t, pos, mask=mask)
        tl.store(input_ids_ptr + t, ids, mask=mask)


def prepare_inputs(idx_mapping: torch.Tensor, num_scheduled_tokens: torch.Tensor,
                   num_reqs: int, num_tokens_padded: int, state, *,
                   query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                   input_ids: torch.Tensor, positions: torch.Tensor,
                   logits_indices: torch.Tensor) -> None:
    """Build one step's flat inputs on the device (one kernel launch).

    Args:
        idx_mapping: int32 ``[B_pad]`` batch slot -> state row (past ``num_reqs``:
            don't-care).
        num_scheduled_tokens: int32 ``[B_pad]`` new tokens per slot (past
            ``num_reqs``: don't-care, treated as 0).
        num_reqs: real requests; num_tokens_padded: tokens to fill (CPU ints).
        state: the ``RequestStateTable`` (reads ``token_ids``, ``num_computed_tokens``).
        query_start_loc: int32 ``[>= B_pad + 1]`` out.
        seq_lens, logits_indices: int32 ``[>= B_pad]`` out.
        input_ids, positions: int32 ``[>= num_tokens_padded]`` out; padding tokens
            get id 0 and position 0.
    """
    num_reqs_padded = idx_mapping.shape[0]
    _prepare_inputs_kernel[(num_reqs_padded + 1,)](
        idx_mapping, num_scheduled_tokens, state.token_ids, state.num_computed_tokens,
        query_start_loc, seq_lens, input_ids, positions, logits_indices,
        num_reqs, num_reqs_padded, num_tokens_padded, state.token_ids.shape[1],
        state.token_ids.stride(0),
        BLOCK_B=BLOCK, BLOCK_T=BLOCK)


class PreparedInputs(NamedTuple):
    query_start_loc: torch.Tensor   # [B_pad + 1]
    seq_lens: torch.Tensor          # [B_pad]
    input_ids: torch.Tensor         # [T_pad]
    positions: torch.Tensor         # [T_pad]
    logits_indices: torch.Tensor    # [B_pad]


def prepare_inputs_ref(idx_mapping: torch.Tensor, num_scheduled_tokens: torch.Tensor,
                       num_reqs: int, num_tokens_padded: int, token_ids: torch.Tensor,
                       num_computed_tokens: torch.Tensor) -> PreparedInputs:
    """Plain-torch specification of ``prepare_inputs`` (CPU, loops; new tensors).

    Args:
        idx_mapping, num_scheduled_tokens: ``[B_pad]``; num_reqs, num_tokens_padded: ints.
        token_ids: ``[R, max_model_len]``; num_computed_tokens: ``[R]`` (the table's).
    """
    num_reqs_padded = idx_mapping.shape[0]
    i32 = {"dtype": torch.int32}
    counts = [int(n) for n in num_scheduled_tokens[:num_reqs]] + [0] * (num_reqs_padded
                                                                        - num_reqs)
    query_start_loc = torch.zeros(num_reqs_padded + 1, **i32)
    query_start_loc[1:] = torch.tensor(counts, dtype=torch.int64).cumsum(0)
    seq_lens = torch.zeros(num_reqs_padded, **i32)
    logits_indices = torch.zeros(num_reqs_padded, **i32)
    input_ids = torch.zeros(num_tokens_padded, **i32)
    positions = torch.zeros(num_tokens_padded, **i32)
    for b in range(num_reqs):
        row, start, n = int(idx_mapping[b]), int(query_start_loc[b]), counts[b]
        computed = int(num_computed_tokens[row])
        seq_lens[b] = computed + n
        logits_indices[b] = max(start + n - 1, 0)
        for i in range(n):
            positions[start + i] = computed + i
            if computed + i < token_ids.shape[1]:
                input_ids[start + i] = token_ids[row, computed + i]
    return PreparedInputs(query_start_loc, seq_lens, input_ids, positions, logits_indices)


# --- post_update --------------------------------------------------------------------

@triton.jit
def keeps_sample(num_computed, total_len, max_model_len):
    """Whether a step's sample is appended to its row (the one rule, shared by kernels).

    Kept only when the step reached the end of the known tokens (``num_computed``:
    after this step's tokens) -- a partial prefill chunk's sample is meaningless --
    and the row has room for it (``total_len < max_model_len``).
    """
    return (num_computed >= total_len) & (total_len < max_model_len)


def keeps_sample_ref(num_computed: int, total_len: int, max_model_len: int) -> bool:
    """Plain-Python ``keeps_sample`` (for the torch references)."""
    return num_computed >= total_len and total_len < max_model_len


@triton.jit(do_not_specialize=["num_reqs"])
def _post_update_kernel(
    idx_mapping_ptr, num_scheduled_ptr, sampled_ptr,                 # inputs
    token_ids_ptr, num_computed_ptr, total_len_ptr, last_sampled_ptr,  # outputs (in place)
    num_reqs, max_model_len,                                         # sizes
    token_ids_stride,                                                # strides
    BLOCK: tl.constexpr,
):
    # Many requests per program: rows are distinct, so their stores never collide.
    b = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = b < num_reqs
    row = tl.load(idx_mapping_ptr + b, mask=mask, other=0).to(tl.int64)
    n = tl.load(num_scheduled_ptr + b, mask=mask, other=0)
    sampled = tl.load(sampled_ptr + b, mask=mask, other=0).to(tl.int32)
    num_computed = tl.load(num_computed_ptr + row, mask=mask, other=0) + n
    total = tl.load(total_len_ptr + row, mask=mask, other=0)
    tl.store(num_computed_ptr + row, num_computed, mask=mask)
    append = mask & keeps_sample(num_computed, total, max_model_len)
    tl.store(token_ids_ptr + row * token_ids_stride + total, sampled, mask=append)
    tl.store(total_len_ptr + row, total + 1, mask=append)
    tl.store(last_sampled_ptr + row, sampled, mask=append)


def post_update(idx_mapping: torch.Tensor, num_scheduled_tokens: torch.Tensor,
                sampled_token_ids: torch.Tensor, num_reqs: int, state) -> None:
    """After sampling: advance ``num_computed_tokens``; append finished samples.

    Args:
        idx_mapping, num_scheduled_tokens: int32 ``[B_pad]`` as for prepare_inputs.
        sampled_token_ids: ``[B_pad]`` int32 or int64, one token per slot.
        num_reqs: real requests (a CPU int); padding slots are not touched.
        state: the ``RequestStateTable``, updated in place on the device.
    """
    if num_reqs == 0:
        return
    _post_update_kernel[(triton.cdiv(num_reqs, BLOCK),)](
        idx_mapping, num_scheduled_tokens, sampled_token_ids,
        state.token_ids, state.num_computed_tokens, state.total_len,
        state.last_sampled_token, num_reqs, state.token_ids.shape[1],
        state.token_ids.stride(0), BLOCK=BLOCK)


def post_update_ref(idx_mapping: torch.Tensor, num_scheduled_tokens: torch.Tensor,
                    sampled_token_ids: torch.Tensor, num_reqs: int, token_ids: torch.Tensor,
                    num_computed_tokens: torch.Tensor, total_len: torch.Tensor,
                    last_sampled_token: torch.Tensor) -> None:
    """Plain-torch specification of ``post_update`` (updates the tensors in place)."""
    max_model_len = token_ids.shape[1]
    for b in range(num_reqs):
        row = int(idx_mapping[b])
        num_computed_tokens[row] += int(num_scheduled_tokens[b])
        total = int(total_len[row])
        if keeps_sample_ref(int(num_computed_tokens[row]), total, max_model_len):
            token_ids[row, total] = int(sampled_token_ids[b])
            total_len[row] = total + 1
            last_sampled_token[row] = int(sampled_token_ids[b])
