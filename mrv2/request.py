"""``Request``: the engine's CPU-side view of one sequence being generated.

The scheduler reads it to plan steps; the engine appends sampled tokens to it
and checks stop conditions. The runner never sees it: the runner's truth is the
device state table (``state.py``).
"""

from __future__ import annotations

import enum

from mrv2.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class Request:
    """One sequence: prompt, generated tokens and how far the KV cache has got.

    Attributes:
        num_computed_tokens: tokens whose KV is in the cache, as planned by the
            scheduler (the device copy in the state table is the runner's truth).
        output_token_ids: sampled tokens, appended by the engine.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                 arrival: int, prompt: str | None = None, index: int = 0,
                 user_seeded: bool | None = None, parent_request_id: str | None = None,
                 arrival_time: float | None = None):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.arrival = arrival
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        # The i-th of the n completions of one prompt, and that prompt's (output) request id.
        self.index = index
        self.parent_request_id = request_id if parent_request_id is None else parent_request_id
        # The user gave a seed (``None``: read it from ``sampling_params`` now); the V1
        # baseline keeps a generator only for these.
        self.user_seeded = sampling_params.seed is not None if user_seeded is None else user_seeded
        # Tokens being sampled by steps in flight, not yet seen by the engine.
        self.num_output_placeholders = 0
        # Prefix caching: hashes of the full blocks so far (kv_cache.py fills them, each
        # once), and the tokens found cached at the first admission (-1: not admitted yet).
        self.block_hashes: list[int] = []
        self.num_cached_tokens = -1
        # Of those, the draft slots of speculating steps in flight: they may be rejected
        # (mrv2/spec_decode/scheduling.py); placeholders minus these is a lower bound.
        self.num_spec_placeholders = 0
        # Its own acceptance counts (``SpecDecodeStats``), once it has speculated.
        self.spec_stats = None
        # Fault containment (mrv2/fault.py, mrv2/engine_api.py): the allowed ids as a set
        # (checked on the host output), and the failed steps this request was part of.
        self.allowed_set: set[int] | None = None
        self.num_faults = 0
        # The engine's quick stop check, ``(limit, stop ids)``: see ``Engine._stop_limits``
        # (``None`` until its first token).
        self.stop_limits: tuple[int, set[int]] | None = None
        # Extras filled by the engine (detokenized text, logprobs, ...).
        self.output_text = ""
        self.logprobs: list | None = [] if sampling_params.logprobs is not None else None
        self.prompt_logprobs: list | None = None
        self.cumulative_logprob: float | None = (
            0.0 if sampling_params.logprobs is not None else None)
        # Wall-clock timestamps (mrv2.metrics): stamped by LLM, scheduler and engine.
        self.arrival_time = arrival_time
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.finished_time: float | None = None

    @property
    def num_tokens(self) -> int:
        """Prompt + generated tokens known on the CPU."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_with_placeholders(self) -> int:
        """Known tokens plus the ones steps in flight are sampling (async scheduling)."""
        return self.num_tokens + self.num_output_placeholders

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.value}, prompt={self.num_prompt_tokens}, "
                f"out={len(self.output_token_ids)}, computed={self.num_computed_tokens})")
