"""Logprob rows to vLLM's output format: one ``dict[token_id -> Logprob]`` per position.

The kernels (``mrv2/kernels/logprobs.py``) return, per row, ``k + 1`` ids (column 0
the sampled or target token, then the top-k), their raw log-probabilities and the
rank of column 0. vLLM's ``SampleLogprobs`` / ``PromptLogprobs`` entries hold the
top-k tokens, ranks 1..k in order, plus the sampled token with its true rank when
it is not among them (so an entry has k or k + 1 keys). The sampled token comes
first in the dict's order, as in vLLM. See notebooks/06_logprobs.ipynb.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from mrv2.outputs import Logprob, SampleLogprobs

Detokenize = Callable[[int], str]


def make_logprob_dict(ids: Sequence[int], logprobs: Sequence[float], rank: int, num_logprobs: int,
                      detok: Detokenize | None = None) -> dict[int, Logprob]:
    """One position's entry.

    Args:
        ids: ``k_max + 1`` ids (sampled first, then the top ids, most likely first).
        logprobs: their log-probabilities; rank: the sampled token's rank.
        num_logprobs: k for this position (``<= k_max``): only the first k top ids count.
        detok: token id -> text, or ``None`` (``decoded_token`` stays ``None``).
    """
    def entry(tid: int, lp: float, r: int) -> Logprob:
        return Logprob(lp, r, detok(tid) if detok is not None else None)

    out = {int(ids[0]): entry(int(ids[0]), float(logprobs[0]), int(rank))}
    # NOTE: a sampled token inside the top-k is overwritten by its top-k entry (rank = its
    # place in the top-k), exactly as vLLM's dict builder does; keys never repeat.
    for r in range(1, num_logprobs + 1):
        out[int(ids[r])] = entry(int(ids[r]), float(logprobs[r]), r)
    return out


def sample_logprobs_to_output(ids: torch.Tensor, logprobs: torch.Tensor, ranks: torch.Tensor,
                              num_logprobs: int | Sequence[int],
                              detok: Detokenize | None = None) -> SampleLogprobs:
    """Convert one step's logprob rows to vLLM's ``SampleLogprobs`` entries (one per row).

    Copies the (small) tensors to the host: call it where the step's output is
    processed, never inside the step loop.

    Args:
        ids: ``[B, k_max + 1]`` int64 from ``compute_topk_logprobs``.
        logprobs: ``[B, k_max + 1]`` float32; ranks: ``[B]`` int64.
        num_logprobs: k for every row, or one k per row (each ``<= k_max``).
        detok: token id -> text, or ``None``.

    Returns:
        ``B`` dicts token id -> ``Logprob(logprob, rank, decoded_token)``.
    """
    num_rows, width = ids.shape
    ks = [num_logprobs] * num_rows if isinstance(num_logprobs, int) else list(num_logprobs)
    if len(ks) != num_rows or any(not 0 <= k < width for k in ks):
        raise ValueError(f"num_logprobs must be one k or {num_rows} of them, each in "
                         f"[0, {width - 1}], got {num_logprobs}")
    ids_l, lps_l, ranks_l = ids.tolist(), logprobs.tolist(), ranks.tolist()
    return [make_logprob_dict(ids_l[i], lps_l[i], ranks_l[i], ks[i], detok)
            for i in range(num_rows)]
