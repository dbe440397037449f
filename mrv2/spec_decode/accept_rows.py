"""``exact`` acceptance straight from the state table and the sampler's rows: one launch.

The runner's ``exact`` step used to gather the drafts of the batch's rows
(``draft_token_ids[idx_mapping]``), mask those past each request's ``K_b``, gather the
target samples into the ``[B, K + 1]`` layout (``sampled[gather]``), run the acceptance
kernel, and later gather the drafts once more to count the proposed ones: about twenty
small eager ops, each a launch and several microseconds of host time on a GPU whose step is
host-bound. ``exact_accept_rows`` does all of it in one Triton program per block of
requests, reading the drafts through ``idx_mapping`` and the samples through ``gather``,
and writes the step's outputs into one int32 allocation. ``exact_accept_rows_ref`` is the
same computation in plain torch (the ops it replaces); tests/test_spec_accept_rows.py
compares them.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from mrv2.platform import TRITON_INTERPRET


class AcceptRowsOutput(NamedTuple):
    output_token_ids: torch.Tensor   # [B, K + 1] int32, -1 padded
    num_output_tokens: torch.Tensor  # [B] int32, num_accepted + 1
    num_accepted: torch.Tensor       # [B] int32
    num_draft_tokens: torch.Tensor   # [B] int32, drafts proposed (>= 0) among the first K_b


@triton.jit(do_not_specialize=["num_reqs", "num_spec"])
def _exact_accept_rows_kernel(
    draft_ptr, idx_mapping_ptr, sampled_ptr, gather_ptr, num_spec_ptr,   # inputs
    out_ptr, num_out_ptr, num_acc_ptr, num_drafts_ptr,                    # outputs
    num_reqs, num_spec,                                                   # sizes
    draft_stride, gather_stride, out_stride,                              # strides
    BLOCK_B: tl.constexpr, BLOCK_K1: tl.constexpr,
):
    b = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)                     # [BB]
    j = tl.arange(0, BLOCK_K1)                                                 # [K1]
    b_mask = b < num_reqs
    k_b = tl.load(num_spec_ptr + b, mask=b_mask, other=0)                      # [BB]
    row = tl.load(idx_mapping_ptr + b, mask=b_mask, other=0).to(tl.int64)      # [BB]
    in_draft = b_mask[:, None] & (j[None, :] < k_b[:, None])                   # j < K_b
    in_out = b_mask[:, None] & (j <= num_spec)[None, :]                        # j <= K
    d = tl.load(draft_ptr + row[:, None] * draft_stride + j[None, :], mask=in_draft, other=-1)
    g = tl.load(gather_ptr + b[:, None].to(tl.int64) * gather_stride + j[None, :],
                mask=in_out, other=0)
    t = tl.load(sampled_ptr + g, mask=in_out, other=-1).to(tl.int32)           # [BB, K1]
    ok = in_draft & (d == t) & (d >= 0)
    # The first position not accepted (at most K_b) takes the target's own sample.
    a = tl.min(tl.where(ok, BLOCK_K1, j[None, :]), axis=1)                    # [BB]
    out = tl.where(j[None, :] < a[:, None], d, tl.where(j[None, :] == a[:, None], t, -1))
    num_drafts = tl.sum((in_draft & (d >= 0)).to(tl.int32), axis=1)            # [BB]
    tl.store(out_ptr + b[:, None].to(tl.int64) * out_stride + j[None, :], out, mask=in_out)
    tl.store(num_out_ptr + b, a + 1, mask=b_mask)
    tl.store(num_acc_ptr + b, a, mask=b_mask)
    tl.store(num_drafts_ptr + b, num_drafts, mask=b_mask)


def _check(draft_token_ids, idx_mapping, sampled, gather, num_spec_tokens) -> None:
    if draft_token_ids.dim() != 2:
        raise ValueError(f"draft_token_ids must be [R, K], got {tuple(draft_token_ids.shape)}")
    k = draft_token_ids.shape[1]
    num_reqs = idx_mapping.shape[0]
    if gather.shape != (num_reqs, k + 1):
        raise ValueError(f"gather must be [B, K + 1] = [{num_reqs}, {k + 1}], "
                         f"got {tuple(gather.shape)}")
    if num_spec_tokens.shape != (num_reqs,):
        raise ValueError(f"num_spec_tokens must be [B] = [{num_reqs}], "
                         f"got {tuple(num_spec_tokens.shape)}")
    if sampled.dim() != 1:
        raise ValueError(f"sampled must be [N], got {tuple(sampled.shape)}")


def exact_accept_rows(draft_token_ids: torch.Tensor, idx_mapping: torch.Tensor,
                      sampled: torch.Tensor, gather: torch.Tensor,
                      num_spec_tokens: torch.Tensor) -> AcceptRowsOutput:
    """``exact`` acceptance of the batch's drafts against the target's per-row samples.

    Request ``b`` accepts its drafts while each equals the target's sample at its position
    (``sampled[gather[b, j]]``); drafts past ``K_b`` and ``-1`` ones are never accepted.
    One launch, no sync.

    Args:
        draft_token_ids: int ``[R, K]`` the state table's draft slots (-1: none).
        idx_mapping: int ``[B]`` state row of each request.
        sampled: int ``[N]`` the target's sample of every logits row.
        gather: int64 ``[B, K + 1]`` logits row of request b's j-th candidate.
        num_spec_tokens: int ``[B]`` K_b <= K (0: the request did not speculate).

    Returns:
        ``AcceptRowsOutput``: contiguous int32 views of one allocation.
    """
    _check(draft_token_ids, idx_mapping, sampled, gather, num_spec_tokens)
    num_reqs, k = idx_mapping.shape[0], draft_token_ids.shape[1]
    # One allocation, four contiguous views (kernels downstream read them flat).
    buf = torch.empty(num_reqs * (k + 4), dtype=torch.int32, device=sampled.device)
    out = buf[:num_reqs * (k + 1)].view(num_reqs, k + 1)                  # [B, K + 1]
    num_out, num_acc, num_drafts = buf[num_reqs * (k + 1):].view(3, num_reqs).unbind(0)
    if num_reqs:
        block_b = 256 if TRITON_INTERPRET else 32
        _exact_accept_rows_kernel[(triton.cdiv(num_reqs, block_b),)](
            draft_token_ids, idx_mapping, sampled, gather, num_spec_tokens,
            out, num_out, num_acc, num_drafts,
            num_reqs, k, draft_token_ids.stride(0), gather.stride(0), out.stride(0),
            BLOCK_B=block_b, BLOCK_K1=triton.next_power_of_2(k + 1))
    return AcceptRowsOutput(out, num_out, num_acc, num_drafts)


def exact_accept_rows_ref(draft_token_ids: torch.Tensor, idx_mapping: torch.Tensor,
                          sampled: torch.Tensor, gather: torch.Tensor,
                          num_spec_tokens: torch.Tensor) -> AcceptRowsOutput:
    """Plain torch reference of ``exact_accept_rows`` (a loop over requests)."""
    _check(draft_token_ids, idx_mapping, sampled, gather, num_spec_tokens)
    num_reqs, k = idx_mapping.shape[0], draft_token_ids.shape[1]
    out = torch.full((num_reqs, k + 1), -1, dtype=torch.int32)
    num_out, num_acc, num_drafts = (torch.zeros(num_reqs, dtype=torch.int32) for _ in range(3))
    for b in range(num_reqs):
        k_b = int(num_spec_tokens[b])
        drafts = draft_token_ids[int(idx_mapping[b])].cpu()[:k_b].to(torch.int32)
        targets = sampled.cpu()[gather[b].cpu()].to(torch.int32)           # [K + 1]
        a = 0
        while a < k_b and drafts[a] >= 0 and drafts[a] == targets[a]:
            a += 1
        out[b, :a] = drafts[:a]
        out[b, a] = targets[a]
        num_out[b], num_acc[b] = a + 1, a
        num_drafts[b] = int((drafts >= 0).sum())
    return AcceptRowsOutput(out, num_out, num_acc, num_drafts)
