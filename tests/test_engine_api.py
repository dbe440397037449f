"""``LLMEngine``: add_request / step (streaming) / abort_request / has_unfinished_requests,
abort in every state with async scheduling on and off, and fault containment.

stories260K (vocab 512), a tight KV pool (6 blocks x 16 = 96 tokens) and a 16-token
budget, so requests wait, prefill in chunks, decode and get preempted.
"""

from __future__ import annotations

import itertools
import random

import pytest
from engine_checks import PROMPT, assert_nothing_held, stories_llm

from mrv2 import SamplingParams
from mrv2.request import RequestStatus

TIGHT = {"max_num_seqs": 3, "max_num_batched_tokens": 16, "num_gpu_blocks_override": 6,
             "block_size": 16, "max_model_len": 96}


def _workload(seed=0, num=5):
    rng = random.Random(seed)
    prompts = [{"prompt_token_ids": [1] + [rng.randrange(3, 512) for _ in range(rng.randrange(24, 40))]}
               for _ in range(num)]
    params = [SamplingParams(temperature=0, max_tokens=6 + 2 * i, ignore_eos=True) if i % 2 else
              SamplingParams(temperature=0.8, top_k=40, seed=11 + i, max_tokens=6 + 2 * i,
                             ignore_eos=True) for i in range(num)]
    return prompts, params


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def tight(request):
    llm = stories_llm(async_scheduling=request.param, **TIGHT)
    prompts, params = _workload()
    clean = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert llm.scheduler.num_preemptions > 0  # the pool is tight enough to preempt
    return llm, prompts, params, clean


def _state(req) -> str:
    if req.status == RequestStatus.PREEMPTED:
        return "preempted"
    if req.status == RequestStatus.WAITING:
        return "waiting"
    return "prefill" if req.num_computed_tokens < req.num_prompt_tokens else "decode"


def _drain(eng, outputs):
    while eng.has_unfinished_requests():
        for out in eng.step():
            outputs[out.request_id] = out


@pytest.mark.parametrize("target", ["waiting", "prefill", "decode", "preempted"])
def test_abort_in_any_state_frees_at_once_and_leaves_the_others_identical(tight, target):
    llm, prompts, params, clean = tight
    eng, sch = llm.llm_engine, llm.scheduler
    ids = [f"r{i}" for i in range(len(prompts))]
    for rid, p, sp in zip(ids, prompts, params):
        eng.add_request(rid, p, sp)
    outputs, aborted = {}, None
    for _ in range(500):
        live = [r for r in ids if r in sch.requests]
        hit = [r for r in live if _state(sch.requests[r]) == target]
        if hit and aborted is None:
            aborted = hit[0]
            eng.abort_request(aborted)
            # Freed at once: no block, no row, no scheduler entry.
            assert aborted not in sch.requests and not llm.kv_manager.get_blocks(aborted)
            assert aborted not in llm.runner.state
            eng.abort_request([aborted, "unknown"])  # a second abort / unknown id: ignored
        if not eng.has_unfinished_requests():
            break
        for out in eng.step():
            outputs[out.request_id] = out
    assert aborted is not None, f"no request ever reached state {target!r}"
    assert aborted not in outputs or not outputs[aborted].finished
    for rid, want in zip(ids, clean):
        if rid != aborted:
            assert outputs[rid].finished and outputs[rid].outputs[0].token_ids == want, rid
    assert_nothing_held(llm)


def test_abort_everything_mid_flight(tight):
    llm, prompts, params, _ = tight
    eng = llm.llm_engine
    for i, (p, sp) in enumerate(zip(prompts, params)):
        eng.add_request(f"x{i}", p, sp)
    for _ in range(4):
        eng.step()
    eng.abort_request([f"x{i}" for i in range(len(prompts))])
    assert not eng.has_unfinished_requests()
    assert_nothing_held(llm)


def test_streaming_outputs_grow_until_finished():
    llm = stories_llm()
    eng = llm.llm_engine
    assert llm.llm_engine is eng and not eng.has_unfinished_requests()
    eng.add_request("a", PROMPT, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    eng.add_request("b", PROMPT, SamplingParams(temperature=0.7, seed=3, n=2, max_tokens=3,
                                                ignore_eos=True))
    with pytest.raises(ValueError, match="already in use"):
        eng.add_request("a", PROMPT, SamplingParams())
    with pytest.raises(ValueError, match="max_tokens"):
        eng.add_request("c", PROMPT, SamplingParams(max_tokens=0))
    assert eng.get_num_unfinished_requests() == 2
    seen: dict[str, list] = {"a": [], "b": []}
    while eng.has_unfinished_requests():
        for out in eng.step():
            seen[out.request_id].append(out)
    for rid, n, length in (("a", 1, 5), ("b", 2, 3)):
        outs = seen[rid]
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        lens = [len(o.outputs[0].token_ids) for o in outs]
        assert lens == sorted(lens) and lens[-1] == length and len(outs[-1].outputs) == n
        for prev, nxt in itertools.pairwise(outs):  # cumulative: each output extends the last
            assert nxt.outputs[0].token_ids[:len(prev.outputs[0].token_ids)] == \
                prev.outputs[0].token_ids
    want = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids
    assert seen["a"][-1].outputs[0].token_ids == want
    assert_nothing_held(llm)


# -- fault containment ------------------------------------------------------------------------

def _inject(llm, monkeypatch, when):
    """Make ``runner.execute_model`` raise when ``when(sched, requests)`` is true."""
    real = llm.runner.execute_model

    def faulty(sched):
        if when(sched, llm.scheduler.requests):
            raise RuntimeError("injected fault")
        return real(sched)

    monkeypatch.setattr(llm.runner, "execute_model", faulty)


def _run_with_bad(llm, prompts, params, bad_index):
    eng, outputs = llm.llm_engine, {}
    ids = [f"f{i}" for i in range(len(prompts))]
    for rid, p, sp in zip(ids, prompts, params):
        eng.add_request(rid, p, sp)
    _drain(eng, outputs)
    return ids, outputs


class _FailingOutput:
    """A step's output whose ``get_output`` raises (an error surfacing at the device sync)."""

    def __init__(self, out):
        self._out = out

    def __getattr__(self, name):
        return getattr(self._out, name)

    def get_output(self):
        raise RuntimeError("injected fault at the output sync")


@pytest.mark.parametrize("where", ["admission", "decode", "output", "get_output"])
def test_a_fault_ends_only_its_request(tight, monkeypatch, where):
    llm, prompts, params, clean = tight
    bad = "f2"
    if where == "get_output":
        # NOTE: the step launched fine; its requests must be reset although the previous
        # step's output processing left nothing "unapplied" (the bug this case pins).
        real_exec = llm.runner.execute_model

        def faulty(sched):
            out, reqs = real_exec(sched), llm.scheduler.requests
            if (bad in sched.sampling_req_ids and bad in reqs
                    and len(reqs[bad].output_token_ids) >= 2):
                return _FailingOutput(out)
            return out

        monkeypatch.setattr(llm.runner, "execute_model", faulty)
    elif where == "admission":
        _inject(llm, monkeypatch, lambda s, reqs: any(n.req_id == bad for n in s.new_reqs))
    elif where == "decode":
        _inject(llm, monkeypatch, lambda s, reqs: bad in s.num_scheduled_tokens and bad in reqs
                and len(reqs[bad].output_token_ids) >= 3)
    else:
        real = llm.engine._check_stop

        def check(req, token):
            if req.request_id == bad and len(req.output_token_ids) == 2:
                raise KeyError("injected output fault")
            return real(req, token)

        monkeypatch.setattr(llm.engine, "_check_stop", check)
        # NOTE: the quick stop check skips _check_stop while no condition can hold; with
        # a limit of 0 every token goes through it (and so through the injected fault).
        monkeypatch.setattr(llm.engine, "_stop_limits", lambda req: (0, frozenset()))
    ids, outputs = _run_with_bad(llm, prompts, params, 2)
    out = outputs[bad].outputs[0]
    assert outputs[bad].finished and out.finish_reason == "error"
    assert "injected" in out.stop_reason and bad in out.stop_reason
    for rid, want in zip(ids, clean):
        if rid != bad:
            assert outputs[rid].outputs[0].finish_reason == "length"
            assert outputs[rid].outputs[0].token_ids == want, rid
    assert_nothing_held(llm)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_fault_at_the_output_sync_while_speculating_is_recomputed(async_scheduling):
    """n-gram speculation: a step whose get_output raises once is reset (its drafts' and
    bonus token's placeholders undone) and recomputed; every request ends as without it."""
    loop = [5, 17, 42, 99, 7, 3, 250, 11]
    prompts = [{"prompt_token_ids": (loop * 3)[: 5 + 7 * i]} for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    llm = stories_llm(async_scheduling=async_scheduling,
                      speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    clean = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    real, calls = llm.runner.execute_model, []

    def faulty(sched):
        calls.append(sched)
        out = real(sched)
        return _FailingOutput(out) if len(calls) == 4 else out

    llm.runner.execute_model = faulty
    res = llm.generate(prompts, params, use_tqdm=False)
    assert len(calls) > 4                                       # the fault did happen
    assert [o.outputs[0].finish_reason for o in res] == ["length"] * 4
    assert [o.outputs[0].token_ids for o in res] == clean
    assert_nothing_held(llm)


def test_a_fault_in_generate_is_reported_not_raised():
    llm = stories_llm()
    real = llm.runner.execute_model
    bad_prompt = {"prompt_token_ids": [1, 9, 9, 9]}

    def faulty(sched):
        if any(n.prefill_token_ids[:4] == [1, 9, 9, 9] for n in sched.new_reqs):
            raise RuntimeError("injected")
        return real(sched)

    llm.runner.execute_model = faulty
    outs = llm.generate([PROMPT, bad_prompt, PROMPT],
                        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                        use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in outs] == ["length", "error", "length"]
    assert outs[0].outputs[0].token_ids == outs[2].outputs[0].token_ids
    assert_nothing_held(llm)
