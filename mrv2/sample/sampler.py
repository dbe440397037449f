"""Sampler: greedy and seeded Gumbel-max sampling, keyed per row through ``idx_mapping``.

Every request carries a seed in the state table (unseeded requests get a random
one at admission), so one path serves all: the noise added to token ``v`` of the
token at absolute position ``p`` of a request with seed ``s`` is a pure function
``g(s, p, v)``. A request therefore samples the same tokens alone or in any batch,
at any batch slot. Temperature 0 rows take the argmax. The per-request knobs are
read from the state table rows (``state.temperature[idx_mapping]``), never
expanded per logit on the CPU.

This is the torch version that the runner core needs; the Triton sampling
kernels (no softmax materialised, top-k logprobs) replace it in
``mrv2/sample/`` as chapter 05 builds them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MASK32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (xorshift-multiply), on int64 holding uint32."""
    # NOTE: the products overflow int64 and wrap; only the low 32 bits are kept, which are exact.
    x = ((x ^ (x >> 16)) * 0x7FEB352D) & _MASK32
    x = ((x ^ (x >> 15)) * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def gumbel_noise_ref(seed: torch.Tensor, pos: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Stateless Gumbel(0, 1) noise keyed by (seed, position, vocab id).

    Args:
        seed: ``[B]`` int64 per-row seeds.
        pos: ``[B]`` absolute position of the token each row samples.
        vocab_size: V.

    Returns:
        ``[B, V]`` float32 noise; ``u`` has 53 random bits, so the tail is unbiased.
    """
    v = torch.arange(vocab_size, device=seed.device, dtype=torch.int64)  # [V]
    key = _mix32((seed & _MASK32) ^ _mix32(((seed >> 32) & _MASK32) ^ 0x9E3779B9))  # [B]
    key = _mix32(key ^ _mix32(pos.to(torch.int64) & _MASK32))  # [B]
    h = _mix32(key[:, None] ^ _mix32(v ^ 0x85EBCA6B)[None, :])  # [B, V]
    hi = _mix32(h ^ 0x68E31DA4) >> 5  # 27 bits
    lo = _mix32(h ^ 0x1B56C4E9) >> 6  # 26 bits
    u = ((hi * 67108864 + lo).to(torch.float64) + 0.5) / 9007199254740992.0  # (0, 1)
    return (-torch.log(-torch.log(u))).to(torch.float32)


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
    drop |= mass_before >= top_p[:, None]
    drop |= probs < min_p[:, None] * probs[:, :1]
    drop[:, 0] = False
    masked = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, masked)


class Sampler:
    """Turns ``[num_reqs, V]`` logits into ``[num_reqs]`` token ids without a CPU sync."""

    def __call__(self, logits: torch.Tensor, idx_mapping: torch.Tensor, state,
                 positions: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Sample one token per row.

        Args:
            logits: ``[B, V]`` float32 logits of the rows that sample.
            idx_mapping: ``[B]`` batch slot -> state-table row.
            state: the ``RequestStateTable`` (per-row temperature, top-k/p, min-p, seed).
            positions: ``[B]`` absolute position of the token each row samples.
            meta: batch-level flags decided on the CPU.

        Returns:
            ``[B]`` int64 sampled token ids (still on the device).
        """
        greedy_ids = logits.argmax(dim=-1)  # [B]
        if meta.all_greedy:
            return greedy_ids
        temp = state.temperature[idx_mapping]  # [B]
        is_greedy = temp < 1e-5
        scaled = logits / torch.where(is_greedy, 1.0, temp)[:, None]  # [B, V]
        if meta.needs_top_k_top_p:
            scaled = apply_top_k_top_p_min_p(scaled, state.top_k[idx_mapping],
                                             state.top_p[idx_mapping], state.min_p[idx_mapping])
        noise = gumbel_noise_ref(state.seed[idx_mapping], positions, logits.shape[-1])  # [B, V]
        sampled = (scaled + noise).argmax(dim=-1)  # [B]
        return torch.where(is_greedy, greedy_ids, sampled)
