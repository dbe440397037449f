"""Speculative decoding end to end on the CPU (fp32): the same tokens as without it.

n-gram proposer, ``exact`` verification. Repetitive prompts make the drafts real (the
tests assert acceptance > 0); tight limits force queueing, chunked prefill beside
speculating decodes, and preemption; async scheduling on and off.
"""

import random

import pytest
from engine_checks import assert_nothing_held

from mrv2 import LLM, SamplingParams
from mrv2.models.loader import DEFAULT_MODEL_DIR


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def _spec(k, **extra):
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4,
            "prompt_lookup_min": 2, **extra}


def _tight(spec=None, async_scheduling=False, **kw):
    # 4 rows, 16 tokens a step, 16 blocks of 4 tokens: queueing + chunked prefill + preemption.
    return LLM(DEFAULT_MODEL_DIR, dtype="float32", max_model_len=64, max_num_seqs=4,
               max_num_batched_tokens=16, num_gpu_blocks_override=16, block_size=4,
               async_scheduling=async_scheduling, speculative_config=spec, **kw)


#: The embedded model's own greedy loop after "JULIET:" (period 11), as a prompt: its
#: continuation repeats it, so the n-gram drafts are real and get accepted.
LOOP = [952, 26, 199, 47, 12, 292, 359, 850, 1, 199, 199, 952, 26]
#: "KING RICHARD II:" and the first 18 tokens of its (almost periodic) greedy output.
KING = [446, 664, 663, 26, 199, 532, 437, 12, 292, 385, 322, 978, 288, 13, 1391, 14, 199, 199,
        446, 664, 905, 26]


def _inputs(tok=None):
    rng = random.Random(0)
    ids = [LOOP, KING, [814, 26], LOOP * 3]                       # LOOP * 3: chunked (39)
    ids += [[rng.randrange(1, 2048) for _ in range(n)] for n in (3, 20)]
    ids.append((LOOP * 4)[:52])                                   # runs to max_model_len
    return [{"prompt_token_ids": p} for p in ids]


def _params():
    # ignore_eos; the last request runs until max_model_len (max_tokens None).
    return ([SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
             for n in (12, 10, 8, 10, 6, 9)]
            + [SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)])


@pytest.fixture(scope="module")
def baseline():
    llm = _tight()
    inputs = _inputs(llm.tokenizer)
    return inputs, llm.generate(inputs, _params(), use_tqdm=False)


def _assert_clean(llm):
    assert_nothing_held(llm)
    llm.generate(["A"], SamplingParams(max_tokens=1), use_tqdm=False)
    assert_nothing_held(llm)  # and again after one more request


@pytest.mark.parametrize("k,async_scheduling", [(1, False), (3, True), (5, False), (5, True)])
def test_greedy_equals_no_speculation_tight(baseline, k, async_scheduling):
    inputs, want = baseline
    llm = _tight(_spec(k), async_scheduling)
    got = llm.generate(inputs, _params(), use_tqdm=False)
    assert _ids(got) == _ids(want)
    assert [o.outputs[0].finish_reason for o in got] == [o.outputs[0].finish_reason for o in want]
    assert len(got[-1].outputs[0].token_ids) == 64 - len(inputs[-1]["prompt_token_ids"])
    stats = llm.runner.spec.stats
    assert stats.num_accepted_tokens > 0 and stats.num_spec_steps > 0
    assert llm.scheduler.num_preemptions > 0
    assert sum(o.metrics.spec_decode["num_accepted_tokens"] for o in got) == \
        stats.num_accepted_tokens
    assert llm.engine.num_steps < _steps_without(want)
    _assert_clean(llm)


def _steps_without(outs):
    # A loose upper bound on the steps a non-speculative run of these needs.
    return sum(len(o.outputs[0].token_ids) for o in outs) + len(outs) * 4


def test_stories260k_greedy_equals_no_speculation(shared_data):
    path = str(shared_data / "stories260K" / "hf-llama")
    kw = {"skip_tokenizer_init": True, "dtype": "float32", "max_model_len": 96,
          "max_num_seqs": 3, "max_num_batched_tokens": 24, "num_gpu_blocks_override": 40,
          "block_size": 4}
    # stories260K's greedy output after [1]; given it once and its start again, the model
    # continues it: the n-gram drafts are real.
    story = [1, 403, 407, 261, 378, 432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426, 338,
             401, 396, 267, 337, 410, 408, 419, 292]
    prompts = [{"prompt_token_ids": p} for p in (story + story[:8], [1, 5, 9], story[:20])]
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    want = LLM(path, **kw).generate(prompts, sp, use_tqdm=False)
    llm = LLM(path, speculative_config=_spec(3), async_scheduling=True, **kw)
    assert _ids(llm.generate(prompts, sp, use_tqdm=False)) == _ids(want)
    assert llm.runner.spec.stats.num_accepted_tokens > 0


@pytest.fixture(scope="module")
def roomy():
    kw = {"max_model_len": 128, "max_num_seqs": 4, "dtype": "float32"}
    return LLM(**kw), LLM(speculative_config=_spec(3), async_scheduling=True, **kw)


def test_seeded_sampling_identical_alone_and_in_batch(roomy):
    plain, spec = roomy
    sp = [SamplingParams(temperature=0.8, top_p=0.9, seed=s, max_tokens=8, ignore_eos=True)
          for s in (6, 8, 2)]
    # NOTE: the tiny model's T = 0.8 samples leave its loop quickly; these seeds stay in it
    # for a few tokens, so some drafts are accepted.
    prompts = [{"prompt_token_ids": p} for p in (LOOP * 3, LOOP * 3, KING)]
    want = _ids(plain.generate(prompts, sp, use_tqdm=False))
    assert _ids(spec.generate(prompts, sp, use_tqdm=False)) == want
    assert _ids(spec.generate(prompts[:1], sp[:1], use_tqdm=False)) == want[:1]
    assert spec.runner.spec.stats.num_accepted_tokens > 0


def test_logprobs_identical(roomy):
    plain, spec = roomy
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)
    prompts = [{"prompt_token_ids": LOOP}, "JULIET:"]
    a, b = plain.generate(prompts, sp, use_tqdm=False), spec.generate(prompts, sp,
                                                                       use_tqdm=False)
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        assert len(y.outputs[0].logprobs) == 8
        for px, py in zip(x.outputs[0].logprobs, y.outputs[0].logprobs):
            assert list(px) == list(py)
            for t in px:
                assert px[t].rank == py[t].rank
                assert px[t].logprob == pytest.approx(py[t].logprob, abs=1e-5)
        assert x.outputs[0].cumulative_logprob == pytest.approx(y.outputs[0].cumulative_logprob,
                                                                abs=1e-4)


def test_finishes_inside_accepted_runs(roomy):
    """Stop ids and max_tokens that fall inside a run: exactly the non-speculative tokens."""
    plain, spec = roomy
    prompts = [{"prompt_token_ids": p} for p in (LOOP, KING, LOOP * 2)]
    free = _ids(plain.generate(prompts, SamplingParams(temperature=0, max_tokens=16,
                                                       ignore_eos=True), use_tqdm=False))
    # Stop at each request's 9th token (its first occurrence ends it).
    params = [SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[ids[8]])
              for ids in free]
    a, b = plain.generate(prompts, params, use_tqdm=False), spec.generate(prompts, params,
                                                                           use_tqdm=False)
    assert _ids(a) == _ids(b)
    assert all(o.outputs[0].finish_reason == "stop" for o in b)
    for n in (1, 3, 7):
        sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        assert _ids(spec.generate(prompts, sp, use_tqdm=False)) == [ids[:n] for ids in free]
    _assert_clean(spec)


def test_penalties_and_min_tokens_decode_plainly_with_the_same_tokens(roomy):
    plain, spec = roomy
    prompts = [{"prompt_token_ids": LOOP}, "ROMEO:"]
    params = [SamplingParams(temperature=0, max_tokens=8, repetition_penalty=1.3,
                             ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=8, min_tokens=4,
                             stop_token_ids=[199, 12])]
    assert _ids(spec.generate(prompts, params, use_tqdm=False)) == \
        _ids(plain.generate(prompts, params, use_tqdm=False))


def test_sync_accepted_counts_same_tokens():
    kw = {"max_model_len": 96, "max_num_seqs": 4, "dtype": "float32", "async_scheduling": True}
    prompts = [{"prompt_token_ids": LOOP}, "JULIET:"]
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    a = LLM(speculative_config=_spec(3), **kw).generate(prompts, sp, use_tqdm=False)
    synced = LLM(speculative_config=_spec(3, sync_accepted_counts=True), **kw)
    assert _ids(synced.generate(prompts, sp, use_tqdm=False)) == _ids(a)
    _assert_clean(synced)


@pytest.mark.parametrize("kw,exc,match", [
    ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 0}}, ValueError,
     "num_speculative_tokens"),
    ({"speculative_config": {"method": "medusa", "num_speculative_tokens": 2}}, ValueError,
     "method"),
    ({"speculative_config": _spec(2), "runner": "v1"}, ValueError, "V2 runner"),
    ({"speculative_config": _spec(2), "logits_processors": [object()]}, ValueError,
     "logits_processors"),
    ({"speculative_config": "ngram"}, TypeError, "dict"),
])
def test_bad_speculative_config_fails_at_construction(kw, exc, match):
    with pytest.raises(exc, match=match):
        LLM(max_model_len=32, max_num_seqs=2, **kw)


def test_stop_strings_inside_accepted_runs(roomy):
    plain, spec = roomy
    prompts = [{"prompt_token_ids": p} for p in (LOOP, KING)]
    free = _ids(plain.generate(prompts, SamplingParams(temperature=0, max_tokens=12,
                                                       ignore_eos=True), use_tqdm=False))
    tok = plain.tokenizer
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                             stop=[tok.decode(ids[6:8])]) for ids in free]
    a, b = plain.generate(prompts, params, use_tqdm=False), spec.generate(prompts, params,
                                                                           use_tqdm=False)
    assert [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].stop_reason) for o in a] == \
        [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].stop_reason) for o in b]
    assert all(o.outputs[0].finish_reason == "stop" for o in b)


# -- the draft-model proposer (mrv2/assets/tiny-qwen3-shakespeare-draft) -----------------

DRAFT = str(DEFAULT_MODEL_DIR) + "-draft"


def _draft(k):
    return {"method": "draft_model", "model": DRAFT, "num_speculative_tokens": k}


@pytest.mark.parametrize("k,async_scheduling", [(1, True), (3, False)])
def test_draft_model_greedy_equals_no_speculation_tight(baseline, k, async_scheduling):
    inputs, want = baseline
    llm = _tight(_draft(k), async_scheduling)
    got = llm.generate(inputs, _params(), use_tqdm=False)
    assert _ids(got) == _ids(want)
    stats = llm.runner.spec.stats
    assert stats.num_accepted_tokens > 0 and llm.scheduler.num_preemptions > 0
    # A draft model proposes at every slot, except past a row's KV blocks (tight pool).
    assert stats.num_draft_tokens >= 0.8 * stats.num_draft_slots
    _assert_clean(llm)


def test_draft_model_seeded_sampling_identical_with_coupled_noise(roomy):
    plain, _ = roomy
    spec = LLM(max_model_len=128, max_num_seqs=4, dtype="float32",
               speculative_config=_draft(3), async_scheduling=True)
    prompts = [{"prompt_token_ids": p} for p in (LOOP, KING)] + ["JULIET:\nO Romeo,"]
    sp = [SamplingParams(temperature=0.8, top_p=0.9, seed=s, max_tokens=10, ignore_eos=True,
                         logprobs=1 if s == 1 else None) for s in range(3)]
    want = plain.generate(prompts, sp, use_tqdm=False)
    got = spec.generate(prompts, sp, use_tqdm=False)
    assert _ids(got) == _ids(want)
    for px, py in zip(want[1].outputs[0].logprobs, got[1].outputs[0].logprobs):
        assert list(px) == list(py)
    # The draft samples with the target's (seed, position) noise: sampled drafts get accepted.
    assert spec.runner.spec.stats.acceptance_rate > 0.2


@pytest.mark.parametrize("cfg,match", [
    ({"method": "draft_model", "model": "/nonexistent/draft", "num_speculative_tokens": 2},
     "model"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
    ({"method": "ngram", "model": DRAFT, "num_speculative_tokens": 2}, "only for"),
])
def test_bad_draft_model_config(cfg, match):
    with pytest.raises(ValueError, match=match):
        LLM(max_model_len=32, max_num_seqs=2, speculative_config=cfg)


def test_draft_with_another_vocabulary_is_refused(shared_data):
    cfg = {"method": "draft_model", "num_speculative_tokens": 2,
           "model": str(shared_data / "stories260K" / "hf-llama")}
    with pytest.raises(ValueError, match="vocab size"):
        LLM(max_model_len=32, max_num_seqs=2, speculative_config=cfg)
