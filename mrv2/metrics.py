"""``RequestMetrics``: when a request arrived, was first scheduled, got its tokens, finished.

The timestamps are wall-clock seconds (``time.time()``, as vLLM's ``arrival_time``),
stamped on the CPU-side ``Request`` by the parts that see each event: ``LLM`` at
submission, the scheduler at first admission and at finish, the engine when a
sampled token reaches the request. Nothing here touches the device.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass
class RequestMetrics:
    """Timing of one prompt (vLLM's ``RequestMetrics`` names).

    Attributes:
        arrival_time: when ``generate`` submitted the request.
        last_token_time: when the newest generated token reached the request.
        first_scheduled_time: when the scheduler first admitted it (``None``: never).
        first_token_time: when its first generated token arrived (``None``: none yet).
        time_in_queue: ``first_scheduled_time - arrival_time`` in seconds.
        finished_time: when it finished (``None``: still running).
        num_generation_tokens: generated tokens (all ``n`` completions together).
        spec_decode: with speculative decoding, the prompt's acceptance counts
            (``mrv2.spec_decode.metrics.SpecDecodeStats.as_dict``); else ``None``.
    """

    arrival_time: float
    last_token_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    time_in_queue: float | None = None
    finished_time: float | None = None
    num_generation_tokens: int = 0
    spec_decode: dict | None = None

    @property
    def first_token_latency(self) -> float | None:
        """Seconds from arrival to the first token (time to first token)."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


def now() -> float:
    """The clock every timestamp uses."""
    return time.time()


def group_metrics(requests, spec_stats=None) -> RequestMetrics:
    """The metrics of one prompt from its ``n`` requests (earliest start, latest end).

    Args:
        requests: ``Request`` objects carrying ``arrival_time``, ``first_scheduled_time``,
            ``first_token_time``, ``last_token_time``, ``finished_time`` (and ``spec_stats``).
        spec_stats: the runner's ``SpecDecodeStats`` (``None``: no speculative decoding);
            only its K is used, to sum the requests' own counts.

    Returns:
        One ``RequestMetrics``.
    """
    def first(name):
        vals = [getattr(r, name) for r in requests if getattr(r, name) is not None]
        return min(vals) if vals else None

    def last(name):
        vals = [getattr(r, name) for r in requests if getattr(r, name) is not None]
        return max(vals) if vals else None

    arrival = first("arrival_time")
    scheduled = first("first_scheduled_time")
    finished = (last("finished_time")
                if all(r.finished_time is not None for r in requests) else None)
    return RequestMetrics(
        arrival_time=arrival, last_token_time=last("last_token_time") or arrival,
        first_scheduled_time=scheduled, first_token_time=first("first_token_time"),
        time_in_queue=None if scheduled is None else scheduled - arrival,
        finished_time=finished,
        num_generation_tokens=sum(len(r.output_token_ids) for r in requests),
        spec_decode=None if spec_stats is None else _spec_counts(requests, spec_stats))


def _spec_counts(requests, spec_stats) -> dict:
    from mrv2.spec_decode.metrics import SpecDecodeStats

    total = SpecDecodeStats(spec_stats.num_speculative_tokens)
    for r in requests:
        if r.spec_stats is not None:
            total.merge(r.spec_stats)
    return total.as_dict()
