"""Sampler: greedy and seeded Gumbel-max sampling, keyed per row through ``idx_mapping``.

Every request carries a seed in the state table (unseeded requests get a random
one at admission), so one path serves all: the noise added to token ``v`` of the
token at absolute position ``p`` of a request with seed ``s`` is a pure function
``g(s, p, v)``. A request therefore samples the same tokens alone or in any batch,
at any batch slot. Temperature 0 rows take the argmax. The per-request knobs are
read from the state table rows (``state.temperature[idx_mapping]``), never
expanded per logit on the CPU.

The work is done by Triton kernels (``mrv2/kernels/gumbel.py``: Gumbel-max, no
softmax materialised; ``mrv2/kernels/top_k_top_p.py``: sort-free top-k / top-p /
min-p). ``apply_top_k_top_p_min_p`` below is the plain sort-based torch version,
kept as the executable specification the kernel is tested against. See
notebooks/05_gumbel_sampling.ipynb.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplingMetadata:
    """What the batch needs beyond the state table, decided on the CPU.

    Attributes:
        all_greedy: every row has temperature 0 (skip the noise entirely).
        needs_top_k_top_p: some row uses top-k, top-p or min-p.
    """

    all_greedy: bool = False
    needs_top_k_top_p: bool = False


def apply_top_k_top_p_min_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                            min_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) the tokens top-k / top-p / min-p remove, per row.

    Args:
        logits: ``[B, V]`` float32, already divided by the temperature.
        top_k: ``[B]`` int (<= 0: off); top_p: ``[B]`` float (1: off); min_p: ``[B]`` (0: off).
    """
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [B, V]
    probs = sorted_logits.softmax(dim=-1)  # [B, V]
    rank = torch.arange(vocab, device=logits.device)[None, :]  # [1, V]
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)[:, None]  # [B, 1]
    drop = rank >= k
    # top-p: keep a token while the mass strictly before it is < top_p (the top token always stays).
    mass_before = probs.cumsum(dim=-1) - probs  # [B, V]
    # NOTE: top_p == 1 must keep everything, even where the fp32 cumsum reaches 1 early.
    drop |= (mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0)
    drop |= probs < min_p[:, None] * probs[:, :1]
    drop[:, 0] = False
    masked = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, masked)


class Sampler:
    """Turns ``[num_reqs, V]`` logits into ``[num_reqs]`` token ids without a CPU sync."""

    def __init__(self):
        # NOTE: imported here: kernels/top_k_top_p.py imports this module's reference.
        from mrv2.kernels.gumbel import gumbel_sample
        from mrv2.kernels.top_k_top_p import apply_top_k_top_p_min_p as top_k_top_p_kernel

        self._gumbel_sample = gumbel_sample
        self._top_k_top_p = top_k_top_p_kernel

    def __call__(self, logits: torch.Tensor, idx_mapping: torch.Tensor, state,
                 positions: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Sample one token per row.

        Args:
            logits: ``[B, V]`` logits of the rows that sample: float32 when a row uses
                top-k / top-p / min-p (masked in place), else float32 or the model's
                dtype (the kernels convert to fp32 in registers: the same ids).
            idx_mapping: ``[B]`` batch slot -> state-table row.
            state: the ``RequestStateTable`` (per-row temperature, top-k/p, min-p, seed).
            positions: ``[B]`` absolute position of the token each row samples.
            meta: batch-level flags decided on the CPU.

        Returns:
            ``[B]`` int64 sampled token ids (still on the device).
        """
        if meta.all_greedy:
            return logits.argmax(dim=-1)  # [B]
        if meta.needs_top_k_top_p:
            self._top_k_top_p(logits, idx_mapping, state.temperature, state.top_k,
                              state.top_p, state.min_p)
        return self._gumbel_sample(logits, idx_mapping, state.temperature, state.seed,
                                   positions.to(torch.int64))  # [B]
