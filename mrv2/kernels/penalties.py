"""Penalty kernels: per-row token histories on the device, and the penalties they drive.

Three kernels, each beside its plain-torch reference:

* ``apply_penalty_writes``: one launch per step writes every newly admitted row's
  history: its prompt-token mask ``[V]`` and its output-token counts ``[V]`` (a
  re-admitted preempted request brings its earlier output back).
* ``update_output_counts``: one launch per step counts each token that the step
  appends to its row (the same rule as ``post_update``).
* ``apply_penalties``: one launch per step applies repetition, presence and
  frequency penalties to ``[B, V]`` logits, reading the rows through ``idx_mapping``.

Packed layout of the staged writes (``n`` staged rows, ``L`` staged tokens in all):
``packed`` int32 ``[n * NUM_META + L]``: per staged row ``(row, token_start,
num_prompt, num_output)``, then each row's prompt ids followed by its output ids,
rows back to back (``token_start`` indexes that flat tail).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mrv2.kernels.input_prep import keeps_sample, keeps_sample_ref

#: Fields per staged row at the head of the packed array.
META_FIELDS = ("row", "token_start", "num_prompt", "num_output")
NUM_META = len(META_FIELDS)


def _block(n: int, cap: int = 1024) -> int:
    return min(cap, triton.next_power_of_2(max(n, 16)))


# --- staged writes ------------------------------------------------------------------

@triton.jit(do_not_specialize=["num_staged"])
def _penalty_writes_kernel(
    packed_ptr,                                  # inputs
    prompt_mask_ptr, output_counts_ptr,          # outputs
    num_staged, vocab_size,                      # sizes
    prompt_mask_stride, output_counts_stride,    # strides
    NUM_META: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_T: tl.constexpr,
):
    i = tl.program_id(0)  # one program per staged row
    meta = packed_ptr + i * NUM_META
    row = tl.load(meta + 0).to(tl.int64)
    token_start = tl.load(meta + 1)
    num_prompt = tl.load(meta + 2)
    num_output = tl.load(meta + 3)
    mask_row = prompt_mask_ptr + row * prompt_mask_stride
    counts_row = output_counts_ptr + row * output_counts_stride
    # Stage 1: clear the row (the previous owner's history).
    for v0 in range(0, vocab_size, BLOCK_V):
        v = v0 + tl.arange(0, BLOCK_V)
        tl.store(mask_row + v, tl.zeros([BLOCK_V], dtype=tl.int8), mask=v < vocab_size)
        tl.store(counts_row + v, tl.zeros([BLOCK_V], dtype=tl.int32), mask=v < vocab_size)
    # NOTE: the scatters below hit words that other threads of this program just
    # cleared; the barrier orders them (a no-op in the interpreter, which is serial).
    tl.debug_barrier()
    # Stage 2: mark the prompt tokens (duplicates all store 1: no atomics needed).
    src = packed_ptr + num_staged * NUM_META + token_start
    for t0 in range(0, num_prompt, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        ok = t < num_prompt
        ids = tl.load(src + t, mask=ok, other=0)
        tl.store(mask_row + ids, tl.full([BLOCK_T], 1, dtype=tl.int8), mask=ok)
    # Stage 3: count the earlier output tokens (duplicates collide: atomics).
    src = src + num_prompt
    for t0 in range(0, num_output, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        ok = t < num_output
        ids = tl.load(src + t, mask=ok, other=0)
        tl.atomic_add(counts_row + ids, tl.full([BLOCK_T], 1, dtype=tl.int32), mask=ok)


def apply_penalty_writes(packed: torch.Tensor, num_staged: int, *, prompt_mask: torch.Tensor,
                         output_counts: torch.Tensor, max_tokens_per_row: int) -> None:
    """Write ``num_staged`` packed rows' histories (one launch; 0 launches nothing).

    Args:
        packed: int32 ``[num_staged * NUM_META + L]`` on the device (module docstring).
        num_staged: staged rows (a CPU int).
        prompt_mask: int8 ``[R, V]``, rewritten in the staged rows.
        output_counts: int32 ``[R, V]``, rewritten in the staged rows.
        max_tokens_per_row: the longest staged prompt or output (sizes the token block).
    """
    if num_staged == 0:
        return
    vocab_size = prompt_mask.shape[1]
    _penalty_writes_kernel[(num_staged,)](
        packed, prompt_mask, output_counts, num_staged, vocab_size,
        prompt_mask.stride(0), output_counts.stride(0),
        NUM_META=NUM_META, BLOCK_V=_block(vocab_size, 4096),
        BLOCK_T=_block(max_tokens_per_row))


def apply_penalty_writes_ref(staged: list[tuple[int, list[int], list[int]]],
                             prompt_mask: torch.Tensor, output_counts: torch.Tensor) -> None:
    """Plain-torch specification: ``(row, prompt_ids, output_ids)`` per row, in place."""
    for row, prompt, output in staged:
        prompt_mask[row] = 0
        output_counts[row] = 0
        for t in prompt:
            prompt_mask[row, t] = 1
        for t in output:
            output_counts[row, t] += 1


# --- counting the appended tokens ------------------------------------------------------

@triton.jit(do_not_specialize=["num_reqs"])
def _update_counts_kernel(
    idx_mapping_ptr, num_scheduled_ptr, sampled_ptr, num_computed_ptr, total_len_ptr,  # in
    output_counts_ptr,                                                               # out
    num_reqs, max_model_len,                                                         # sizes
    output_counts_stride,                                                            # strides
    BLOCK: tl.constexpr,
):
    b = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = b < num_reqs
    row = tl.load(idx_mapping_ptr + b, mask=mask, other=0).to(tl.int64)
    n = tl.load(num_scheduled_ptr + b, mask=mask, other=0)
    sampled = tl.load(sampled_ptr + b, mask=mask, other=0).to(tl.int64)
    num_computed = tl.load(num_computed_ptr + row, mask=mask, other=0) + n
    total = tl.load(total_len_ptr + row, mask=mask, other=0)
    # The very rule of post_update (one helper): is this step's sample appended?
    append = mask & keeps_sample(num_computed, total, max_model_len)
    # Rows are distinct within a step, so each address gets at most one increment.
    counts = output_counts_ptr + row * output_counts_stride + sampled
    tl.store(counts, tl.load(counts, mask=append, other=0) + 1, mask=append)


def update_output_counts(idx_mapping: torch.Tensor, num_scheduled_tokens: torch.Tensor,
                         sampled_token_ids: torch.Tensor, num_reqs: int, state,
                         output_counts: torch.Tensor) -> None:
    """Count each sample that ``post_update`` is about to append (one launch).

    Args:
        idx_mapping, num_scheduled_tokens: int32 ``[B_pad]`` as for ``post_update``.
        sampled_token_ids: ``[B_pad]`` int32 or int64.
        num_reqs: real requests (a CPU int).
        state: the ``RequestStateTable``; reads ``num_computed_tokens`` and ``total_len``.
        output_counts: int32 ``[R, V]``, incremented in place.

    NOTE: call this *before* ``post_update``: it reads the table as it was before the
    step advanced it. After ``post_update`` a partial prefill chunk ending one token
    short of the prompt looks exactly like an append, so the rule cannot be recovered.
    """
    if num_reqs == 0:
        return
    block = 1024  # NOTE: fixed: a batch-sized block would compile a variant per size
    _update_counts_kernel[(triton.cdiv(num_reqs, block),)](
        idx_mapping, num_scheduled_tokens, sampled_token_ids,
        state.num_computed_tokens, state.total_len, output_counts,
        num_reqs, state.token_ids.shape[1], output_counts.stride(0), BLOCK=block)


def update_output_counts_ref(idx_mapping: torch.Tensor, num_scheduled_tokens: torch.Tensor,
                             sampled_token_ids: torch.Tensor, num_reqs: int,
                             num_computed_tokens: torch.Tensor, total_len: torch.Tensor,
                             max_model_len: int, output_counts: torch.Tensor) -> None:
    """Plain-torch specification of ``update_output_counts`` (in place)."""
    for b in range(num_reqs):
        row = int(idx_mapping[b])
        total = int(total_len[row])
        if keeps_sample_ref(int(num_computed_tokens[row]) + int(num_scheduled_tokens[b]),
                            total, max_model_len):
            output_counts[row, int(sampled_token_ids[b])] += 1


# --- applying the penalties ------------------------------------------------------------

@triton.jit
def _apply_penalties_kernel(
    logits_ptr, idx_mapping_ptr, prompt_mask_ptr, output_counts_ptr,   # inputs (logits in place)
    rep_ptr, pres_ptr, freq_ptr,
    vocab_size,                                                       # sizes
    logits_stride, prompt_mask_stride, output_counts_stride,          # strides
    BLOCK_V: tl.constexpr,
):
    b = tl.program_id(0)       # batch slot
    vb = tl.program_id(1)      # vocab block
    row = tl.load(idx_mapping_ptr + b).to(tl.int64)
    rep = tl.load(rep_ptr + row)
    pres = tl.load(pres_ptr + row)
    freq = tl.load(freq_ptr + row)
    # Neutral rows read nothing more and write nothing.
    if (rep != 1.0) | (pres != 0.0) | (freq != 0.0):
        # Load this block of the row's logits and history.
        v = vb * BLOCK_V + tl.arange(0, BLOCK_V)
        ok = v < vocab_size
        ptrs = logits_ptr + b * logits_stride + v
        x = tl.load(ptrs, mask=ok, other=0.0)
        x32 = x.to(tl.float32)
        counts = tl.load(output_counts_ptr + row * output_counts_stride + v, mask=ok, other=0)
        in_prompt = tl.load(prompt_mask_ptr + row * prompt_mask_stride + v, mask=ok, other=0)
        # Repetition: divide positive / multiply negative logits of any seen token.
        seen = (in_prompt != 0) | (counts > 0)
        x32 = tl.where(seen, tl.where(x32 > 0, x32 / rep, x32 * rep), x32)
        # Frequency and presence: output tokens only.
        x32 = x32 - freq * counts.to(tl.float32) - pres * (counts > 0).to(tl.float32)
        tl.store(ptrs, x32.to(x.dtype), mask=ok)


def apply_penalties(logits: torch.Tensor, idx_mapping: torch.Tensor, prompt_mask: torch.Tensor,
                    output_counts: torch.Tensor, repetition_penalty: torch.Tensor,
                    presence_penalty: torch.Tensor, frequency_penalty: torch.Tensor) -> torch.Tensor:
    """Repetition, presence and frequency penalties, in place (one launch).

    Args:
        logits: ``[B, V]`` float32/bf16/fp16, last dim contiguous; modified in place.
        idx_mapping: int32 ``[>= B]`` batch slot -> state row.
        prompt_mask: int8 ``[R, V]``; output_counts: int32 ``[R, V]``.
        repetition_penalty, presence_penalty, frequency_penalty: f32 ``[R]`` (the state
            table's views; 1/0/0 are neutral and skipped).

    Returns:
        ``logits`` (the same tensor).
    """
    num_reqs, vocab_size = logits.shape
    if num_reqs == 0:
        return logits
    # NOTE: a big vocab block keeps the interpreter fast; on the GPU 4096 f32 is 16 KB/program.
    block = _block(vocab_size, 4096)
    _apply_penalties_kernel[(num_reqs, triton.cdiv(vocab_size, block))](
        logits, idx_mapping, prompt_mask, output_counts,
        repetition_penalty, presence_penalty, frequency_penalty,
        vocab_size, logits.stride(0), prompt_mask.stride(0), output_counts.stride(0),
        BLOCK_V=block)
    return logits


def apply_penalties_ref(logits: torch.Tensor, idx_mapping: torch.Tensor,
                        prompt_mask: torch.Tensor, output_counts: torch.Tensor,
                        repetition_penalty: torch.Tensor, presence_penalty: torch.Tensor,
                        frequency_penalty: torch.Tensor) -> torch.Tensor:
    """Plain-torch specification of ``apply_penalties`` (returns a new tensor)."""
    rows = idx_mapping[:logits.shape[0]].long()                     # [B]
    counts = output_counts[rows]                                    # [B, V]
    seen = (prompt_mask[rows] != 0) | (counts > 0)                  # [B, V]
    rep = repetition_penalty[rows][:, None]                         # [B, 1]
    x = logits.float()
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    x = x - frequency_penalty[rows][:, None] * counts - presence_penalty[rows][:, None] * (counts > 0)
    return x.to(logits.dtype)
