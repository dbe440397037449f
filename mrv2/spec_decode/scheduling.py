"""The scheduler's side of speculative decoding: how many drafts, and bounds that stay safe.

A speculating decode is scheduled ``1 + K_b`` tokens: the last sampled token and K_b draft
slots. The scheduler does not learn how many drafts were accepted until the step's output
arrives (one step late with async scheduling), so while a step is in flight its
``num_computed_tokens`` is an **upper bound**: KV blocks are allocated for all ``1 + K_b``
tokens and ``1 + K_b`` output placeholders are counted. When the output arrives with
``a + 1`` tokens, ``correct_bounds`` takes the ``K_b - a`` rejected ones back (vLLM does
the same). Blocks beyond what the request needs are simply kept: it grows into them.

Anything that must not overshoot uses the **lower bound** instead: each in-flight step
yields at least one token (``num_output_lower_bound``).
"""

from __future__ import annotations

from mrv2.request import Request, RequestStatus
from mrv2.sample.penalties import uses_penalties


def num_output_lower_bound(req: Request) -> int:
    """Output tokens ``req`` surely has once its steps in flight land (each gives >= 1)."""
    return len(req.output_token_ids) + req.num_output_placeholders - req.num_spec_placeholders


def num_spec_tokens_for(req: Request, num_new: int, budget: int, num_speculative_tokens: int,
                        max_model_len: int) -> int:
    """K_b for a running request this step (0: a plain decode or a prefill chunk).

    Args:
        req: a running request (not one admitted in this step: its row has no drafts yet).
        num_new: the tokens it would take without speculation (1 for a decode).
        budget: the step's token budget left, ``num_new`` included.
        num_speculative_tokens: K of the config.
        max_model_len: the longest sequence.

    Returns:
        K_b in ``[0, K]``: positions stay below ``max_model_len`` (by the upper bound),
        the budget holds ``1 + K_b``, and no draft goes beyond ``max_tokens``.
    """
    if num_new != 1:
        return 0
    sp = req.sampling_params
    produced = num_output_lower_bound(req)
    # NOTE: penalties and min_tokens read the history *inside* the speculated run, which
    # the logit rules do not see per draft position: such a request decodes plainly
    # (min_tokens only until it is surely met). The output is the same either way.
    if uses_penalties(sp) or produced < sp.min_tokens:
        return 0
    k = min(num_speculative_tokens, budget - 1,
            max_model_len - (req.num_computed_tokens + 1))
    if sp.max_tokens is not None:
        k = min(k, sp.max_tokens - produced - 1)
    return max(k, 0)


def add_spec_placeholders(req: Request, num_spec: int) -> None:
    """The step samples ``1 + num_spec`` possible tokens for ``req`` (called at schedule)."""
    req.num_output_placeholders += 1 + num_spec
    req.num_spec_placeholders += num_spec


def correct_bounds(req: Request, num_spec: int, num_sampled: int) -> None:
    """The step's output says ``num_sampled = a + 1``: give back the ``num_spec - a`` rejected.

    Leaves the ``a + 1`` real placeholders for the engine to turn into tokens.
    """
    if num_spec <= 0:
        return
    rejected = num_spec - (num_sampled - 1)
    req.num_output_placeholders -= rejected
    req.num_spec_placeholders -= num_spec
    # NOTE: a request preempted meanwhile restarted from 0: nothing to correct there.
    if req.status == RequestStatus.RUNNING:
        req.num_computed_tokens -= rejected


def observe_spec_output(req: Request, num_spec: int, num_sampled: int, num_drafts: int,
                        stats, corrected: bool = False) -> None:
    """The engine's hook for one request's run (before its tokens are applied).

    Args:
        req: the request; num_spec: its K_b in that step; num_sampled: a + 1.
        num_drafts: real drafts among the K_b (the proposer's matches).
        stats: the run's ``SpecDecodeStats`` (or ``None``); the request keeps its own.
        corrected: the bounds were already corrected when the step was launched
            (``sync_accepted_counts``).
    """
    if not corrected:
        correct_bounds(req, num_spec, num_sampled)
    if num_spec <= 0:
        return
    from mrv2.spec_decode.metrics import SpecDecodeStats

    if req.spec_stats is None:
        req.spec_stats = SpecDecodeStats(stats.num_speculative_tokens if stats else num_spec)
    for s in (stats, req.spec_stats):
        if s is not None:
            s.observe(num_spec, num_drafts, num_sampled - 1)


def correct_bounds_now(scheduler, sched, output) -> None:
    """``sync_accepted_counts``: the runner copied the counts to the CPU in the step (the
    V1-style sync this option measures); correct every request's bounds at once."""
    counts = getattr(output, "synced_num_sampled", None)
    if counts is None:
        return
    for req_id, num_sampled in zip(output.req_ids, counts):
        req = scheduler.requests.get(req_id)
        if req is not None and req_id in sched.sampling_req_ids:
            correct_bounds(req, sched.num_spec_tokens.get(req_id, 0), num_sampled)
