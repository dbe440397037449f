"""Speculative decoding pieces on the CPU: draft-slot kernels vs their references, exact
acceptance of already-sampled targets vs plain loops, the logits-row expansion, the config,
and the scheduler's bounds."""

import random

import numpy as np
import pytest
import torch

from mrv2.request import Request, RequestStatus
from mrv2.sampling_params import SamplingParams
from mrv2.spec_decode.config import SpeculativeConfig
from mrv2.spec_decode.draft_slots import (
    spec_post_update,
    spec_post_update_ref,
    write_draft_slots,
    write_draft_slots_ref,
)
from mrv2.spec_decode.metrics import SpecDecodeStats
from mrv2.spec_decode.scheduling import (
    add_spec_placeholders,
    correct_bounds,
    num_output_lower_bound,
    num_spec_tokens_for,
)
from mrv2.spec_decode.verify import exact_accept
from mrv2.spec_decode.verify_step import expand_rows_np
from mrv2.state import RequestStateTable


def _table(rng, num_rows, max_len, k):
    st = RequestStateTable(num_rows, max_len, "cpu", num_speculative_tokens=k)
    st.token_ids.copy_(torch.randint(0, 50, st.token_ids.shape, dtype=torch.int32))
    st.total_len.copy_(torch.tensor([rng.randrange(1, max_len + 1) for _ in range(num_rows)],
                                    dtype=torch.int32))
    # A decode row has num_computed = total - 1; some rows are mid-prefill (num_computed lower).
    nc = [max(0, int(t) - 1 - (rng.random() < 0.3) * rng.randrange(0, 5)) for t in st.total_len]
    st.num_computed_tokens.copy_(torch.tensor(nc, dtype=torch.int32))
    return st


def _copies(st):
    return [t.clone() for t in (st.token_ids, st.num_computed_tokens, st.total_len,
                                st.last_sampled_token)]


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("num_reqs", [0, 1, 7])
def test_spec_post_update_equals_reference(k, num_reqs):
    rng = random.Random(k * 10 + num_reqs)
    st = _table(rng, 8, 24, k)
    st.total_len[0] = 24  # a full row: nothing fits
    st.num_computed_tokens[0] = 23
    rows = rng.sample(range(8), num_reqs)
    idx = torch.tensor(rows + [0], dtype=torch.int32)          # one padding slot
    ks = [rng.randrange(0, k + 1) for _ in rows] + [0]
    n = [1 + kk if rng.random() < 0.7 else rng.randrange(1, 6) for kk in ks]
    ks = [kk if nn == 1 + kk else 0 for kk, nn in zip(ks, n)]   # chunks do not speculate
    m = [rng.randrange(1, kk + 2) for kk in ks]
    out = torch.randint(0, 50, (len(idx), k + 1), dtype=torch.int32)
    args = (idx, torch.tensor(n, dtype=torch.int32), torch.tensor(ks, dtype=torch.int32),
            out, torch.tensor(m, dtype=torch.int32), num_reqs)
    ref = _copies(st)
    spec_post_update_ref(*args, *ref)
    spec_post_update(*args, st)
    for a, b in zip(_copies(st), ref):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("k", [1, 4])
def test_write_draft_slots_equals_reference(k):
    rng = random.Random(k)
    st = _table(rng, 6, 16, k)
    st.total_len[2] = 16  # full: only the -1 buffer is written
    st.total_len[3] = 15  # one slot left
    idx = torch.tensor([3, 2, 0, 5], dtype=torch.int32)
    drafts = torch.randint(-1, 50, (4, k), dtype=torch.int32)
    ref_tok, ref_d = st.token_ids.clone(), st.draft_token_ids.clone()
    write_draft_slots_ref(drafts, idx, 4, st.total_len, ref_tok, ref_d)
    write_draft_slots(drafts, idx, 4, st)
    torch.testing.assert_close(st.token_ids, ref_tok)
    torch.testing.assert_close(st.draft_token_ids, ref_d)
    assert (st.token_ids >= 0).all()  # "no draft" leaves a valid id in the token slots
    write_draft_slots(drafts[:0], idx, 0, st)  # empty batch: nothing


def test_exact_accept_equals_plain_loops():
    torch.manual_seed(0)
    k, b = 4, 64
    drafts = torch.randint(-1, 3, (b, k), dtype=torch.int32)
    target = torch.randint(0, 3, (b, k + 1), dtype=torch.int64)
    ks = torch.randint(0, k + 1, (b,), dtype=torch.int32)
    v = exact_accept(drafts, target, ks)
    out, num = v.output_token_ids, v.num_output_tokens
    for i in range(b):
        a = 0
        while a < int(ks[i]) and int(drafts[i, a]) == int(target[i, a]):
            a += 1
        assert int(num[i]) == a + 1
        assert out[i].tolist() == target[i, :a + 1].tolist() + [-1] * (k - a)
    assert {int(x) for x in num} >= {1, 2}


def test_expand_rows_np_matches_hand_layout():
    # a chunk of 5 (no drafts), a speculating decode 1 + 2, a plain decode
    idx = expand_rows_np([5, 3, 1], [0, 2, 0], k=3)
    assert idx["logits_indices"].tolist() == [4, 5, 6, 7, 8]
    assert idx["slot"].tolist() == [0, 1, 1, 1, 2]
    assert idx["back"].tolist() == [0, 2, 1, 0, 0]
    assert idx["gather"].tolist() == [[0, 0, 0, 0], [1, 2, 3, 3], [4, 4, 4, 4]]
    assert expand_rows_np([], [], k=2)["slot"].size == 0


@pytest.mark.parametrize("bad,match", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2.0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5,
      "prompt_lookup_max": 3}, "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1}, "lookahead"),
    ({"num_speculative_tokens": 2}, "method"),
    ({"method": "ngram", "num_speculative_tokens": 2, "verification": "greedy"},
     "verification"),
])
def test_config_rejects_bad_values(bad, match):
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig.from_dict(bad)
    with pytest.raises(TypeError, match="dict"):
        SpeculativeConfig.from_dict([("method", "ngram")])


def _running(n_prompt=4, n_out=3, **sp):
    req = Request("r", list(range(n_prompt)), SamplingParams(**sp), arrival=0)
    req.output_token_ids = [7] * n_out
    req.num_computed_tokens = n_prompt + n_out - 1
    req.status = RequestStatus.RUNNING
    return req


def test_spec_tokens_clamped_and_bounds_corrected():
    req = _running(max_tokens=20)
    assert num_spec_tokens_for(req, 1, 100, 5, 64) == 5
    assert num_spec_tokens_for(req, 3, 100, 5, 64) == 0           # a prefill chunk
    assert num_spec_tokens_for(req, 1, 3, 5, 64) == 2             # the budget holds 1 + 2
    assert num_spec_tokens_for(req, 1, 100, 5, 9) == 2            # positions < max_model_len
    assert num_spec_tokens_for(_running(max_tokens=5), 1, 100, 5, 64) == 1  # 2 tokens left
    assert num_spec_tokens_for(_running(min_tokens=4, max_tokens=9), 1, 100, 5, 64) == 0
    assert num_spec_tokens_for(_running(repetition_penalty=1.2), 1, 100, 5, 64) == 0
    # A step of 1 + 3 in flight: upper bound up by 4, lower bound by 1.
    req.num_computed_tokens += 4
    add_spec_placeholders(req, 3)
    assert req.num_tokens_with_placeholders == 7 + 4 and num_output_lower_bound(req) == 4
    correct_bounds(req, 3, 2)  # a = 1: two drafts rejected
    assert (req.num_output_placeholders, req.num_spec_placeholders) == (2, 0)
    assert req.num_computed_tokens == 6 + 2
    req.status = RequestStatus.PREEMPTED
    req.num_computed_tokens = 0
    add_spec_placeholders(req, 2)
    correct_bounds(req, 2, 1)
    assert req.num_computed_tokens == 0  # a preempted request restarts from 0


def test_stats_count_per_position():
    s = SpecDecodeStats(3)
    s.observe(3, 3, 2)
    s.observe(2, 1, 0)
    s.observe(0, 0, 0)  # a plain step: not counted
    assert s.accepted_per_position == [1, 1, 0]
    assert s.num_spec_steps == 2 and s.num_draft_slots == 5 and s.num_draft_tokens == 4
    assert s.mean_accepted_length == pytest.approx(2.0) and s.acceptance_rate == 0.5
    t = SpecDecodeStats(3)
    t.merge(s)
    assert t.as_dict() == s.as_dict()
    assert np.isclose(SpecDecodeStats(2).mean_accepted_length, 1.0)


# -- the engine applies runs token by token (a stub runner returns chosen runs) ----------

class _StubRunner:
    """Returns the given run for the one request each step (K_b = the scheduled drafts)."""

    def __init__(self, runs, k):
        self.runs = iter(runs)
        self.spec_decode_stats = SpecDecodeStats(k)
        self.scheduled = []

    def execute_model(self, sched):
        from mrv2.async_output import StepOutput

        req_ids = list(sched.num_scheduled_tokens)
        if not req_ids:  # a finished-only call (the engine frees rows): nothing to run
            out = StepOutput([], [], None, {}, [])
            return type("Out", (), {"get_output": lambda self: out, "synced_num_sampled": None,
                                    "req_ids": []})()
        self.scheduled.append((dict(sched.num_scheduled_tokens), dict(sched.num_spec_tokens)))
        run = next(self.runs)
        if callable(run):
            run = run(sched.num_spec_tokens.get(req_ids[0], 0)) if req_ids else []
        out = StepOutput(req_ids, [run] * len(req_ids), None, {}, [len(run) - 1] * len(req_ids))
        return type("Out", (), {"get_output": lambda self: out, "synced_num_sampled": None,
                                "req_ids": req_ids})()


def _engine(runs, k=3, async_scheduling=False, **sp):
    from mrv2.config import SchedulerConfig
    from mrv2.engine import Engine
    from mrv2.kv_cache import KVCacheManager
    from mrv2.scheduler import Scheduler

    kv = KVCacheManager(8, 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=16,
                                      max_model_len=32), kv, num_speculative_tokens=k)
    runner = _StubRunner(runs, k)
    eng = Engine(sched, runner, max_model_len=32, async_scheduling=async_scheduling)
    params = SamplingParams(temperature=0, **sp)
    params.all_stop_token_ids = set(params.stop_token_ids)
    req = Request("r", [1, 2, 3], params, arrival=0)
    eng.add_request(req)
    return eng, req, runner, kv


def test_engine_stops_inside_an_accepted_run():
    eng, req, runner, kv = _engine([[5], [6, 42, 7, 8]], max_tokens=10, stop_token_ids=[42])
    while eng.has_unfinished():
        eng.step()
    assert req.output_token_ids == [5, 6, 42] and req.finish_reason == "stop"
    assert runner.scheduled[1] == ({"r": 4}, {"r": 3})     # a decode of 1 + K
    assert kv.num_free_blocks == kv.num_blocks
    assert runner.spec_decode_stats.num_accepted_tokens == 3  # counted before the stop


def test_engine_corrects_the_bound_and_stops_at_max_tokens():
    eng, req, runner, _ = _engine([[5], [6, 7], [8, 9, 10, 11]], max_tokens=5,
                                   stop_token_ids=[])
    eng.step()
    eng.step()
    # 3 prompt + [5, 6, 7]: the rejected two drafts taken back from the upper bound.
    assert req.num_computed_tokens == 5 and req.num_output_placeholders == 0
    assert req.num_spec_placeholders == 0
    eng.step()
    assert runner.scheduled[2] == ({"r": 2}, {"r": 1})     # K clamped: 2 tokens still needed
    assert req.output_token_ids == [5, 6, 7, 8, 9] and req.finish_reason == "length"


def test_async_engine_keeps_bounds_safe_with_a_step_in_flight():
    """Async: each step is planned before the previous one's run is known."""
    import itertools

    counter = itertools.count(100)
    accept = itertools.cycle([3, 0, 1, 2])

    def run(k):  # a + 1 consecutive tokens, a <= K_b
        return [next(counter) for _ in range(min(next(accept), k) + 1)]

    eng, req, runner, kv = _engine([run] * 20, async_scheduling=True, max_tokens=9,
                                   stop_token_ids=[])
    while eng.has_unfinished():
        eng.step()
    assert req.output_token_ids == list(range(100, 109))
    assert any(k for _, k in runner.scheduled)
    # Planned on the upper bound: never a position past max_model_len, never past the pool.
    assert all(sum(n.values()) <= 4 for n, _ in runner.scheduled)
    assert kv.num_free_blocks == kv.num_blocks
