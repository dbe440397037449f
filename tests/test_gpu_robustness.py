"""Issue 13 on the GPU: a 2,000-request random-parameter soak with random aborts, and abort
in every state with async scheduling on and off (embedded model, bf16, CUDA graphs).

At the end no request, state row or KV block is held and ``torch.cuda.memory_allocated``
is what it was before the soak. Run: ``python -m pytest tests/test_gpu_robustness.py -q -s``.
"""

from __future__ import annotations

import gc
import random
import time

import pytest
import torch

from mrv2 import LLM, SamplingParams
from mrv2.request import RequestStatus

pytestmark = pytest.mark.gpu


def _nothing_held(llm) -> None:
    assert not llm.llm_engine.has_unfinished_requests()
    assert not llm.scheduler.requests and llm.engine._pending is None
    assert llm.runner.state.num_reqs == 0
    assert llm.kv_manager.num_free_blocks == llm.kv_manager.num_blocks


def _params(rng: random.Random, vocab: int) -> SamplingParams:
    kw = {"max_tokens": rng.randint(1, 48), "ignore_eos": rng.random() < 0.5}
    if rng.random() < 0.3:
        kw["temperature"] = 0.0
    else:
        kw.update(temperature=rng.uniform(0.3, 1.5), seed=rng.randrange(2**40),
                  top_k=rng.choice([0, 0, 1, 20, 10**6]), top_p=rng.choice([1.0, 0.9, 0.5]),
                  min_p=rng.choice([0.0, 0.0, 0.05]))
    if rng.random() < 0.1:
        kw["n"] = rng.randint(2, 3)
    if rng.random() < 0.2:
        kw.update(presence_penalty=rng.uniform(-1, 1), frequency_penalty=rng.uniform(-1, 1),
                  repetition_penalty=rng.uniform(0.8, 1.3))
    if rng.random() < 0.2:
        kw["logit_bias"] = {rng.randrange(vocab): rng.uniform(-10, 10) for _ in range(5)}
    if rng.random() < 0.1:
        kw["allowed_token_ids"] = rng.sample(range(vocab), rng.randint(2, 64))
    if rng.random() < 0.2:
        kw["stop_token_ids"] = [rng.randrange(vocab) for _ in range(rng.randint(1, 3))]
        kw["min_tokens"] = rng.randint(0, kw["max_tokens"])
    if rng.random() < 0.15:
        kw["logprobs"] = rng.randint(0, 8)
    if rng.random() < 0.05:
        kw["prompt_logprobs"] = rng.randint(0, 3)
    return SamplingParams(**kw)


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_gpu_soak_2000_requests_random_aborts(async_scheduling):
    llm = LLM(max_model_len=256, max_num_seqs=64, max_num_batched_tokens=1024,
              num_gpu_blocks_override=96, async_scheduling=async_scheduling)
    vocab = llm.hf_config.vocab_size
    rng = random.Random(13)
    eng = llm.llm_engine

    def prompt():
        return {"prompt_token_ids": [rng.randrange(vocab) for _ in range(rng.randint(1, 160))]}

    # Warm-up: every lazily allocated buffer (penalties, logprobs, prompt logprobs) exists.
    llm.generate([prompt() for _ in range(8)],
                 SamplingParams(max_tokens=4, presence_penalty=0.5, logprobs=3,
                                prompt_logprobs=2, logit_bias={1: 1.0}, seed=1),
                 use_tqdm=False)
    gc.collect()  # NOTE: the previous test's LLM must not be counted in "before"
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    start, submitted, aborted, finished, refused = time.perf_counter(), 0, 0, 0, 0
    while submitted < 2000 or eng.has_unfinished_requests():
        for _ in range(rng.randint(0, 12)):
            if submitted < 2000:
                try:
                    eng.add_request(f"s{submitted}", prompt(), _params(rng, vocab))
                except ValueError as e:  # the rare fully masked mix is refused, named
                    assert "allowed_token_ids" in str(e)
                    refused += 1
                submitted += 1
        if eng._groups and rng.random() < 0.2:
            victims = rng.sample(sorted(eng._groups), min(2, len(eng._groups)))
            eng.abort_request(victims)
            aborted += len(victims)
        for out in eng.step():
            if out.finished:
                finished += 1
                assert all(c.finish_reason in ("stop", "length") for c in out.outputs)
    elapsed = time.perf_counter() - start
    gc.collect()
    torch.cuda.synchronize()
    after = torch.cuda.memory_allocated()
    _nothing_held(llm)
    print(f"\nsoak async={async_scheduling}: {submitted} requests, {finished} finished, "
          f"{aborted} aborted, {refused} refused, {llm.scheduler.num_preemptions} preemptions, "
          f"{elapsed:.1f} s; memory_allocated before {before} after {after}")
    # Every request finished, was aborted while live, or was refused: nothing is lost.
    assert finished + aborted + refused == submitted == 2000
    assert finished > 500 and aborted > 100 and llm.scheduler.num_preemptions > 0
    assert after == before


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize("target", ["waiting", "prefill", "decode", "preempted"])
def test_gpu_abort_in_any_state(async_scheduling, target):
    llm = LLM(max_model_len=128, max_num_seqs=3, max_num_batched_tokens=16,
              num_gpu_blocks_override=8, async_scheduling=async_scheduling)
    rng = random.Random(3)
    vocab = llm.hf_config.vocab_size
    prompts = [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(rng.randint(24, 40))]}
               for _ in range(5)]
    params = [SamplingParams(temperature=0, max_tokens=12 + i, ignore_eos=True) if i % 2 else
              SamplingParams(temperature=0.8, seed=5 + i, max_tokens=12 + i, ignore_eos=True)
              for i in range(5)]
    clean = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    eng, sch = llm.llm_engine, llm.scheduler
    ids = [f"r{i}" for i in range(5)]
    for rid, p, sp in zip(ids, prompts, params):
        eng.add_request(rid, p, sp)
    outputs, victim = {}, None
    while eng.has_unfinished_requests():
        for rid in ids:
            req = sch.requests.get(rid)
            if victim is None and req is not None:
                state = {RequestStatus.PREEMPTED: "preempted", RequestStatus.WAITING: "waiting"}.get(
                    req.status, "prefill" if req.num_computed_tokens < req.num_prompt_tokens
                    else "decode")
                if state == target:
                    victim = rid
                    eng.abort_request(rid)
                    assert not llm.kv_manager.get_blocks(rid) and rid not in llm.runner.state
        for out in eng.step():
            outputs[out.request_id] = out
    assert victim is not None
    for rid, want in zip(ids, clean):
        if rid != victim:
            assert outputs[rid].outputs[0].token_ids == want, rid
    _nothing_held(llm)
