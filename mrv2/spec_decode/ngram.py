"""The n-gram (prompt lookup) proposer, on the device: drafts from the request's own tokens.

For batch slot ``b`` with state row ``r = idx_mapping[b]`` the known tokens are
``x = state.token_ids[r, :L]``, ``L = state.total_len[r]`` (post_update has already
appended the last sampled token). For ``n`` from ``prompt_lookup_max`` down to
``prompt_lookup_min``, look for an earlier occurrence of the last ``n`` tokens
``x[L-n:L]`` and propose the up to K tokens that followed it. The first ``n`` with
any occurrence wins (the longest match).

Which occurrence: the **earliest** one (``x[e-n:e] == x[L-n:L]`` with the smallest end
``e``, ``n <= e <= L - 1``), as vLLM's ``NgramProposer`` does (the first match of a scan
from the start). Occurrences may overlap the suffix. The earliest match has the most
tokens after it, so a request caught in a loop of period P < K still gets K drafts (the
most recent occurrence would give only P).

The draft count is ``min(K, L - e)``, and also at most ``max_model_len - L - 1`` so the
drafts and the bonus token fit in the row. Missing drafts are -1; no match: all -1,
count 0 (the request then decodes normally: verification accepts none of its drafts).

One program per batch slot scans its row once: for every candidate end ``e`` it counts
the backward match length ``m[e]`` (up to MAX_N), then keeps, per n, the smallest ``e``
with ``m[e] >= n``. No CPU sync; the sizes are ``do_not_specialize`` so one compiled
kernel serves every batch. See notebooks/09_speculative_decoding.ipynb.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: Candidate ends scanned per loop iteration (fixed: each distinct constexpr is a compile).
BLOCK_E = 1024
_BIG: tl.constexpr = tl.constexpr(2**30)


@triton.jit(do_not_specialize=["num_reqs", "num_spec", "min_n", "max_model_len"])
def _ngram_propose_kernel(
    idx_mapping_ptr, token_ids_ptr, total_len_ptr,              # inputs
    draft_ptr, num_draft_ptr,                                   # outputs
    num_reqs, num_spec, min_n, max_model_len,                   # sizes
    token_ids_stride, draft_stride,                             # strides
    MAX_N: tl.constexpr, N_PAD: tl.constexpr, BLOCK: tl.constexpr, BLOCK_K: tl.constexpr,
):
    b = tl.program_id(0)
    # Stage 1: the slot's row and its known length L.
    row = tl.load(idx_mapping_ptr + b).to(tl.int64)
    length = tl.load(total_len_ptr + row)
    row_ptr = token_ids_ptr + row * token_ids_stride
    ns = tl.arange(0, N_PAD)                                                  # [NP] n values
    best = tl.full([N_PAD], _BIG, tl.int32)                                   # earliest end per n
    # Stage 2: scan candidate ends e in [1, L - 1]; m[e] = backward match length vs the suffix.
    for start in range(1, length, BLOCK):
        e = start + tl.arange(0, BLOCK)                                       # [BE]
        valid = e < length
        m = tl.zeros([BLOCK], dtype=tl.int32)
        alive = valid
        for t in tl.static_range(MAX_N):
            # NOTE: e <= L - 1 and e - 1 - t >= 0 imply L - 1 - t >= 1: the suffix load
            # needs no mask of its own (the interpreter refuses block & scalar masks).
            ok = alive & (e - 1 - t >= 0)
            a = tl.load(row_ptr + (e - 1 - t), mask=ok, other=-1)
            s = tl.load(row_ptr + tl.maximum(length - 1 - t, 0))
            alive = ok & (a == s)
            m += alive.to(tl.int32)
        # Per n: the smallest e with m[e] >= n.
        hit = m[:, None] >= ns[None, :]                                       # [BE, NP]
        cand = tl.min(tl.where(hit, e[:, None], _BIG), axis=0)                # [NP]
        best = tl.minimum(best, cand)
    # Stage 3: the longest n in [min_n, MAX_N] with a match, and its earliest end.
    usable = (ns >= min_n) & (ns <= MAX_N) & (best < _BIG)
    n_star = tl.max(tl.where(usable, ns, -1), axis=0)
    e_star = tl.min(tl.where(ns == n_star, best, _BIG), axis=0)
    room = tl.maximum(tl.minimum(max_model_len - length - 1, num_spec), 0)
    count = tl.where(n_star >= 0, tl.minimum(length - e_star, room), 0)
    # Stage 4: the tokens after the match, -1 past the count.
    k = tl.arange(0, BLOCK_K)
    take = k < count
    ids = tl.load(row_ptr + e_star + k, mask=take, other=-1)
    tl.store(draft_ptr + b.to(tl.int64) * draft_stride + k, tl.where(take, ids, -1),
             mask=k < num_spec)
    tl.store(num_draft_ptr + b, count)


def ngram_propose(idx_mapping: torch.Tensor, token_ids: torch.Tensor, total_len: torch.Tensor,
                  num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int,
                  *, draft_token_ids: torch.Tensor | None = None,
                  num_draft_tokens: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Propose up to K draft tokens per batch slot by prompt lookup (one launch, no sync).

    Args:
        idx_mapping: int32 ``[B]`` batch slot -> state row.
        token_ids: int32 ``[R, max_model_len]`` (the state table's).
        total_len: int32 ``[R]`` known tokens per row.
        num_speculative_tokens: K >= 1.
        prompt_lookup_min, prompt_lookup_max: the n-gram sizes, 1 <= min <= max.
        draft_token_ids: optional int32 ``[>= B, K]`` out (static buffer).
        num_draft_tokens: optional int32 ``[>= B]`` out.

    Returns:
        ``(draft_token_ids [B, K] int32, -1 = no draft; num_draft_tokens [B] int32)``.
    """
    if num_speculative_tokens < 1:
        raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
    if not 1 <= prompt_lookup_min <= prompt_lookup_max:
        raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                         f"{prompt_lookup_min} and {prompt_lookup_max}")
    if token_ids.dim() != 2 or token_ids.stride(1) != 1:
        raise ValueError("token_ids must be a [R, max_model_len] tensor with a contiguous "
                         f"last dim, got shape {tuple(token_ids.shape)}")
    num_reqs, k = idx_mapping.shape[0], num_speculative_tokens
    dev = token_ids.device
    if draft_token_ids is None:
        draft_token_ids = torch.empty(num_reqs, k, dtype=torch.int32, device=dev)
    if num_draft_tokens is None:
        num_draft_tokens = torch.empty(num_reqs, dtype=torch.int32, device=dev)
    if num_reqs == 0:
        return draft_token_ids[:0], num_draft_tokens[:0]
    _ngram_propose_kernel[(num_reqs,)](
        idx_mapping, token_ids, total_len, draft_token_ids, num_draft_tokens,
        num_reqs, k, prompt_lookup_min, token_ids.shape[1],
        token_ids.stride(0), draft_token_ids.stride(0),
        MAX_N=prompt_lookup_max, N_PAD=triton.next_power_of_2(prompt_lookup_max + 1),
        BLOCK=BLOCK_E, BLOCK_K=triton.next_power_of_2(k))
    return draft_token_ids[:num_reqs], num_draft_tokens[:num_reqs]


def ngram_propose_ref(idx_mapping: torch.Tensor, token_ids: torch.Tensor,
                      total_len: torch.Tensor, num_speculative_tokens: int,
                      prompt_lookup_min: int, prompt_lookup_max: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-Python specification of ``ngram_propose`` (same arguments and results)."""
    k = num_speculative_tokens
    max_model_len = token_ids.shape[1]
    drafts = torch.full((idx_mapping.shape[0], k), -1, dtype=torch.int32)
    counts = torch.zeros(idx_mapping.shape[0], dtype=torch.int32)
    for b, row in enumerate(idx_mapping.tolist()):
        length = int(total_len[row])
        x = token_ids[row, :length].tolist()
        for n in range(prompt_lookup_max, prompt_lookup_min - 1, -1):
            if n >= length:
                continue
            suffix = x[length - n:]
            # The earliest end e (n <= e <= L - 1) with x[e - n:e] == suffix.
            end = next((e for e in range(n, length) if x[e - n:e] == suffix), None)
            if end is None:
                continue
            count = max(min(k, length - end, max_model_len - length - 1), 0)
            drafts[b, :count] = torch.tensor(x[end:end + count], dtype=torch.int32)
            counts[b] = count
            break
    return drafts, counts
