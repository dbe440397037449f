"""LLM.generate end to end on the CPU: greedy equals transformers token for token.

The runs force every mechanism of the V2 runner core: queueing (few state rows),
chunked prefill (a small token budget), preemption by recompute (a small KV pool),
and compare with an unconstrained run and with Hugging Face greedy decoding.
"""

import random

import pytest
from hf_reference import hf_greedy

from mrv2 import LLM, SamplingParams
from mrv2.models.loader import DEFAULT_MODEL_DIR

GREEDY = SamplingParams(temperature=0, ignore_eos=True)


def _greedy(max_tokens):
    return SamplingParams(temperature=0, ignore_eos=True, max_tokens=max_tokens)


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def tiny_llm():
    return LLM(max_model_len=256, max_num_seqs=8, dtype="float32")


def test_embedded_model_greedy_equals_transformers_64_tokens(tiny_llm):
    prompts = ["ROMEO:", "JULIET:\nO Romeo,", "First Citizen:\nBefore we proceed any further,"]
    ids = [tiny_llm.tokenizer.encode(p) for p in prompts]
    outs = tiny_llm.generate(prompts, _greedy(64), use_tqdm=False)
    assert _ids(outs) == hf_greedy(DEFAULT_MODEL_DIR, ids, 64)
    for o in outs:
        assert o.outputs[0].finish_reason == "length"
        assert o.outputs[0].text == tiny_llm.tokenizer.decode(o.outputs[0].token_ids)


def test_stories260k_llama_mode_greedy_equals_transformers(shared_data):
    path = str(shared_data / "stories260K" / "hf-llama")
    llm = LLM(path, skip_tokenizer_init=True, max_model_len=512, max_num_seqs=4, dtype="float32")
    rng = random.Random(1)
    prompts = [[1] + [rng.randrange(3, 512) for _ in range(n)] for n in (1, 7, 30)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(64), use_tqdm=False)
    assert _ids(outs) == hf_greedy(path, prompts, 64)
    assert all(o.outputs[0].text == "" for o in outs)  # no tokenizer: token ids only


def _mixed_prompts(rng, n, vocab, lo, hi, first=None):
    return [([first] if first is not None else []) + [rng.randrange(3, vocab) for _ in range(rng.randrange(lo, hi))]
            for _ in range(n)]


@pytest.mark.parametrize("model", ["embedded", "stories260K"])
def test_constrained_run_equals_unconstrained_and_transformers(model, shared_data):
    """32 prompts; queueing, chunked prefill and preemption change nothing."""
    rng = random.Random(0)
    if model == "embedded":
        path, kw = DEFAULT_MODEL_DIR, {"dtype": "float32"}
        prompts = _mixed_prompts(rng, 32, 2048, 1, 40)
    else:
        path, kw = str(shared_data / "stories260K" / "hf-llama"), {"skip_tokenizer_init": True, "dtype": "float32"}
        prompts = _mixed_prompts(rng, 32, 512, 1, 40, first=1)
    n_out = 12
    inputs = [{"prompt_token_ids": p} for p in prompts]
    free = LLM(path, max_model_len=64, max_num_seqs=32, **kw)
    free_out = free.generate(inputs, _greedy(n_out), use_tqdm=False)
    assert free.scheduler.num_preemptions == 0
    # 4 rows, 16 tokens a step, 16 blocks of 4 tokens (one full-length sequence):
    # queueing + chunked prefill + preemption.
    tight = LLM(path, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16,
                num_gpu_blocks_override=16, block_size=4, **kw)
    tight_out = tight.generate(inputs, _greedy(n_out), use_tqdm=False)
    assert tight.scheduler.num_preemptions > 0
    assert max(len(p) for p in prompts) > 16  # some prompt was prefilled in chunks
    assert _ids(tight_out) == _ids(free_out)
    assert [o.request_id for o in tight_out] == sorted((o.request_id for o in tight_out), key=int)
    some = [0, 5, 17, 31]  # transformers on a sample (it recomputes without a cache)
    assert [_ids(free_out)[i] for i in some] == hf_greedy(path, [prompts[i] for i in some], n_out)


def test_seeded_request_same_alone_and_in_batch(tiny_llm):
    sp = SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=16, ignore_eos=True)
    alone = tiny_llm.generate(["ROMEO:"], sp, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True) for n in (3, 20, 9)]
    batch = tiny_llm.generate(["JULIET:", "Nurse:", "ROMEO:", "KING:"],
                              [others[0], others[1], sp, others[2]], use_tqdm=False)
    assert batch[2].outputs[0].token_ids == alone
    # Unseeded requests differ from one another (they get fresh random seeds).
    free = tiny_llm.generate(["ROMEO:"] * 2, SamplingParams(temperature=1.0, max_tokens=16,
                                                             ignore_eos=True), use_tqdm=False)
    assert free[0].outputs[0].token_ids != free[1].outputs[0].token_ids
