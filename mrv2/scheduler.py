"""Continuous batching: which requests run in the next step, and with how many tokens.

Each step has a token budget (``max_num_batched_tokens``) and a request cap
(``max_num_seqs``). Running requests go first (decodes take one token, unfinished
prefills take what the budget leaves: chunked prefill), then waiting requests are
admitted. When the KV pool runs dry, the most recently admitted request is
preempted: its blocks and state row are freed and it waits again, to be
recomputed later from its prompt plus what it already generated.

Prefix caching (``kv_cache.py``): a request is admitted with the longest cached
prefix of its full blocks, and its ``num_computed_tokens`` starts at that hit, so
only the rest counts against the token budget. After each request is scheduled, its
blocks that the step fills are registered as cached at once, so a request admitted
later in the same step (the ``n`` completions of one prompt) already shares them:
every layer writes the whole step's KV before its attention reads it. A preempted
request's blocks go back to the cache, to be hit again at its re-admission.

With async scheduling the engine plans step N+1 before it has seen step N's
sampled tokens. A request whose step will sample a token gets an *output
placeholder* for it (``Request.num_output_placeholders``), so the next plan can
already schedule its decode: the runner reads the real token on the device. The
engine turns each placeholder into a real token when the step's output arrives.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from mrv2.config import SchedulerConfig
from mrv2.kv_cache import KVCacheManager
from mrv2.metrics import now
from mrv2.request import Request, RequestStatus
from mrv2.spec_decode.scheduling import add_spec_placeholders, num_spec_tokens_for


@dataclass
class NewRequestData:
    """A request the runner has not seen (or must re-create after preemption).

    ``num_computed_tokens`` is where its device row starts: 0, or the length of its
    prefix-cache hit (those tokens' KV is already in the first ``block_ids``).
    """

    req_id: str
    prefill_token_ids: list[int]
    prompt_len: int
    request: Request
    block_ids: list[int]
    num_computed_tokens: int = 0


@dataclass
class SchedulerOutput:
    """The plan of one step.

    Attributes:
        new_reqs: requests to add to the runner's state table.
        new_block_ids: running request -> KV block ids appended this step.
        num_scheduled_tokens: request -> tokens computed this step, in batch order.
        finished_req_ids: requests whose state rows must be freed (finished or
            preempted since the last step).
        total_num_scheduled_tokens: sum of ``num_scheduled_tokens``.
        max_seq_len: the longest sequence (cached + new tokens) in the step.
        preempted_req_ids: the subset of ``finished_req_ids`` that was preempted.
        sampling_req_ids: requests whose step reaches the end of their known tokens
            and so samples a real token (the others are partial prefill chunks).
        num_spec_tokens: speculating request -> K_b, its draft slots this step (its
            ``num_scheduled_tokens`` is ``1 + K_b``); absent: no speculation.
    """

    new_reqs: list[NewRequestData] = field(default_factory=list)
    new_block_ids: dict[str, list[int]] = field(default_factory=dict)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    finished_req_ids: set[str] = field(default_factory=set)
    total_num_scheduled_tokens: int = 0
    max_seq_len: int = 0
    preempted_req_ids: set[str] = field(default_factory=set)
    sampling_req_ids: set[str] = field(default_factory=set)
    num_spec_tokens: dict[str, int] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


class Scheduler:
    """Plans steps over a waiting queue and a running list.

    Args:
        config: request cap, token budget and length limit.
        kv_manager: the KV block pool.
        num_speculative_tokens: K, draft slots for a running decode (0: no speculation).
        num_lookahead_tokens: KV slots allocated past a running request's step, where a
            draft model writes its chained steps (K for ``draft_model``, else 0).
    """

    def __init__(self, config: SchedulerConfig, kv_manager: KVCacheManager,
                 num_speculative_tokens: int = 0, num_lookahead_tokens: int = 0):
        self.config = config
        self.num_speculative_tokens = num_speculative_tokens
        self.num_lookahead_tokens = num_lookahead_tokens
        self.kv = kv_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._freed_ids: set[str] = set()
        self.num_preemptions = 0

    # -- requests in and out -------------------------------------------------

    def add_request(self, req: Request) -> None:
        """Queue a request (checked by the engine: it fits the model and the pool)."""
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def finish_request(self, req_id: str, reason: str, stop_reason=None) -> None:
        """End a request: free its blocks now and its state row at the next step."""
        req = self.requests.pop(req_id)
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
            self._freed_ids.add(req_id)
        else:
            self.waiting.remove(req)
        self.kv.cache_blocks(req, req.num_computed_tokens)  # tokens learned since scheduled
        self.kv.free(req_id)
        req.status = RequestStatus.FINISHED
        req.finish_reason, req.stop_reason = reason, stop_reason
        req.finished_time = now()

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def preempt(self, req: Request) -> None:
        """Send a running request back to waiting, to be recomputed (a failed step's reset)."""
        self._preempt(req, SchedulerOutput())

    def requeue_freed(self, req_ids) -> None:
        """Free these rows at the next step again (a step that failed before freeing them)."""
        self._freed_ids |= set(req_ids)

    def take_freed_ids(self) -> set[str]:
        """The rows to free, taken now (abort frees them at once, not at the next step)."""
        ids, self._freed_ids = self._freed_ids, set()
        return ids

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        self.kv.cache_blocks(req, req.num_computed_tokens)  # its blocks may be hit again
        self.kv.free(req.request_id)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        # NOTE: recompute, not swap: it re-enters with its output so far as prompt
        # (the token still in flight, if any, joins that output before re-admission).
        self.waiting.appendleft(req)
        self._freed_ids.add(req.request_id)
        out.preempted_req_ids.add(req.request_id)
        self.num_preemptions += 1

    # -- one step -------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Plan the next step (it never blocks on the GPU)."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens

        # 1. Running requests: decodes and unfinished (chunked) prefills.
        # NOTE: the loop below runs for every running request in every step (256-1024 at
        # a large batch), so its attributes are read once into locals and the calls a
        # plain decode does not need are skipped (host time per step, issue 21).
        running, kv = self.running, self.kv
        # KV fast paths (see KVCacheManager.num_slots / next_full): a decode calls
        # ``allocate`` only when it crosses a block boundary and ``cache_blocks`` only when
        # a block becomes full, once every block_size steps instead of every step.
        slots, next_full, caching = kv.num_slots, kv.next_full, kv.enable_caching
        max_model_len = self.config.max_model_len
        num_speculative, lookahead_tokens = self.num_speculative_tokens, self.num_lookahead_tokens
        scheduled, sampling = out.num_scheduled_tokens, out.sampling_req_ids
        max_seq_len = 0
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            computed = req.num_computed_tokens
            placeholders = req.num_output_placeholders
            num_prompt, num_output = len(req.prompt_token_ids), len(req.output_token_ids)
            # NOTE: min with the length: with speculation num_computed_tokens is an upper
            # bound while steps are in flight; at the limit, wait for their outputs.
            known = num_prompt + num_output + placeholders  # num_tokens_with_placeholders
            # min(known - computed, budget, max_model_len - computed), without the call:
            # NOTE: a builtin min/max costs ~0.1 us, an ``if`` ~0.02 (per request per step).
            num_new = known - computed
            if num_new > budget:  # noqa: PLR1730
                num_new = budget
            if num_new > max_model_len - computed:  # noqa: PLR1730
                num_new = max_model_len - computed
            if num_new <= 0:
                i += 1
                continue
            if placeholders:
                # ``_surely_done`` inlined (only a request with tokens in flight can be):
                # the output it surely has, ``num_output_lower_bound(req)``, already
                # reaches max_tokens or the model's length.
                lower = num_output + placeholders - req.num_spec_placeholders
                max_tokens = req.sampling_params.max_tokens
                if ((max_tokens is not None and lower >= max_tokens)
                        or num_prompt + lower >= max_model_len):
                    i += 1
                    continue
            # Speculative decoding: a decode takes 1 + K_b tokens (mrv2/spec_decode/).
            num_spec = (num_spec_tokens_for(req, num_new, budget, num_speculative,
                                            max_model_len)
                        if num_speculative else 0)
            num_new += num_spec
            lookahead = lookahead_tokens
            req_id = req.request_id
            need = computed + num_new + lookahead
            if need > max_model_len:  # noqa: PLR1730
                need = max_model_len
            if need > slots.get(req_id, 0):  # else allocate() would return [] at once
                while (new := kv.allocate(req_id, min(computed + num_new + lookahead,
                                                      max_model_len))) is None:
                    if lookahead or num_spec:  # short of blocks: no drafts before preempting
                        num_new, num_spec, lookahead = num_new - num_spec, 0, 0
                        continue
                    victim = running[-1]
                    self._preempt(victim, out)
                    if victim is req:
                        break
                if new is None:
                    break
                if new:
                    out.new_block_ids[req_id] = new
            computed += num_new
            if caching and computed >= next_full.get(req_id, 0):
                kv.cache_blocks(req, computed)
            scheduled[req_id] = num_new
            if num_spec:
                out.num_spec_tokens[req_id] = num_spec
            budget -= num_new
            i += 1
            # NOTE: counted here, not in a second pass over the batch: a request scheduled
            # above is never a preemption victim (victims come from the unscheduled tail).
            # (``_account``, inlined: ``req`` computes ``num_new`` more tokens.)
            req.num_computed_tokens = computed
            if computed > max_seq_len:  # noqa: PLR1730
                max_seq_len = computed
            if computed >= known:
                # This step samples a token for it (1 + K_b possible ones when speculating).
                if num_spec:
                    add_spec_placeholders(req, num_spec)
                else:
                    req.num_output_placeholders += 1
                sampling.add(req_id)
        out.max_seq_len = max_seq_len

        # 2. Waiting requests (skipped in a step that had to preempt).
        while (self.waiting and budget > 0 and not out.preempted_req_ids
               and len(self.running) < self.config.max_num_seqs):
            req = self.waiting[0]
            if req.num_output_placeholders:  # NOTE: a preempted request's token in flight
                break
            hit_blocks, num_hit = self.kv.get_computed_blocks(req)
            num_new = min(req.num_tokens - num_hit, budget)  # >= 1: a hit leaves one token
            new = self.kv.allocate(req.request_id, num_hit + num_new, hit_blocks)
            if new is None:
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now()
            self.running.append(req)
            req.num_computed_tokens = num_hit
            if req.num_cached_tokens < 0:  # NOTE: the first admission's hit is reported
                req.num_cached_tokens = num_hit
            self.kv.cache_blocks(req, num_hit + num_new)
            out.new_reqs.append(NewRequestData(
                req.request_id, req.all_token_ids, req.num_prompt_tokens, req,
                list(self.kv.get_blocks(req.request_id)), num_computed_tokens=num_hit))
            out.num_scheduled_tokens[req.request_id] = num_new
            budget -= num_new
            self._account(req, num_new, 0, out, req.num_tokens_with_placeholders)

        out.finished_req_ids = self._freed_ids
        self._freed_ids = set()
        out.total_num_scheduled_tokens = self.config.max_num_batched_tokens - budget
        return out

    @staticmethod
    def _account(req: Request, num_new: int, num_spec: int, out: SchedulerOutput,
                 known: int) -> None:
        """``req`` computes ``num_new`` more tokens in the planned step.

        ``known``: its ``num_tokens_with_placeholders`` (unchanged since it was planned).
        """
        req.num_computed_tokens += num_new
        out.max_seq_len = max(out.max_seq_len, req.num_computed_tokens)
        if req.num_computed_tokens >= known:
            # This step samples a token for it (1 + K_b possible ones when speculating).
            add_spec_placeholders(req, num_spec)
            out.sampling_req_ids.add(req.request_id)
