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
min-p; its sort-based torch specification sits beside it). The per-row settings,
rules and histories live in ``SamplingStates`` (``mrv2/sample/states.py``), which the
sampler owns. See notebooks/05_gumbel_sampling.ipynb.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mrv2.kernels.gumbel import gumbel_sample
from mrv2.kernels.logprobs import compute_topk_logprobs
from mrv2.kernels.top_k_top_p import apply_top_k_top_p_min_p
from mrv2.sample.states import SamplingStates


@dataclass
class SamplingMetadata:
    """What the batch needs beyond the state table, decided on the CPU.

    Attributes:
        all_greedy: every row has temperature 0 (skip the noise entirely).
        needs_top_k_top_p: some row uses top-k, top-p or min-p.
    """

    all_greedy: bool = False
    needs_top_k_top_p: bool = False


@dataclass
class SamplerOutput:
    """What one sampler call produced, still on the device.

    Attributes:
        sampled: ``[N]`` int64 token ids, one per logits row.
        logprobs: ``(ids [N, k+1], logprobs [N, k+1], ranks [N])`` of the raw logits
            (the sampled id first), or ``None`` when no row asked for logprobs.
    """

    sampled: torch.Tensor
    logprobs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None


class Sampler:
    """Turns logits into token ids without a CPU sync; owns the rows' ``SamplingStates``.

    Args:
        states: the per-row sampling states (``None``: only ``sample_tokens`` is usable).
    """

    def __init__(self, states: SamplingStates | None = None):
        self.states = states

    def __call__(self, logits: torch.Tensor, idx_mapping: torch.Tensor,
                 positions: torch.Tensor, rows: list[int], state) -> SamplerOutput:
        """Logit rules -> sample -> logprobs, for any number of logits rows per request.

        Args:
            logits: ``[N, V]`` the model's logits (its dtype), one row per sampled position.
            idx_mapping: ``[N]`` int32 logits row -> state row (today one logits row per
                request; speculative decoding will map 1 + K rows to one state row).
            positions: ``[N]`` absolute position of the token each logits row samples.
            rows: the ``N`` state rows as CPU ints (the flags are read from them, no sync).
            state: the ``RequestStateTable``.

        Returns:
            A ``SamplerOutput``.
        """
        ruled, raw, max_logprobs, meta = self.apply_rules(logits, idx_mapping, rows, state)
        sampled = self.sample_tokens(ruled, idx_mapping, state, positions, meta)  # [N]
        logprobs = None
        if max_logprobs >= 0:
            logprobs = compute_topk_logprobs(raw, max_logprobs, sampled)  # ([N,k+1],[N,k+1],[N])
        return SamplerOutput(sampled, logprobs)

    def apply_rules(self, logits: torch.Tensor, idx_mapping: torch.Tensor, rows: list[int],
                    state, force_float: bool = False):
        """The logit rules of ``__call__`` without the sampling (probabilistic verification).

        Args:
            logits, idx_mapping, rows, state: as for ``__call__``.
            force_float: return float32 logits even when no rule needs them.

        Returns:
            ``(ruled [N, V], raw [N, V] or None, max_logprobs, SamplingMetadata)``: the
            logits after bias / allowed ids / bad words / penalties / processors (not yet
            top-k / top-p / min-p), the raw logits when some row wants logprobs (else
            ``None``; ``max_logprobs`` is then -1) and the batch's sampling flags.
        """
        states = self.states
        max_logprobs = states.max_logprobs(rows)
        biased, banned, penalized = states.needs_rules(rows)
        meta = SamplingMetadata(all_greedy=states.all_greedy(rows),
                                needs_top_k_top_p=states.needs_top_k_top_p(rows))
        # The rules below edit fp32 logits in place; the plain path (argmax, or Gumbel-max
        # reading bf16 and converting in registers) skips a [N, V] fp32 copy.
        if (force_float or max_logprobs >= 0 or biased or banned or penalized
                or states.logits_processors or meta.needs_top_k_top_p):
            logits = logits.float()                                            # [N, V]
        # NOTE: logprobs are of the raw logits; top-k/top-p masks the logits in place.
        raw = logits.clone() if max_logprobs >= 0 else None
        logits = states.apply_rules(logits, idx_mapping, state, biased, banned, penalized)
        return logits, raw, max_logprobs, meta

    def sample_tokens(self, logits: torch.Tensor, idx_mapping: torch.Tensor, state,
                      positions: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Sample one token per logits row (the rules already applied).

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
            apply_top_k_top_p_min_p(logits, idx_mapping, state.temperature, state.top_k,
                                    state.top_p, state.min_p)
        return gumbel_sample(logits, idx_mapping, state.temperature, state.seed,
                             positions.to(torch.int64))  # [B]
