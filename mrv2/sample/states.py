"""Per-row sampling states: every sampling setting and history of a live request, in one place.

The runner hands a new request's row and ``SamplingParams`` to ``SamplingStates`` and
never looks inside: this object turns them into the state table's sampling columns
(temperature, top-k/top-p/min-p, seed, penalty strengths), the logit rules (bias,
allowed ids, min_tokens), the penalty histories, the logits processors' settings and
the CPU-side flags that pick the sampler's code path without reading the device
(greedy, top-k/p, logprobs k, penalized, biased). Each step it applies the rules to the
logits, and after sampling it appends the samples in the one order that works
(``append_sampled``: penalty counts first, then ``post_update``).

Adding a knob: a ``SamplingParams`` field plus a ``LogitsProcessor`` registered with
``register_sampling_rule`` (this folder only); see tests/test_sampling_rules.py.
See notebooks/05_gumbel_sampling.ipynb and 06_logprobs.ipynb.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import numpy as np
import torch

from mrv2.kernels.input_prep import post_update
from mrv2.sample.bad_words import BadWordsState
from mrv2.sample.logit_bias import LogitBiasState
from mrv2.sample.logits_processors import LogitsProcessor, apply_logits_processors
from mrv2.sample.penalties import PenaltyState, uses_penalties

#: Factories ``factory(max_num_reqs, device) -> LogitsProcessor`` that every new
#: ``SamplingStates`` builds after the user's logits processors (``register_sampling_rule``).
SAMPLING_RULES: list[Callable[[int, torch.device], LogitsProcessor]] = []


@contextlib.contextmanager
def register_sampling_rule(factory: Callable[[int, torch.device], LogitsProcessor]
                           ) -> Iterator[None]:
    """Make every runner built inside the ``with`` block apply one more logits rule.

    Args:
        factory: called as ``factory(max_num_reqs, device)``; returns a ``LogitsProcessor``
            that reads its knob from each request's ``SamplingParams`` in ``add_request``.
    """
    SAMPLING_RULES.append(factory)
    try:
        yield
    finally:
        SAMPLING_RULES.remove(factory)


def table_params(sp) -> dict[str, float | int]:
    """The state table's sampling columns of one request (``RequestStateTable.add_request``).

    Args:
        sp: its ``SamplingParams`` (``seed`` already set: unseeded requests get one).

    Returns:
        A dict with some of the keys of ``mrv2.state.SAMPLING_DEFAULTS``.
    """
    return {"temperature": sp.temperature, "top_k": sp.top_k if sp.top_k > 0 else -1,
            "top_p": sp.top_p, "min_p": sp.min_p, "seed": sp.seed,
            "repetition_penalty": sp.repetition_penalty,
            "presence_penalty": sp.presence_penalty, "frequency_penalty": sp.frequency_penalty}


class SamplingStates:
    """The sampling side of every state row: device rules and histories plus CPU flags.

    Args:
        max_num_reqs: rows (the state table's ``max_num_reqs``).
        vocab_size: V.
        device: where the device arrays live.
        logits_processors: ``LogitsProcessor`` instances, or factories called as
            ``factory(max_num_reqs, device)``, applied to every step's logits in order
            (then the registered ``SAMPLING_RULES``).

    Attributes:
        logit_bias: the ``LogitBiasState`` (bias / allowed ids / min_tokens).
        bad_words: the ``BadWordsState`` (``SamplingParams.bad_words``).
        penalties: the ``PenaltyState``, or ``None`` until a request uses penalties.
        logits_processors: the processors and registered rules, in order.
    """

    def __init__(self, max_num_reqs: int, vocab_size: int, device: torch.device | str,
                 logits_processors=()):
        self.max_num_reqs, self.vocab_size = max_num_reqs, vocab_size
        self.device = torch.device(device)
        self.logit_bias = LogitBiasState(max_num_reqs, vocab_size, self.device)
        self.bad_words = BadWordsState(max_num_reqs, self.device)
        # NOTE: [rows, vocab] counts are large: made at the first request with penalties.
        self.penalties: PenaltyState | None = None
        self.logits_processors: list[LogitsProcessor] = [
            p if isinstance(p, LogitsProcessor) else p(max_num_reqs, self.device)
            for p in (*logits_processors, *SAMPLING_RULES)]
        # CPU-side flags per row: enough to pick the sampler's code path without a sync.
        self.row_greedy = np.ones(max_num_reqs, dtype=bool)
        self.row_top_kp = np.zeros(max_num_reqs, dtype=bool)
        self.row_logprobs = np.full(max_num_reqs, -1, dtype=np.int64)  # k, or -1: none
        self.row_penalized = np.zeros(max_num_reqs, dtype=bool)

    # -- admission ------------------------------------------------------------------

    def table_params(self, sp) -> dict[str, float | int]:
        """The state table's sampling columns of a new request (``table_params``)."""
        return table_params(sp)

    def validate(self, sp, num_eos_ids: int = 0) -> None:
        """Raise ``ValueError`` naming the field when ``sp`` exceeds a per-row capacity.

        Args:
            sp: the request's ``SamplingParams``.
            num_eos_ids: EOS ids the engine adds to its stop ids.
        """
        rules = self.logit_bias
        if len(sp.logit_bias or ()) > rules.max_logit_bias:
            raise ValueError(f"SamplingParams.logit_bias has {len(sp.logit_bias)} entries; "
                             f"at most {rules.max_logit_bias}")
        if len(sp.stop_token_ids) + num_eos_ids > rules.max_stop_ids:
            raise ValueError(f"SamplingParams.stop_token_ids: at most "
                             f"{rules.max_stop_ids - num_eos_ids} ids")
        if sp.logprobs is not None and sp.logprobs > self.vocab_size:
            raise ValueError(f"SamplingParams.logprobs={sp.logprobs} exceeds the vocabulary "
                             f"size {self.vocab_size}")

    def add_request(self, row: int, sp, prefill_token_ids: list[int], prompt_len: int) -> None:
        """Stage the sampling state of a request that just took ``row`` (CPU only).

        Args:
            row: its state-table row.
            sp: its ``SamplingParams``.
            prefill_token_ids: the prompt, then (a preempted request) its earlier output.
            prompt_len: how many of ``prefill_token_ids`` are the prompt.
        """
        prompt = prefill_token_ids[:prompt_len]
        self.logit_bias.add_request(row, sp)
        self.bad_words.add_request(row, sp)
        for proc in self.logits_processors:
            proc.add_request(row, prompt, sp)
        self.row_penalized[row] = uses_penalties(sp)
        if self.row_penalized[row]:
            if self.penalties is None:
                self.penalties = PenaltyState(self.max_num_reqs, self.vocab_size, self.device)
            self.penalties.add_request(row, prompt, prefill_token_ids[prompt_len:])
        self.row_greedy[row] = sp.greedy
        self.row_top_kp[row] = sp.top_k > 0 or sp.top_p < 1.0 or sp.min_p > 0.0
        k = sp.logprobs
        self.row_logprobs[row] = -1 if k is None else (self.vocab_size if k == -1 else k)

    def remove_request(self, row: int) -> None:
        """Forget ``row`` (finished or preempted), and any staged write for it."""
        self.logit_bias.remove_request(row)
        self.bad_words.remove_request(row)
        if self.penalties is not None:
            self.penalties.remove_request(row)
        for proc in self.logits_processors:
            proc.remove_request(row)

    def apply_staged_writes(self) -> None:
        """Write every staged row to the device (one launch per part, none when idle)."""
        self.logit_bias.apply_staged_writes()
        self.bad_words.apply_staged_writes()
        if self.penalties is not None:
            self.penalties.apply_staged_writes()
        for proc in self.logits_processors:
            proc.apply_staged_writes()

    # -- one step ---------------------------------------------------------------------

    def max_logprobs(self, rows) -> int:
        """The largest logprobs k of ``rows`` (CPU ints), or -1 when none asks."""
        return int(self.row_logprobs[rows].max())

    def all_greedy(self, rows) -> bool:
        return bool(self.row_greedy[rows].all())

    def needs_top_k_top_p(self, rows) -> bool:
        return bool(self.row_top_kp[rows].any())

    def needs_rules(self, rows) -> tuple[bool, bool, bool]:
        """``(biased, banned, penalized)``: whether some of ``rows`` has a logit rule, bad
        words, a penalty (CPU flags only)."""
        return (self.logit_bias.any_active(rows), self.bad_words.any_active(rows),
                bool(self.row_penalized[rows].any()))

    def apply_rules(self, logits: torch.Tensor, idx_mapping: torch.Tensor, state,
                    biased: bool, banned: bool, penalized: bool) -> torch.Tensor:
        """Logit rules, in place and in order: bias / allowed ids / min_tokens, bad words,
        penalties, processors.

        Args:
            logits: ``[N, V]`` float32, one row per logits row.
            idx_mapping: ``[N]`` logits row -> state row.
            state: the ``RequestStateTable``.
            biased, banned, penalized: from ``needs_rules`` (skip a launch nobody needs).

        Returns:
            ``[N, V]`` logits (``logits`` itself unless a processor made a new tensor).
        """
        if biased:
            self.logit_bias.apply(logits, idx_mapping, state)
        if banned:
            self.bad_words.apply(logits, idx_mapping, state)
        if penalized:
            self.penalties.apply(logits, idx_mapping, state)
        return apply_logits_processors(self.logits_processors, logits, idx_mapping, state)

    def append_sampled(self, idx_mapping: torch.Tensor, num_scheduled_tokens: torch.Tensor,
                       sampled: torch.Tensor, num_reqs: int, state) -> None:
        """Append each request's sample to its row, histories first (no sync).

        The order is the structure: penalty counts read the table *before* ``post_update``
        moves ``total_len`` (see ``update_output_counts``).

        Args:
            idx_mapping, num_scheduled_tokens: int32 ``[B_pad]`` batch slot -> row, tokens.
            sampled: ``[B_pad]`` one sample per request.
            num_reqs: real requests (a CPU int).
            state: the ``RequestStateTable``, updated in place.
        """
        if self.penalties is not None:
            self.penalties.update(idx_mapping, num_scheduled_tokens, sampled, num_reqs, state)
        post_update(idx_mapping, num_scheduled_tokens, sampled, num_reqs, state)
