"""V1's sampler: softmax, then an exponential race, with per-request torch generators.

Row by row of ``[num_reqs, V]`` fp32 logits: greedy rows take the argmax; random
rows are divided by their temperature, masked by min-p, then top-k / top-p (sorting
the whole vocabulary, as V1's plain-torch path does), turned into probabilities with
a softmax and sampled as ``argmax(probs / q)`` with ``q ~ Exp(1)``: the token ``v``
wins with probability ``probs[v]``. A request with a user seed owns a
``torch.Generator`` and its row of ``q`` is re-drawn from it, one small launch per
seeded request. Logprobs are the full ``log_softmax`` of the raw logits (a second
``[num_reqs, V]`` tensor), then ``topk``. Compare mrv2/sample/sampler.py (Gumbel-max,
stateless per-position noise, no softmax). See notebooks/05_gumbel_sampling.ipynb.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

_SAMPLING_EPS = 1e-5


@dataclass
class SamplingMetadata:
    """The batch's sampling knobs, rows in persistent-batch order.

    Attributes:
        temperature: ``[B]`` float32 (0 on greedy rows), ``None`` when all rows are greedy.
        all_greedy, all_random: every row is greedy / random.
        top_p, top_k, min_p: ``[B]`` knobs, ``None`` when no row uses them
            (top-k off is stored as the vocabulary size).
        generators: row -> the ``torch.Generator`` of a user-seeded request.
        max_num_logprobs: the largest k any row asked for, ``None``: no logprobs.
        min_tokens: row -> (min_tokens, stop ids banned until then).
        output_token_ids: per row, the request's output so far (for ``min_tokens``).
    """

    temperature: torch.Tensor | None
    all_greedy: bool
    all_random: bool
    top_p: torch.Tensor | None = None
    top_k: torch.Tensor | None = None
    min_p: torch.Tensor | None = None
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    max_num_logprobs: int | None = None
    min_tokens: dict[int, tuple[int, set[int]]] = field(default_factory=dict)
    output_token_ids: list = field(default_factory=list)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens whose probability is below ``min_p`` times the row's top one."""
    probs = logits.softmax(dim=-1)                             # [B, V]
    threshold = min_p[:, None] * probs.amax(dim=-1, keepdim=True)  # [B, 1]
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, k: torch.Tensor | None,
                      p: torch.Tensor | None) -> torch.Tensor:
    """Sort-based top-k / top-p mask (V1's torch fallback), rows ``[B, V]``.

    Args:
        logits: ``[B, V]`` float32, after temperature.
        k: ``[B]`` int, tokens kept per row (``V``: off); p: ``[B]`` float (1: off).
    """
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1)   # ascending: [B, V] each
    if k is not None:
        # The k-th largest logit sits at ascending index V - k; ties with it stay.
        kth = sorted_logits.gather(1, (vocab - k.long().clamp(1, vocab))[:, None])  # [B, 1]
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if p is not None:
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)     # [B, V], ends at 1
        drop = cum <= 1.0 - p[:, None]   # the least likely tokens holding mass <= 1 - p
        drop[:, -1] = False              # the top token always stays
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def random_sample(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """``argmax(probs / q)`` with ``q ~ Exp(1)``: a draw from each row's ``probs``.

    Args:
        probs: ``[B, V]`` probabilities (consumed: divided in place).
        generators: row -> generator; those rows draw their ``q`` from it.

    Returns:
        ``[B]`` int64 token ids.
    """
    q = torch.empty_like(probs)
    if len(generators) != probs.shape[0]:
        q.exponential_()
    # NOTE: one launch per seeded row: the cost V1 pays for reproducible seeds.
    for row, generator in generators.items():
        q[row].exponential_(generator=generator)
    return probs.div_(q).argmax(dim=-1)


class Sampler:
    """``[B, V]`` logits -> ``[B]`` sampled ids (+ logprobs), V1 style."""

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata
                 ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
        """Sample one token per row.

        Args:
            logits: ``[B, V]`` raw logits of the rows, in the model's dtype.
            meta: the batch's knobs.

        Returns:
            ``sampled`` ``[B]`` int64, and when some row asked for logprobs
            ``(ids [B, k+1], logprobs [B, k+1], ranks [B])`` (column 0: the sampled
            token; then the top-k), else ``None``.
        """
        logits = logits.float()
        # Raw logprobs first (V1's default): the full [B, V] log_softmax.
        raw_logprobs = None
        if meta.max_num_logprobs is not None:
            raw_logprobs = logits.log_softmax(dim=-1)            # [B, V]
        # NOTE: out of place from here on: the ranks below compare against the raw logits.
        masked = self._apply_min_tokens(logits, meta)
        sampled = self.sample(masked, meta)
        if raw_logprobs is None:
            return sampled, None
        return sampled, self.gather_logprobs(raw_logprobs, logits, meta.max_num_logprobs, sampled)

    @staticmethod
    def _apply_min_tokens(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Ban stop ids on rows that have fewer than ``min_tokens`` outputs (a CPU loop)."""
        rows, cols = [], []
        for row, (min_tokens, stop_ids) in meta.min_tokens.items():
            if len(meta.output_token_ids[row]) < min_tokens:
                rows += [row] * len(stop_ids)
                cols += stop_ids
        if not rows:
            return logits
        index = (torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device))
        return logits.index_put(index, torch.tensor(float("-inf"), device=logits.device))

    @staticmethod
    def sample(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Greedy and random rows; ``[B]`` int64."""
        greedy = None
        if not meta.all_random:
            greedy = logits.argmax(dim=-1)                       # [B]
            if meta.all_greedy:
                return greedy
        # NOTE: greedy rows hold temperature 0: divide them by 1; their draw is discarded.
        temp = torch.where(meta.temperature < _SAMPLING_EPS, 1.0, meta.temperature)
        logits = logits / temp[:, None]                          # [B, V]
        if meta.min_p is not None:
            logits = apply_min_p(logits, meta.min_p)
        if meta.top_k is not None or meta.top_p is not None:
            logits = apply_top_k_top_p(logits, meta.top_k, meta.top_p)
        probs = logits.softmax(dim=-1)                           # [B, V]
        sampled = random_sample(probs, meta.generators)
        if greedy is None:
            return sampled
        return torch.where(meta.temperature < _SAMPLING_EPS, greedy, sampled)

    @staticmethod
    def gather_logprobs(logprobs: torch.Tensor, logits: torch.Tensor, k: int,
                        sampled: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Top-k of the full logprobs plus the sampled token's logprob and rank.

        Rank = 1 + the number of logits strictly larger than the sampled token's
        (the convention of mrv2/kernels/logprobs.py), counted on the raw logits.
        """
        top_logprobs, top_ids = logprobs.topk(k, dim=-1)        # [B, k] each
        token = sampled[:, None]                                 # [B, 1]
        ids = torch.cat([token, top_ids], dim=1)                 # [B, k + 1]
        lps = torch.cat([logprobs.gather(1, token), top_logprobs], dim=1)  # [B, k + 1]
        ranks = (logits > logits.gather(1, token)).sum(dim=-1) + 1         # [B]
        return ids, lps, ranks
