"""Scheduler + KV block pool property tests: random arrivals, finishes and tight pools.

No model runs here: sampled tokens are simulated, so thousands of steps are cheap.
Invariants: the token budget and request cap hold, blocks are never lost and a block's
ref count is its number of holders (prefix caching shares blocks; small vocabularies hit),
every scheduled request has room for its tokens, preempted requests come back with
their output as prefill, and every request finishes with exactly max_tokens tokens.
"""

import random

import pytest

from mrv2.config import SchedulerConfig
from mrv2.kv_cache import KVCacheManager, cdiv
from mrv2.request import Request, RequestStatus
from mrv2.sampling_params import SamplingParams
from mrv2.scheduler import Scheduler


def _deliver(sched: Scheduler, out, token) -> None:
    """What the engine does with a step's output: placeholders become real tokens."""
    for req_id in out.num_scheduled_tokens:
        r = sched.requests.get(req_id)
        if req_id not in out.sampling_req_ids or r is None:
            continue  # a partial prefill chunk, or a request that finished meanwhile
        r.num_output_placeholders -= 1
        r.output_token_ids.append(token())
        if len(r.output_token_ids) >= r.sampling_params.max_tokens:
            sched.finish_request(req_id, "length")


def _simulate(seed: int, steps: int = 400, async_scheduling: bool = False,
              enable_caching: bool = True):
    """Random arrivals into a tight pool; ``async_scheduling`` delivers each step's
    tokens only after the next step has been planned (as the async engine does)."""
    rng = random.Random(seed)
    cfg = SchedulerConfig(max_num_seqs=rng.choice([1, 2, 4, 8]),
                          max_num_batched_tokens=rng.choice([8, 16, 64]), max_model_len=96)
    bs = rng.choice([1, 4, 16])
    kv = KVCacheManager(num_blocks=cdiv(96, bs) + rng.randrange(0, 30), block_size=bs,
                        enable_caching=enable_caching)
    sched = Scheduler(cfg, kv)
    reqs, n_next, preempted_seen = {}, 0, 0
    pending = None
    token = lambda: rng.randrange(100)

    def step():
        nonlocal pending
        out = sched.schedule()
        if async_scheduling:
            if pending is not None:
                _deliver(sched, pending, token)
            pending = out
        else:
            _deliver(sched, out, token)
        return out

    for _ in range(steps):
        for _ in range(rng.choice([0, 0, 1, 2])):
            prompt = [rng.randrange(100) for _ in range(rng.randrange(1, 40))]
            req = Request(str(n_next), prompt, SamplingParams(max_tokens=rng.randrange(1, 30)), n_next)
            reqs[req.request_id] = req
            sched.add_request(req)
            n_next += 1
        out = step()
        # Budget and cap.
        assert out.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
        assert len(out.num_scheduled_tokens) <= cfg.max_num_seqs
        assert len(sched.running) <= cfg.max_num_seqs
        # Blocks: held = ref count, never both free and held, none lost, enough for
        # every scheduled request; without caching, never shared.
        owned = [b for blocks in kv.req_blocks.values() for b in blocks]
        if not enable_caching:
            assert len(owned) == len(set(owned))
        assert all(kv.ref_cnt[b] == owned.count(b) for b in set(owned))
        assert not set(owned) & set(kv.free_queue)
        assert len(set(owned)) + kv.num_free_blocks == kv.num_blocks
        for req_id in out.num_scheduled_tokens:
            r = reqs[req_id]
            if r.is_finished:  # async: its last token arrived after this step was planned
                continue
            assert len(kv.get_blocks(req_id)) >= cdiv(r.num_computed_tokens, bs)
            assert r.num_computed_tokens <= r.num_tokens_with_placeholders
            assert r.num_output_placeholders <= (2 if async_scheduling else 1)
        for new in out.new_reqs:
            assert new.prefill_token_ids == new.request.all_token_ids[:len(new.prefill_token_ids)]
            assert new.block_ids == kv.get_blocks(new.req_id) or new.request.is_finished
        preempted_seen += len(out.preempted_req_ids)
        for req_id in out.preempted_req_ids:
            assert req_id in out.finished_req_ids  # the runner frees the row
        if not sched.has_unfinished() and n_next > 30:
            break
    for _ in range(10_000):  # drain
        if not sched.has_unfinished():
            break
        out = step()
        assert not out.is_empty or out.finished_req_ids or pending is not None
    if pending is not None:
        _deliver(sched, pending, token)
    assert not sched.has_unfinished()
    for r in reqs.values():
        assert r.is_finished and len(r.output_token_ids) == r.sampling_params.max_tokens
        assert r.num_output_placeholders == 0
    assert kv.num_free_blocks == kv.num_blocks
    return preempted_seen


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("seed", range(12))
def test_random_workloads_keep_invariants(seed, async_scheduling):
    _simulate(seed, async_scheduling=async_scheduling)


@pytest.mark.parametrize("seed", range(4))
def test_random_workloads_keep_invariants_without_caching(seed):
    _simulate(seed, async_scheduling=bool(seed % 2), enable_caching=False)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_some_workload_preempts(async_scheduling):
    assert sum(_simulate(s, async_scheduling=async_scheduling) for s in range(12)) > 0


@pytest.mark.parametrize("enable_caching", [False, True])
def test_preempted_request_reenters_with_its_output(enable_caching):
    kv = KVCacheManager(num_blocks=4, block_size=2, enable_caching=enable_caching)
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=8, max_model_len=8), kv)
    a = Request("a", [1, 2, 3, 4], SamplingParams(max_tokens=4), 0)
    b = Request("b", [4, 5, 6, 7], SamplingParams(max_tokens=4), 1)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    assert list(out.num_scheduled_tokens.items()) == [("a", 4), ("b", 4)]
    assert out.sampling_req_ids == {"a", "b"} and a.num_output_placeholders == 1
    for r, t in ((a, 7), (b, 8)):  # the engine turns each placeholder into the real token
        r.num_output_placeholders -= 1
        r.output_token_ids.append(t)
    out = sched.schedule()  # a's 5th token needs a 3rd block; the pool is empty: b goes
    assert out.preempted_req_ids == {"b"} and out.num_scheduled_tokens == {"a": 1}
    assert b.status == RequestStatus.PREEMPTED and b.all_token_ids == [4, 5, 6, 7, 8]
    assert b.num_computed_tokens == 0 and b.num_preemptions == 1
    sched.finish_request("a", "length")
    out = sched.schedule()
    assert [n.req_id for n in out.new_reqs] == ["b"] and out.finished_req_ids == {"a"}
    if enable_caching:  # b's first block [4, 5] survived in the cache; [6, 7] was evicted for a
        assert out.new_reqs[0].num_computed_tokens == 2 and out.num_scheduled_tokens == {"b": 3}
    else:
        assert out.new_reqs[0].num_computed_tokens == 0 and out.num_scheduled_tokens == {"b": 5}
