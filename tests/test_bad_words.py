"""bad_words (mrv2/sample/bad_words.py): the Triton rule equals its reference; LLM end to end."""

import random

import pytest
import torch
from device_utils import generate_without_sync

from mrv2 import LLM, SamplingParams
from mrv2.sample.bad_words import (
    BadWordsState,
    apply_bad_words_ref,
    bad_words_banned_ref,
    bad_words_token_ids,
)
from mrv2.state import RequestStateTable


def test_reference_on_hand_made_cases():
    assert bad_words_banned_ref([], [[5]]) == {5}                     # one token: always
    assert bad_words_banned_ref([], [[4, 5]]) == set()                # prefix not generated
    assert bad_words_banned_ref([1, 4], [[4, 5], [1, 9], [2]]) == {5, 2}
    assert bad_words_banned_ref([4], [[3, 4, 5]]) == set()            # longer than output + 1
    assert bad_words_banned_ref([3, 4], [[3, 4, 5]]) == {5}


_CPU_ONLY = "the interpreter on CPU tensors; the GPU test covers the compiled kernel"


def _setup(rng, num_rows, vocab, max_len, outputs, words, device="cpu"):
    """A state table whose rows hold random prompts + ``outputs``, and a BadWordsState."""
    state = RequestStateTable(num_rows, max_len, device)
    bad = BadWordsState(num_rows, device, max_words=6, max_word_len=4)
    for r, (out, seqs) in enumerate(zip(outputs, words)):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 5))]
        state.add_request(f"r{r}", prompt + out, len(prompt))
        sp = SamplingParams()
        sp.bad_words_token_ids = seqs
        bad.add_request(r, sp)
    state.apply_staged_writes()
    bad.apply_staged_writes()
    return state, bad


@pytest.mark.skipif(torch.cuda.is_available(), reason=_CPU_ONLY)
@pytest.mark.parametrize("seed", range(4))
def test_kernel_equals_reference_random(seed):
    rng = random.Random(seed)
    vocab, num_rows = 40, 6
    # Small alphabets so that prefixes often match; outputs of length 0 (fresh) included.
    outputs = [[rng.randrange(4) for _ in range(rng.choice([0, 1, 3, 9]))] for _ in range(num_rows)]
    words = [[[rng.randrange(4) for _ in range(rng.randint(1, 4) - 1)] + [rng.randrange(vocab)]
              for _ in range(rng.randint(0, 6))] for _ in range(num_rows)]
    words[0] = [[3, vocab - 1]]  # the last token of the vocabulary
    state, bad = _setup(rng, num_rows, vocab, 32, outputs, words)
    order = list(range(num_rows))
    rng.shuffle(order)  # batch slots read rows through idx_mapping
    idx_mapping = torch.tensor(order, dtype=torch.int32)
    logits = torch.randn(num_rows, vocab)
    expected = apply_bad_words_ref(logits, [outputs[r] for r in order], [words[r] for r in order])
    got = bad.apply(logits.clone(), idx_mapping, state)
    torch.testing.assert_close(got, expected)


@pytest.mark.skipif(torch.cuda.is_available(), reason=_CPU_ONLY)
def test_edge_cases_empty_batch_padding_and_reused_rows():
    rng = random.Random(9)
    state, bad = _setup(rng, 3, 16, 16, [[1, 2], [], [7]], [[[2, 5]], [[9]], []])
    empty = torch.empty(0, 16)
    assert bad.apply(empty, torch.zeros(0, dtype=torch.int32), state).shape == (0, 16)
    assert bad.any_active([0]) and not bad.any_active([2])
    # A batch of 2 over a longer (padded) idx_mapping: only the first 2 slots count.
    logits = torch.zeros(2, 16)
    bad.apply(logits, torch.tensor([1, 0, 2, 2], dtype=torch.int32), state)
    assert torch.isinf(logits[0, 9]) and torch.isinf(logits[1, 5])
    assert torch.isfinite(logits).sum() == 2 * 16 - 2
    # Row 0 freed and reused by a request without words: its stale words are cleared.
    state.remove_request("r0")
    bad.remove_request(0)
    state.add_request("again", [1, 2], 1)
    bad.add_request(0, SamplingParams())
    state.apply_staged_writes()
    bad.apply_staged_writes()
    logits = torch.zeros(1, 16)
    bad.apply(logits, torch.tensor([0], dtype=torch.int32), state)
    assert torch.isfinite(logits).all() and int(bad.num_words[0]) == 0


def test_capacity_is_checked():
    bad = BadWordsState(2, "cpu", max_words=1, max_word_len=2)
    sp = SamplingParams()
    sp.bad_words_token_ids = [[1, 2, 3]]
    with pytest.raises(ValueError, match="bad_words"):
        bad.add_request(0, sp)


@pytest.fixture(scope="module")
def llm():
    return LLM(max_model_len=128, max_num_seqs=4)


def test_token_ids_like_vllm(llm):
    tok = llm.tokenizer
    seqs = bad_words_token_ids(tok, ["king", " lord"], llm.hf_config.vocab_size)
    plain, spaced = tok.encode("king", add_special_tokens=False), tok.encode(" king",
                                                                          add_special_tokens=False)
    assert plain in seqs and tok.encode("lord", add_special_tokens=False) in seqs
    assert (spaced in seqs) == (spaced[0] != plain[0] and len(spaced) == len(plain))
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(bad_words="king")  # a string, not a list


def test_generate_never_emits_a_bad_word(llm):
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    base = llm.generate("ROMEO:", greedy, use_tqdm=False)[0].outputs[0].token_ids
    # A generated token that is a whole word on its own ("O" of "\nO, I am ...").
    pos, word = next((i, llm.tokenizer.decode([t])) for i, t in enumerate(base)
                     if llm.tokenizer.decode([t]).isalpha()
                     and llm.tokenizer.encode(llm.tokenizer.decode([t]),
                                              add_special_tokens=False) == [t])
    seqs = bad_words_token_ids(llm.tokenizer, [word], llm.hf_config.vocab_size)
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, bad_words=[word])
    out = llm.generate(["ROMEO:", "ROMEO:"], [sp, greedy], use_tqdm=False)
    banned = out[0].outputs[0].token_ids
    for seq in seqs:
        assert not any(banned[i:i + len(seq)] == seq for i in range(len(banned)))
    assert banned[:pos] == base[:pos] and banned[pos] != base[pos]  # same until the ban
    assert out[1].outputs[0].token_ids == base  # the other row is untouched


def test_multi_token_bad_word_bans_only_after_its_prefix(llm):
    base = llm.generate("ROMEO:", SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids
    word = base[3:5]  # two generated tokens, as one "word"
    text = llm.tokenizer.decode(word)
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, bad_words=[text])
    seqs = bad_words_token_ids(llm.tokenizer, [text], llm.hf_config.vocab_size)
    out = llm.generate("ROMEO:", sp, use_tqdm=False)[0].outputs[0].token_ids
    for seq in seqs:  # no sequence appears in the output
        assert not any(out[i:i + len(seq)] == seq for i in range(len(out)))
    assert out[:4] == base[:4]  # the prefix itself is still allowed


def test_v1_runner_refuses_bad_words():
    v1 = LLM(max_model_len=64, max_num_seqs=2, runner="v1")
    with pytest.raises(ValueError, match="bad_words"):
        v1.generate("ROMEO:", SamplingParams(bad_words=["king"]), use_tqdm=False)


@pytest.mark.gpu
def test_gpu_bad_words_never_sync_and_match_reference_bf16():
    """The rule inside the async V2 loop (graphs, preemption) under sync-debug "error"."""
    llm = LLM(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16,
              num_gpu_blocks_override=16, block_size=4, async_scheduling=True)
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=12, ignore_eos=True,
                             bad_words=["O", "king", "the lord"] if i % 2 else None)
              for i in range(12)]
    prompts = ["ROMEO:", "JULIET:", "First Citizen:"] * 4
    llm.generate(prompts[:4], params[:4], use_tqdm=False)  # warm-up: compile kernels
    outs = generate_without_sync(llm, prompts, params)
    assert all(o.finished for o in outs)
    for o, sp in zip(outs, params):
        for seq in sp.bad_words_token_ids or []:
            ids = o.outputs[0].token_ids
            assert not any(ids[i:i + len(seq)] == seq for i in range(len(ids)))
    # The kernel on bf16 logits on the device equals the reference.
    rng = random.Random(3)
    outputs = [[1, 2], [], [3], [2, 2, 2]]
    words = [[[2, 7]], [[9]], [[3, 63]], [[2, 2, 5], [1, 4]]]
    state_gpu, bad_gpu = _setup(rng, 4, 64, 32, outputs, words, device="cuda")
    logits = torch.randn(4, 64).bfloat16()
    order = [3, 1, 0, 2]
    idx = torch.tensor(order, dtype=torch.int32)
    expected = apply_bad_words_ref(logits.float(), [outputs[r] for r in order],
                                   [words[r] for r in order])
    got = bad_gpu.apply(logits.cuda(), idx.cuda(), state_gpu).float().cpu()
    torch.testing.assert_close(got, expected.bfloat16().float())
