"""Seeded, bounded fuzz of the engine API (issue 13).

Two hundred random requests on stories260K, valid and invalid mixed, submitted in a
burst and then while others are in flight, with random aborts. Every valid request that
was not aborted must finish with exactly the tokens of a clean batch run (greedy and
seeded sampling are batch-invariant); every invalid one must be refused with a
``ValueError``/``TypeError`` naming the field; at the end no request, state row or KV
block is held. Tiny ``max_tokens`` and a tight pool (so preemption happens) keep it
within a minute or two on 2 CPU cores.
"""

from __future__ import annotations

import math
import random

import pytest
from engine_checks import assert_nothing_held, stories_llm

from mrv2 import SamplingParams

NUM_REQUESTS = 200
VOCAB = 512

# (field named by the error, kwargs) refused when SamplingParams is built.
BAD_AT_BUILD = [
    ("temperature", {"temperature": -0.5}), ("temperature", {"temperature": math.inf}),
    ("top_p", {"top_p": 0.0}), ("top_k", {"top_k": -3}), ("min_p", {"min_p": 1.5}),
    ("n", {"n": 0}), ("max_tokens", {"max_tokens": 0}),
    ("min_tokens", {"min_tokens": 5, "max_tokens": 2}), ("logit_bias", {"logit_bias": {1: math.nan}}),
    ("logit_bias", {"logit_bias": [1, 2]}), ("stop", {"stop": 5}), ("seed", {"seed": 2**64}),
    ("seed", {"seed": 2**63 - 1, "n": 2}), ("repetition_penalty", {"repetition_penalty": 0}),
    ("presence_penalty", {"presence_penalty": 9.0}), ("allowed_token_ids", {"allowed_token_ids": []}),
    ("stop_token_ids", {"stop_token_ids": [-1]}), ("stop_token_ids", {"stop_token_ids": [True]}),
    ("logprobs", {"logprobs": -2}), ("temperature", {"temperature": "0.5"}),
]
# Refused at submit: model limits (vocab 512, no tokenizer, 300 logit_bias entries).
BAD_AT_SUBMIT = [
    ("logprobs", {"logprobs": VOCAB + 1}), ("prompt_logprobs", {"prompt_logprobs": 10**6}),
    ("stop_token_ids", {"stop_token_ids": [600], "min_tokens": 1}),
    ("allowed_token_ids", {"allowed_token_ids": [VOCAB]}),
    ("logit_bias", {"logit_bias": {700: 1.0}}), ("stop", {"stop": ["x"]}),
    ("logit_bias", {"logit_bias": {i: 0.5 for i in range(301)}}),
    ("allowed_token_ids", {"allowed_token_ids": [9], "stop_token_ids": [9], "min_tokens": 1}),
]
# Set on a valid object after it was built: caught by the re-validation at submit.
BAD_MUTATION = [("n", 0), ("max_tokens", -1), ("temperature", "hot"), ("seed", 1.5),
                ("top_k", 2.5), ("logit_bias", {3: math.inf}), ("stop_token_ids", 7)]
# Bad prompts: (field or phrase in the error, prompt).
BAD_PROMPT = [("prompt_token_ids", {"prompt_token_ids": [600]}), ("empty", {"prompt_token_ids": []}),
              ("max_model_len", {"prompt_token_ids": [5] * 64}),
              ("prompt_token_ids", {"prompt_token_ids": [1, True]}),
              ("tokenizer", "a text prompt"), ("prompt", 42)]


def _valid_params(rng: random.Random) -> SamplingParams:
    kw = {"max_tokens": rng.randint(1, 4), "ignore_eos": rng.random() < 0.7}
    if rng.random() < 0.4:
        kw["temperature"] = 0.0
    else:
        kw.update(temperature=rng.choice([0.5, 1.0, 1.5]), seed=rng.randrange(2**32))
        if rng.random() < 0.3:
            kw["top_k"] = rng.choice([1, 5, 50, 10**9])
        if rng.random() < 0.3:
            kw["top_p"] = rng.choice([0.5, 0.9])
        if rng.random() < 0.2:
            kw["min_p"] = 0.1
    if rng.random() < 0.15:
        kw["n"] = 2
    if rng.random() < 0.2:
        kw.update(presence_penalty=rng.uniform(-1, 1), frequency_penalty=rng.uniform(-1, 1),
                  repetition_penalty=rng.choice([0.8, 1.2]))
    if rng.random() < 0.2:
        kw["logit_bias"] = {rng.randrange(VOCAB): rng.uniform(-5, 5) for _ in range(3)}
    if rng.random() < 0.15:
        kw["allowed_token_ids"] = rng.sample(range(3, VOCAB), rng.randint(5, 40))
    if rng.random() < 0.2:
        kw["stop_token_ids"] = [rng.randrange(3, VOCAB)]
        kw["min_tokens"] = rng.randint(0, kw["max_tokens"])
    if rng.random() < 0.15:
        kw["logprobs"] = rng.randint(0, 5)
    return SamplingParams(**kw)


def _prompt(rng: random.Random) -> dict:
    return {"prompt_token_ids": [1] + [rng.randrange(3, VOCAB) for _ in range(rng.randint(0, 30))]}


def _make_cases(rng: random.Random):
    """``("valid", prompt, params)`` or ``("bad", field, thunk)``: the thunk builds and submits."""
    cases = []
    for _ in range(NUM_REQUESTS):
        r = rng.random()
        if r < 0.7:
            cases.append(("valid", _prompt(rng), _valid_params(rng)))
        elif r < 0.8:
            field, kw = rng.choice(BAD_AT_BUILD)
            cases.append(("bad", field, _prompt(rng), lambda kw=kw: SamplingParams(**kw)))
        elif r < 0.88:
            field, kw = rng.choice(BAD_AT_SUBMIT)
            cases.append(("bad", field, _prompt(rng), lambda kw=kw: SamplingParams(**kw)))
        elif r < 0.95:
            field, value = rng.choice(BAD_MUTATION)
            sp = _valid_params(rng)

            def mutated(sp=sp, field=field, value=value):
                setattr(sp, field, value)
                return sp
            cases.append(("bad", field, _prompt(rng), mutated))
        else:
            field, prompt = rng.choice(BAD_PROMPT)
            cases.append(("bad", field, prompt, lambda: SamplingParams(max_tokens=2)))
    return cases


@pytest.mark.slow
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_fuzz_valid_complete_invalid_refused_nothing_held(async_scheduling):
    rng = random.Random(1234 + async_scheduling)
    llm = stories_llm(async_scheduling=async_scheduling, max_num_seqs=8,
                      max_num_batched_tokens=48, num_gpu_blocks_override=12, block_size=8,
                      max_model_len=64)
    eng = llm.llm_engine
    cases = _make_cases(rng)
    valid = {f"v{i}": (c[1], c[2]) for i, c in enumerate(cases) if c[0] == "valid"}
    outputs, aborted, refused = {}, set(), 0
    queue = list(enumerate(cases))
    burst, queue = queue[:40], queue[40:]

    def submit(i, case):
        nonlocal refused
        if case[0] == "valid":
            eng.add_request(f"v{i}", case[1], case[2])
            return
        _, field, prompt, make = case
        with pytest.raises((ValueError, TypeError), match=field):
            eng.add_request(f"b{i}", prompt, make())
        assert f"b{i}" not in llm.scheduler.requests
        refused += 1

    for i, case in burst:  # submitted together
        submit(i, case)
    while queue or eng.has_unfinished_requests():
        for _ in range(rng.choice([0, 0, 1, 2, 3])):  # while others are in flight
            if queue:
                submit(*queue.pop(0))
        live = [rid for rid in eng._groups if rid not in outputs or not outputs[rid].finished]
        if live and rng.random() < 0.08:
            rid = rng.choice(live)
            eng.abort_request(rid)
            aborted.add(rid)
            assert not llm.kv_manager.get_blocks(rid) and rid not in llm.runner.state
        for out in eng.step():
            outputs[out.request_id] = out
    assert_nothing_held(llm)
    print(f"\nfuzz: {refused} refused, {len(aborted)} aborted, "
          f"{llm.scheduler.num_preemptions} preemptions, {llm.engine.num_steps} steps")
    assert refused > 30 and len(aborted) > 3 and llm.scheduler.num_preemptions > 0

    clean_ids = sorted(valid, key=lambda r: int(r[1:]))
    clean = llm.generate([valid[r][0] for r in clean_ids], [valid[r][1] for r in clean_ids],
                         use_tqdm=False)
    checked = 0
    for rid, want in zip(clean_ids, clean):
        if rid in aborted:
            continue
        got = outputs[rid]
        assert got.finished, rid
        assert [c.token_ids for c in got.outputs] == [c.token_ids for c in want.outputs], rid
        assert [c.finish_reason for c in got.outputs] == [c.finish_reason for c in want.outputs]
        checked += 1
    assert checked > 100
    assert_nothing_held(llm)
