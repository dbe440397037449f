"""Sampling features through LLM.generate: logprobs, prompt logprobs, seeds, top-k/top-p.

Logprobs are checked against a full ``log_softmax`` of transformers' logits (fp32) on the
same weights, through chunked prefill and preemption.
"""

import pytest
import torch
from hf_reference import hf_model

from mrv2 import LLM, SamplingParams
from mrv2.models.loader import DEFAULT_MODEL_DIR

PROMPTS = ["ROMEO:\nIs the day so young?", "JULIET:", "First Citizen:\nBefore we proceed"]


@torch.inference_mode()
def _hf_logprobs(ids):
    return torch.log_softmax(hf_model(DEFAULT_MODEL_DIR)(torch.tensor([ids])).logits[0].float(), -1)


def _check_against_hf(out, k_sample, k_prompt):
    comp = out.outputs[0]
    ids = out.prompt_token_ids + comp.token_ids
    ref = _hf_logprobs(ids)                                       # [len, V]
    p = len(out.prompt_token_ids)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == p
    for j in range(1, p):
        entry, row = out.prompt_logprobs[j], ref[j - 1]
        tok = ids[j]
        assert abs(entry[tok].logprob - row[tok].item()) < 1e-4
        assert entry[tok].rank == int((row > row[tok]).sum()) + 1
        top = row.topk(k_prompt).indices.tolist()
        assert set(top) <= set(entry)                             # the top-k ids are there
    assert len(comp.logprobs) == len(comp.token_ids)
    total = 0.0
    for j, tok in enumerate(comp.token_ids):
        entry, row = comp.logprobs[j], ref[p - 1 + j]
        assert abs(entry[tok].logprob - row[tok].item()) < 1e-4
        assert set(row.topk(k_sample).indices.tolist()) <= set(entry)
        total += entry[tok].logprob
    assert abs(comp.cumulative_logprob - total) < 1e-4


@pytest.mark.parametrize("tight", [False, True])
def test_logprobs_and_prompt_logprobs_equal_full_log_softmax(tight):
    # 5 tokens a step, 3 rows, a pool of 8 blocks x 4 tokens: chunks + preemption.
    kw = {"max_num_batched_tokens": 5, "max_num_seqs": 3, "num_gpu_blocks_override": 8,
              "block_size": 4} if tight else {}
    llm = LLM(max_model_len=32, dtype="float32", **kw)
    sp = SamplingParams(temperature=0.8, top_k=50, seed=3, max_tokens=10, ignore_eos=True,
                        logprobs=3, prompt_logprobs=2)
    outs = llm.generate(PROMPTS, sp, use_tqdm=False)
    if tight:  # chunked prompts and a preemption happened, and changed nothing
        assert llm.scheduler.num_preemptions > 0
    for out in outs:
        _check_against_hf(out, 3, 2)
    # The decoded text of a logprob entry is the token's text.
    entry = outs[1].outputs[0].logprobs[0]
    tok = outs[1].outputs[0].token_ids[0]
    assert entry[tok].decoded_token == llm.tokenizer.decode([tok])


def test_seeded_request_same_alone_and_in_a_batch_of_64():
    llm = LLM(max_model_len=32, max_num_seqs=64, dtype="float32")
    sp = SamplingParams(temperature=1.0, top_p=0.9, seed=11, max_tokens=4, ignore_eos=True)
    alone = llm.generate(["ROMEO:"], sp, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True)
    for slot in (37,):  # (test_llm_e2e puts it at another slot of a smaller batch)
        params = [others] * 64
        params[slot] = sp
        prompts = ["JULIET:"] * 64
        prompts[slot] = "ROMEO:"
        out = llm.generate(prompts, params, use_tqdm=False)
        assert out[slot].outputs[0].token_ids == alone


def test_top_k_one_is_greedy():
    llm = LLM(max_model_len=64, dtype="float32")
    greedy = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                          use_tqdm=False)
    topk1 = llm.generate(PROMPTS, SamplingParams(temperature=1.5, top_k=1, max_tokens=8,
                                                 ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in topk1] == [o.outputs[0].token_ids for o in greedy]


def test_logit_rules_through_generate():
    from mrv2.sample.logits_processors import (
        NoRepeatNGramLogitsProcessor,
        TokenBanLogitsProcessor,
        no_repeat_ngram_banned_ref,
    )

    llm = LLM(max_model_len=64, max_num_seqs=4, dtype="float32")
    base = llm.generate("ROMEO:", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids
    # allowed_token_ids: only these ids come out; logit_bias: a huge bias forces a token.
    allowed = [5, 17, 300]
    out = llm.generate("ROMEO:", [SamplingParams(temperature=1.0, seed=0, max_tokens=12,
                                                 ignore_eos=True, allowed_token_ids=allowed)],
                       use_tqdm=False)[0].outputs[0].token_ids
    assert set(out) <= set(allowed)
    out = llm.generate("ROMEO:", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                logit_bias={42: 100.0}), use_tqdm=False)
    assert out[0].outputs[0].token_ids == [42] * 6
    # A repetition penalty changes the greedy text of this repetitive model.
    pen = llm.generate("ROMEO:", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                repetition_penalty=2.0), use_tqdm=False)
    assert pen[0].outputs[0].token_ids != base
    # min_tokens: EOS (here: the greedy 3rd token, made the EOS id) is banned until 8 tokens.
    llm.eos_token_ids = {base[2]}
    out = llm.generate("ROMEO:", SamplingParams(temperature=0, max_tokens=12, min_tokens=8),
                       use_tqdm=False)[0].outputs[0]
    assert base[2] not in out.token_ids[:8] and len(out.token_ids) >= 8
    # Logits processors from LLM(...): no n-gram repeats, banned ids never appear.
    banned = sorted(set(base))[:3]
    llm2 = LLM(max_model_len=64, max_num_seqs=4, dtype="float32", logits_processors=[
        lambda rows, dev: NoRepeatNGramLogitsProcessor(2, rows, dev),
        TokenBanLogitsProcessor(banned, "cpu" if not torch.cuda.is_available() else "cuda")])
    toks = llm2.generate("ROMEO:", SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                         use_tqdm=False)[0]
    ids = toks.prompt_token_ids + toks.outputs[0].token_ids
    assert not set(banned) & set(toks.outputs[0].token_ids)
    for j in range(len(toks.prompt_token_ids), len(ids)):
        assert ids[j] not in no_repeat_ngram_banned_ref(ids[:j], 2)
