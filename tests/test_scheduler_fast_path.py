"""The scheduler's running loop (attributes in locals, inlined helpers) against the plain loop.

``PlainScheduler`` keeps the loop as it was written before the host-time cuts (issue 21,
item 6): ``num_tokens_with_placeholders``, ``_surely_done``, ``_account`` called per
request. Two schedulers, each with its own pool, are fed the same random stream (arrivals,
async placeholders, speculative runs with rejections, tight pools that preempt, max_tokens
and max_model_len finishes) and must plan every step identically.
"""

import random

import pytest

from mrv2.config import SchedulerConfig
from mrv2.kv_cache import KVCacheManager, cdiv
from mrv2.request import Request, RequestStatus
from mrv2.sampling_params import SamplingParams
from mrv2.scheduler import NewRequestData, Scheduler, SchedulerOutput
from mrv2.spec_decode.scheduling import (
    add_spec_placeholders,
    correct_bounds,
    num_output_lower_bound,
    num_spec_tokens_for,
)


class PlainScheduler(Scheduler):
    """The running loop written plainly (the reference)."""

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            known = req.num_tokens_with_placeholders
            num_new = min(known - req.num_computed_tokens, budget,
                          self.config.max_model_len - req.num_computed_tokens)
            if num_new <= 0 or (req.num_output_placeholders and self._surely_done(req)):
                i += 1
                continue
            num_spec = (num_spec_tokens_for(req, num_new, budget, self.num_speculative_tokens,
                                            self.config.max_model_len)
                        if self.num_speculative_tokens else 0)
            num_new += num_spec
            lookahead = self.num_lookahead_tokens
            while (new := self.kv.allocate(req.request_id, min(
                    req.num_computed_tokens + num_new + lookahead,
                    self.config.max_model_len))) is None:
                if lookahead or num_spec:
                    num_new, num_spec, lookahead = num_new - num_spec, 0, 0
                    continue
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is req:
                    break
            if new is None:
                break
            if new:
                out.new_block_ids[req.request_id] = new
            self.kv.cache_blocks(req, req.num_computed_tokens + num_new)
            out.num_scheduled_tokens[req.request_id] = num_new
            if num_spec:
                out.num_spec_tokens[req.request_id] = num_spec
            budget -= num_new
            i += 1
            self._account_plain(req, num_new, num_spec, out, known)
        # The waiting part (unchanged by the cuts), as the plain schedule() had it.
        while (self.waiting and budget > 0 and not out.preempted_req_ids
               and len(self.running) < self.config.max_num_seqs):
            req = self.waiting[0]
            if req.num_output_placeholders:
                break
            hit_blocks, num_hit = self.kv.get_computed_blocks(req)
            num_new = min(req.num_tokens - num_hit, budget)
            new = self.kv.allocate(req.request_id, num_hit + num_new, hit_blocks)
            if new is None:
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            req.num_computed_tokens = num_hit
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit
            self.kv.cache_blocks(req, num_hit + num_new)
            out.new_reqs.append(NewRequestData(
                req.request_id, req.all_token_ids, req.num_prompt_tokens, req,
                list(self.kv.get_blocks(req.request_id)), num_computed_tokens=num_hit))
            out.num_scheduled_tokens[req.request_id] = num_new
            budget -= num_new
            self._account_plain(req, num_new, 0, out, req.num_tokens_with_placeholders)
        out.finished_req_ids = self._freed_ids
        self._freed_ids = set()
        out.total_num_scheduled_tokens = self.config.max_num_batched_tokens - budget
        return out

    @staticmethod
    def _account_plain(req, num_new, num_spec, out, known):
        req.num_computed_tokens += num_new
        out.max_seq_len = max(out.max_seq_len, req.num_computed_tokens)
        if req.num_computed_tokens >= known:
            add_spec_placeholders(req, num_spec)
            out.sampling_req_ids.add(req.request_id)

    def _surely_done(self, req) -> bool:
        if not req.num_output_placeholders:
            return False
        max_tokens = req.sampling_params.max_tokens
        lower = num_output_lower_bound(req)
        return ((max_tokens is not None and lower >= max_tokens)
                or req.num_prompt_tokens + lower >= self.config.max_model_len)


def _plan(out: SchedulerOutput):
    return (list(out.num_scheduled_tokens.items()), sorted(out.new_block_ids.items()),
            [(n.req_id, n.prefill_token_ids, n.block_ids, n.num_computed_tokens)
             for n in out.new_reqs], sorted(out.finished_req_ids),
            sorted(out.preempted_req_ids), sorted(out.sampling_req_ids),
            sorted(out.num_spec_tokens.items()), out.total_num_scheduled_tokens,
            out.max_seq_len)


def _run(seed: int, steps: int = 150):
    rng = random.Random(seed)
    max_len = rng.choice([24, 48, 96])
    k = rng.choice([0, 0, 2, 3])
    lookahead = k if k and rng.random() < 0.5 else 0
    bs = rng.choice([1, 4, 16])
    cfg = {"max_num_seqs": rng.choice([2, 4, 8, 16]),
           "max_num_batched_tokens": rng.choice([8, 16, 64]), "max_model_len": max_len}
    num_blocks = cdiv(max_len + lookahead, bs) + rng.randrange(0, 40)
    caching = rng.random() < 0.7
    scheds = [cls(SchedulerConfig(**cfg), KVCacheManager(num_blocks, bs, enable_caching=caching),
                  num_speculative_tokens=k, num_lookahead_tokens=lookahead)
              for cls in (PlainScheduler, Scheduler)]
    pending = [None, None]
    n_next = 0
    for _ in range(steps):
        for _ in range(rng.choice([0, 0, 1, 2])):
            prompt = [rng.randrange(6) for _ in range(rng.randrange(1, max_len // 2))]
            mt = rng.choice([None, 1, 3, 8, 30])
            for s in scheds:
                s.add_request(Request(f"r{n_next}", prompt, SamplingParams(max_tokens=mt),
                                      arrival=n_next))
            n_next += 1
        # One step's tokens: the same random draws for both (accepted counts, tokens).
        draws = [rng.randrange(100) for _ in range(64)]
        plans = []
        for j, s in enumerate(scheds):
            out = s.schedule()
            plans.append(_plan(out))
            if pending[j] is not None:
                _deliver(s, pending[j], list(draws))
            pending[j] = out
        assert plans[0] == plans[1]
        a, b = scheds
        assert [(r.request_id, r.num_computed_tokens, r.num_output_placeholders,
                 r.num_spec_placeholders, r.status) for r in a.running] == [
            (r.request_id, r.num_computed_tokens, r.num_output_placeholders,
             r.num_spec_placeholders, r.status) for r in b.running]
    return n_next


def _deliver(sched: Scheduler, out: SchedulerOutput, draws: list[int]) -> None:
    """The engine's side, one step late: correct speculative bounds, append, finish."""
    for req_id in out.num_scheduled_tokens:
        r = sched.requests.get(req_id)
        if req_id not in out.sampling_req_ids or r is None:
            continue
        k_b = out.num_spec_tokens.get(req_id, 0)
        n = 1 + (draws.pop() % (k_b + 1) if k_b else 0)
        correct_bounds(r, k_b, n)
        for _ in range(n):
            r.num_output_placeholders -= 1
            r.output_token_ids.append(draws.pop() % 6)
            mt = r.sampling_params.max_tokens
            if (mt is not None and len(r.output_token_ids) >= mt) or (
                    r.num_tokens >= sched.config.max_model_len):
                r.num_output_placeholders = 0
                r.num_spec_placeholders = 0
                sched.finish_request(req_id, "length")
                break
        if r.status == RequestStatus.RUNNING and r.num_output_placeholders < 0:
            raise AssertionError("placeholders went negative")


@pytest.mark.parametrize("seed", range(40))
def test_running_loop_plans_like_the_plain_loop(seed):
    assert _run(seed) > 0
