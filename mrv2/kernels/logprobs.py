"""Top-k logprobs without the ``[batch, vocab]`` log-probability matrix.

V1 computed ``log_softmax`` over the whole vocabulary (a second ``[B, V]`` fp32
tensor: 600 MB for 1,024 rows of Qwen3's 151,936 tokens) and then picked a few
entries. A log-probability needs only one number per row besides its own logit:

    logprob[n, v] = logits[n, v] - logsumexp(logits[n, :])

So a blocked pass over the vocabulary with an online max / sum-exp gives the
``[N]`` log-sum-exp, a second blocked pass counts the logits strictly larger
than the sampled token's (its rank), ``torch.topk`` on the logits picks the
top-k ids (the order of logits is the order of log-probabilities), and the
log-probabilities are gathered for those ``k + 1`` ids only.

These are *raw* logprobs: of the logits the model produced, before temperature,
penalties, top-k/top-p masks (vLLM's default ``logprobs_mode="raw_logprobs"``).

Rank convention: ``rank = 1 + #{v : logits[v] > logits[token]}`` (rank 1 = most
likely; tied tokens share the best rank of their group).
NOTE: vLLM's kernel counts ``>=``, so there tied tokens share the *worst* rank of
their group; the two agree whenever the token's logit is unique.

Each kernel sits beside its torch reference (``*_ref``, full ``log_softmax``).
See notebooks/06_logprobs.ipynb.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mrv2.platform import HAS_CUDA

# NOTE: programs run one after another under the interpreter: big tiles there (and several
# rows per program, see _rows_per_program).
_BLOCK_V = 8192 if HAS_CUDA else 4096


def _num_splits(num_rows: int, vocab_size: int, block_v: int) -> int:
    """Vocab slices per row: enough programs to fill a GPU when there are few rows."""
    if not HAS_CUDA:
        return 1
    # ~4 programs per SM of an H100/H200 (132 SMs); never more slices than blocks.
    return max(1, min(triton.cdiv(512, max(num_rows, 1)), triton.cdiv(vocab_size, block_v)))


def _rows_per_program(num_rows: int, block_v: int) -> int:
    """1 on the GPU; under the interpreter, rows enough for ~64K-element tiles."""
    if HAS_CUDA:
        return 1
    return max(1, min(65536 // block_v, triton.next_power_of_2(num_rows)))


def _prep(logits: torch.Tensor) -> torch.Tensor:
    if logits.dim() != 2:
        raise ValueError(f"logits must be [N, V], got shape {tuple(logits.shape)}")
    # NOTE: the kernels take a row stride only; the vocab axis must be dense.
    return logits if logits.stride(1) == 1 else logits.contiguous()


# --- row_logsumexp ----------------------------------------------------------------

@triton.jit(do_not_specialize=["num_rows"])
def _lse_partial_kernel(
    logits_ptr,                     # inputs
    max_ptr, sumexp_ptr,            # outputs: [N, S] partial max and sum of exp(x - max)
    num_rows, vocab_size, num_splits,  # sizes
    logits_stride,                  # strides
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
):
    # Program (row block, split) walks the vocab blocks split, split + S, ... of BLOCK_N rows
    # (BLOCK_N is 1 on the GPU; larger under the interpreter, where each op costs a lot).
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(1)
    row_mask = rows < num_rows
    row_ptr = logits_ptr + rows.to(tl.int64) * logits_stride  # [BLOCK_N]
    # NOTE: a finite start keeps exp(m - m_new) defined when a row is all -inf.
    m = tl.full([BLOCK_N], -3.0e38, tl.float32)
    s = tl.zeros([BLOCK_N], tl.float32)
    for start in range(split * BLOCK_V, vocab_size, num_splits * BLOCK_V):
        # Load (bf16/fp16 -> fp32 at once), then the online max / sum-exp update.
        offs = start + tl.arange(0, BLOCK_V)
        mask = row_mask[:, None] & (offs < vocab_size)[None, :]
        x = tl.load(row_ptr[:, None] + offs[None, :], mask=mask,
                    other=float("-inf")).to(tl.float32)  # [BLOCK_N, BLOCK_V]
        m_new = tl.maximum(m, tl.max(x, axis=1))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new[:, None]), axis=1)
        m = m_new
    # Store this slice's partial result.
    out = rows * num_splits + split
    tl.store(max_ptr + out, m, mask=row_mask)
    tl.store(sumexp_ptr + out, s, mask=row_mask)


def row_logsumexp(logits: torch.Tensor, *, block_v: int | None = None,
                  num_splits: int | None = None) -> torch.Tensor:
    """Per-row ``logsumexp`` of the logits, in fp32, in one blocked pass.

    Args:
        logits: ``[N, V]`` fp32/bf16/fp16 logits.
        block_v: vocab entries per block (a power of two; default per platform).
        num_splits: vocab slices per row, combined in torch afterwards (default: 1
            under the interpreter; enough to fill the GPU when N is small).

    Returns:
        ``[N]`` float32 ``log(sum_v exp(logits[n, v]))``.
    """
    logits = _prep(logits)
    num_rows, vocab_size = logits.shape
    if num_rows == 0:
        return torch.empty(0, dtype=torch.float32, device=logits.device)
    block_v = block_v or min(_BLOCK_V, triton.next_power_of_2(vocab_size))
    splits = num_splits or _num_splits(num_rows, vocab_size, block_v)
    part_max = torch.empty(num_rows, splits, dtype=torch.float32, device=logits.device)
    part_sum = torch.empty_like(part_max)
    block_n = _rows_per_program(num_rows, block_v)
    _lse_partial_kernel[(triton.cdiv(num_rows, block_n), splits)](
        logits, part_max, part_sum, num_rows, vocab_size, splits, logits.stride(0),
        BLOCK_N=block_n, BLOCK_V=block_v)
    if splits == 1:
        return part_max[:, 0] + torch.log(part_sum[:, 0])
    m = part_max.max(dim=1).values  # [N]
    return m + torch.log((part_sum * torch.exp(part_max - m[:, None])).sum(dim=1))


def row_logsumexp_ref(logits: torch.Tensor) -> torch.Tensor:
    """Reference: ``torch.logsumexp`` in fp32. ``[N, V]`` -> ``[N]``."""
    return torch.logsumexp(logits.float(), dim=-1)


# --- gather_logprobs --------------------------------------------------------------

def gather_logprobs(logits: torch.Tensor, lse: torch.Tensor,
                    token_ids: torch.Tensor) -> torch.Tensor:
    """Log-probabilities of chosen tokens only: ``logits[n, id] - lse[n]``.

    Args:
        logits: ``[N, V]`` logits; lse: ``[N]`` fp32 from :func:`row_logsumexp`.
        token_ids: ``[N, K]`` int64 ids per row.

    Returns:
        ``[N, K]`` float32 log-probabilities.
    """
    # A [N, K] gather: K is a handful, so a kernel launch would buy nothing.
    return logits.gather(1, token_ids.long()).float() - lse[:, None]


def gather_logprobs_ref(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Reference: the full ``log_softmax``, then gather. ``[N, K]`` float32."""
    return torch.log_softmax(logits.float(), dim=-1).gather(1, token_ids.long())


# --- token_ranks ------------------------------------------------------------------

@triton.jit(do_not_specialize=["num_rows"])
def _rank_partial_kernel(
    logits_ptr, token_ids_ptr,      # inputs
    count_ptr,                      # output: [N, S] logits strictly above the token's
    num_rows, vocab_size, num_splits,  # sizes
    logits_stride,                  # strides
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(1)
    row_mask = rows < num_rows
    row_ptr = logits_ptr + rows.to(tl.int64) * logits_stride  # [BLOCK_N]
    # Load each row's token logit once.
    token = tl.load(token_ids_ptr + rows, mask=row_mask, other=0)
    x_tok = tl.load(row_ptr + token, mask=row_mask, other=0.0).to(tl.float32)  # [BLOCK_N]
    # Count, block by block, the entries strictly larger (masked lanes are -inf: never larger).
    n = tl.zeros([BLOCK_N], tl.int32)
    for start in range(split * BLOCK_V, vocab_size, num_splits * BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        mask = row_mask[:, None] & (offs < vocab_size)[None, :]
        x = tl.load(row_ptr[:, None] + offs[None, :], mask=mask,
                    other=float("-inf")).to(tl.float32)  # [BLOCK_N, BLOCK_V]
        n += tl.sum((x > x_tok[:, None]).to(tl.int32), axis=1)
    tl.store(count_ptr + rows * num_splits + split, n, mask=row_mask)


def token_ranks(logits: torch.Tensor, token_ids: torch.Tensor, *, block_v: int | None = None,
                num_splits: int | None = None) -> torch.Tensor:
    """Rank of one token per row: ``1 + #{v : logits[n, v] > logits[n, token]}``.

    Args:
        logits: ``[N, V]`` logits.
        token_ids: ``[N]`` int64 (or int32) token per row, each in ``[0, V)``.
        block_v, num_splits: as for :func:`row_logsumexp`.

    Returns:
        ``[N]`` int64 ranks (1 = most likely; ties share the best rank).
    """
    logits = _prep(logits)
    num_rows, vocab_size = logits.shape
    if num_rows == 0:
        return torch.empty(0, dtype=torch.int64, device=logits.device)
    block_v = block_v or min(_BLOCK_V, triton.next_power_of_2(vocab_size))
    splits = num_splits or _num_splits(num_rows, vocab_size, block_v)
    counts = torch.empty(num_rows, splits, dtype=torch.int64, device=logits.device)
    block_n = _rows_per_program(num_rows, block_v)
    _rank_partial_kernel[(triton.cdiv(num_rows, block_n), splits)](
        logits, token_ids.contiguous(), counts, num_rows, vocab_size, splits, logits.stride(0),
        BLOCK_N=block_n, BLOCK_V=block_v)
    return counts.sum(dim=1) + 1


def token_ranks_ref(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Reference: compare the whole row against the token's logit. ``[N]`` int64.

    NOTE: on the logits, not the log-probabilities: ``x - lse`` can round two distinct
    logits to one value, and the rank would change.
    """
    x = logits.float()  # [N, V]
    return (x > x.gather(1, token_ids.long()[:, None])).sum(dim=1) + 1


# --- compute_topk_logprobs --------------------------------------------------------

def _check_k(num_logprobs: int, vocab_size: int) -> None:
    if not 0 <= num_logprobs <= vocab_size:
        raise ValueError(f"num_logprobs must be in [0, {vocab_size}] (the caller maps -1 to "
                         f"the vocabulary size), got {num_logprobs}")


def compute_topk_logprobs(logits: torch.Tensor, num_logprobs: int, sampled: torch.Tensor, *,
                          block_v: int | None = None, num_splits: int | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The sampled token's and the top-k tokens' raw log-probabilities, and its rank.

    No ``[N, V]`` log-probability tensor is built: top-k runs on the logits, then one
    blocked pass gives the log-sum-exp and another the rank.

    Args:
        logits: ``[N, V]`` raw logits (before temperature / penalties).
        num_logprobs: k, in ``[0, V]``; 0 returns the sampled token only.
        sampled: ``[N]`` int64 sampled (or target) token per row.
        block_v, num_splits: as for :func:`row_logsumexp`.

    Returns:
        ``ids`` ``[N, k + 1]`` int64: column 0 the sampled token, columns 1.. the
        top-k ids, most likely first; ``logprobs`` ``[N, k + 1]`` float32 of those ids;
        ``ranks`` ``[N]`` int64, the sampled token's rank.
    """
    logits = _prep(logits)
    _check_k(num_logprobs, logits.shape[1])
    ids = sampled.long()[:, None]  # [N, 1]
    if num_logprobs > 0:
        ids = torch.cat([ids, torch.topk(logits, num_logprobs, dim=-1).indices], dim=1)
    lse = row_logsumexp(logits, block_v=block_v, num_splits=num_splits)  # [N]
    logprobs = gather_logprobs(logits, lse, ids)  # [N, k + 1]
    ranks = token_ranks(logits, sampled, block_v=block_v, num_splits=num_splits)  # [N]
    return ids, logprobs, ranks


def compute_topk_logprobs_ref(logits: torch.Tensor, num_logprobs: int, sampled: torch.Tensor
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference: full ``log_softmax``; top-k ids (on the logits, see ``token_ranks_ref``)."""
    _check_k(num_logprobs, logits.shape[1])
    logp = torch.log_softmax(logits.float(), dim=-1)  # [N, V]
    top = torch.topk(logits.float(), num_logprobs, dim=-1)
    ids = torch.cat([sampled.long()[:, None], top.indices], dim=1)  # [N, k + 1]
    return ids, logp.gather(1, ids), token_ranks_ref(logits, sampled)
