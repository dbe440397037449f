"""Chunked prompt logprobs (bounded memory) and their accumulation across steps/preemption."""

import weakref

import pytest
import torch

import mrv2  # noqa: F401  (turns on the interpreter without CUDA)
from mrv2.kernels.logprobs import compute_topk_logprobs_ref
from mrv2.platform import DEVICE
from mrv2.sample.prompt_logprobs import (
    PromptLogprobsAccumulator,
    compute_prompt_logprobs,
    prompt_logprobs_to_output,
)

HIDDEN, VOCAB = 16, 1500
TOL = {"atol": 1e-5, "rtol": 1e-5}


class TinyLMHead:
    """A random linear ``compute_logits`` that records every logits tensor it returns.

    ``max_rows`` is the largest logits buffer allocated; ``max_alive`` the most logits
    tensors alive at once (previous outputs still referenced when a new one is made).
    """

    def __init__(self, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.weight = torch.randn(VOCAB, HIDDEN, generator=g).to(DEVICE)  # [V, H]
        self.rows, self.max_rows, self.max_alive = 0, 0, 0
        self._alive: list[weakref.ref] = []

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        self._alive = [r for r in self._alive if r() is not None]
        logits = hidden @ self.weight.T  # [c, V]
        self._alive.append(weakref.ref(logits))
        self.max_alive = max(self.max_alive, len(self._alive))
        self.rows += logits.shape[0]
        self.max_rows = max(self.max_rows, logits.shape[0])
        return logits


def make_prompt(num_tokens: int, seed: int = 0):
    """Hidden states ``[T, H]`` (a function of the position) and prompt ids ``[T]``."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(num_tokens, HIDDEN, generator=g).to(DEVICE),
            torch.randint(0, VOCAB, (num_tokens,), generator=g).to(DEVICE))


def reference(hidden, prompt, head, k):
    """Unchunked: full [P - 1, V] logits and log_softmax."""
    return compute_topk_logprobs_ref(hidden[:-1] @ head.weight.T, k, prompt[1:])


def assert_rows_equal(got, want):
    # Column 0 (the target) and the ranks are exact; the top-k columns are compared as
    # (id -> logprob) per row, since near-equal logits may come in another order on a GPU.
    assert torch.equal(got[0][:, 0].cpu(), want[0][:, 0].cpu())
    assert torch.equal(got[2].cpu(), want[2].cpu())
    g_ids, w_ids = got[0][:, 1:].cpu(), want[0][:, 1:].cpu()
    g_order, w_order = g_ids.argsort(dim=1), w_ids.argsort(dim=1)
    assert torch.equal(g_ids.gather(1, g_order), w_ids.gather(1, w_order))
    torch.testing.assert_close(got[1][:, 0].cpu(), want[1][:, 0].cpu(), **TOL)
    torch.testing.assert_close(got[1][:, 1:].cpu().gather(1, g_order),
                               want[1][:, 1:].cpu().gather(1, w_order), **TOL)


def assert_same_output(got, want):
    """Equal vLLM PromptLogprobs: same keys in the same order and ranks; logprobs to 1e-5.

    (The LM head's matmul may round differently for a different number of rows.)
    """
    assert len(got) == len(want) and got[0] is None and want[0] is None
    for g, w in zip(got[1:], want[1:]):
        assert list(g) == list(w)
        for tok in g:
            assert g[tok].rank == w[tok].rank and g[tok].decoded_token == w[tok].decoded_token
            assert g[tok].logprob == pytest.approx(w[tok].logprob, abs=1e-5)


@pytest.fixture(scope="module")
def long_prompt():
    hidden, prompt = make_prompt(3000)
    head = TinyLMHead()
    got = compute_prompt_logprobs(hidden[:-1], prompt[1:], head, 5, chunk_size=256)
    return hidden, prompt, head, got


def test_long_prompt_chunked_equals_unchunked(long_prompt):
    hidden, prompt, _, got = long_prompt
    assert got[0].shape == (2999, 6) and got[2].shape == (2999,)
    assert_rows_equal(got, reference(hidden, prompt, TinyLMHead(), 5))


def test_logits_memory_is_one_chunk_whatever_the_prompt_length(long_prompt):
    # The 3,000-token prompt, and a 600-token one: the largest logits buffer is
    # chunk_size x V in both, and no earlier chunk's logits are still alive.
    *_, head_long, _ = long_prompt
    hidden, prompt = make_prompt(600, seed=1)
    head_short = TinyLMHead()
    compute_prompt_logprobs(hidden[:-1], prompt[1:], head_short, 0, chunk_size=256)
    for head, num_rows in ((head_long, 2999), (head_short, 599)):
        assert head.rows == num_rows
        assert head.max_rows * VOCAB == 256 * VOCAB
        assert head.max_alive == 1


@pytest.mark.parametrize("num_logprobs", [0, 1, 20, -1])
def test_chunk_edges_and_k(num_logprobs):
    hidden, prompt = make_prompt(70, seed=2)
    head = TinyLMHead()
    got = compute_prompt_logprobs(hidden[:-1], prompt[1:], head, num_logprobs, chunk_size=32)
    k = VOCAB if num_logprobs == -1 else num_logprobs
    assert_rows_equal(got, reference(hidden, prompt, head, k))


def test_empty_prompt_rows():
    ids, lps, ranks = compute_prompt_logprobs(torch.zeros(0, HIDDEN, device=DEVICE),
                                              torch.zeros(0, dtype=torch.int64, device=DEVICE),
                                              TinyLMHead(), 3)
    assert ids.shape == (0, 4) and lps.shape == (0, 4) and ranks.shape == (0,)


def test_output_format():
    hidden, prompt = make_prompt(5, seed=3)
    head = TinyLMHead()
    out = prompt_logprobs_to_output(*reference(hidden, prompt, head, 2), 2, detok=str)
    assert len(out) == 5 and out[0] is None
    logp = torch.log_softmax(hidden[:-1] @ head.weight.T, -1)  # [4, V]
    for p in range(1, 5):
        tok = int(prompt[p])
        assert tok in out[p] and 2 <= len(out[p]) <= 3
        assert out[p][tok].logprob == pytest.approx(float(logp[p - 1, tok]), abs=1e-5)
        assert out[p][tok].decoded_token == str(tok)


# --- the accumulator ----------------------------------------------------------------

P, K = 200, 3


def run_steps(acc, req_id, hidden, steps, explicit=False, start=0):
    """Feed the step sizes in ``steps`` from position ``start`` (hidden is per position)."""
    pos = start
    for n in steps:
        acc.add_step(req_id, hidden[pos:pos + n], start_pos=pos if explicit else None)
        pos += n


@pytest.fixture(scope="module")
def one_shot():
    hidden, prompt = make_prompt(P + 10, seed=4)  # P prompt tokens + 10 outputs
    head = TinyLMHead(seed=4)
    rows = compute_prompt_logprobs(hidden[:P - 1], prompt[1:P], head, K)
    return hidden, prompt, head, prompt_logprobs_to_output(*rows, K)


@pytest.mark.parametrize("explicit", [False, True])
def test_accumulator_three_chunked_steps_equal_one_shot(one_shot, explicit):
    hidden, prompt, head, want = one_shot
    head = TinyLMHead(seed=4)
    acc = PromptLogprobsAccumulator(head, chunk_size=64)
    acc.add_request("a", prompt[:P].tolist(), K)
    run_steps(acc, "a", hidden, [70, 70], explicit)
    assert not acc.is_complete("a") and acc.take("a") is None
    # The last chunk holds the prompt's last token (it predicts the first output: no row),
    # then two decode steps past the prompt compute nothing.
    run_steps(acc, "a", hidden, [60, 1, 1], explicit, start=140)
    assert head.rows == P - 1
    assert acc.is_complete("a")
    assert_same_output(acc.take("a"), want)
    assert acc.take("a") is None  # handed out once


def test_accumulator_preempted_mid_prompt(one_shot):
    hidden, prompt, head, want = one_shot
    head = TinyLMHead(seed=4)
    acc = PromptLogprobsAccumulator(head, chunk_size=64)
    acc.add_request("a", prompt[:P].tolist(), K)
    run_steps(acc, "a", hidden, [70, 50])  # positions 0..119, then preempted
    acc.add_request("a", prompt[:P].tolist(), K)  # re-admitted: prefill from 0 again
    run_steps(acc, "a", hidden, [100, 100])
    assert head.rows == P - 1  # nothing recomputed
    assert_same_output(acc.take("a"), want)


def test_accumulator_preempted_after_prompt_with_outputs(one_shot):
    hidden, prompt, head, want = one_shot
    head = TinyLMHead(seed=4)
    acc = PromptLogprobsAccumulator(head, chunk_size=64)
    acc.add_request("a", prompt[:P].tolist(), K)
    run_steps(acc, "a", hidden, [P, 1, 1, 1])  # prompt, then 3 decodes
    got = acc.take("a")
    # Preempted; re-admitted with prompt + 4 outputs as one prefill, in two chunks.
    acc.add_request("a", prompt[:P].tolist(), K)
    run_steps(acc, "a", hidden, [150, P + 4 - 150, 1])
    assert head.rows == P - 1  # no duplicate rows, none for the output tokens
    assert_same_output(got, want)
    assert acc.take("a") is None

    # Preempted before the engine took them: still one copy of every row.
    head2 = TinyLMHead(seed=4)
    acc2 = PromptLogprobsAccumulator(head2, chunk_size=64)
    acc2.add_request("b", prompt[:P].tolist(), K)
    run_steps(acc2, "b", hidden, [P, 1])
    acc2.add_request("b", prompt[:P].tolist(), K)
    run_steps(acc2, "b", hidden, [P + 2])
    assert head2.rows == P - 1
    assert_same_output(acc2.take("b"), want)


def test_accumulator_from_logits_and_edge_cases(one_shot):
    hidden, prompt, head, want = one_shot
    acc = PromptLogprobsAccumulator(lambda h: pytest.fail("no LM head call expected"))
    acc.add_request("a", prompt[:P], K)
    for start, n in ((0, 120), (120, 90)):
        acc.add_step_logits("a", hidden[start:start + n] @ head.weight.T, start_pos=start)
    assert_same_output(acc.take("a"), want)
    # A one-token prompt: complete at once, [None].
    acc.add_request("one", [7], K)
    acc.add_step("one", hidden[:1])
    assert acc.take("one") == [None]
    # A gap (positions never run) is an error, not silently missing rows.
    acc.add_request("gap", prompt[:P], K)
    with pytest.raises(ValueError, match="never run"):
        acc.add_step("gap", hidden[16:32], start_pos=16)
    acc.remove_request("gap")
    assert "gap" not in acc and "a" in acc


@pytest.mark.gpu
def test_gpu_peak_memory_bounded_bf16():
    vocab, hidden_size, chunk = 151_936, 1024, 1024
    lm_head = torch.nn.Linear(hidden_size, vocab, bias=False, device="cuda", dtype=torch.bfloat16)
    peaks = {}
    for num_tokens in (2048, 8192):
        hidden = torch.randn(num_tokens, hidden_size, device="cuda", dtype=torch.bfloat16)
        targets = torch.randint(0, vocab, (num_tokens,), device="cuda")
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with torch.inference_mode():
            got = compute_prompt_logprobs(hidden, targets, lm_head, 5, chunk_size=chunk)
        torch.cuda.synchronize()
        peaks[num_tokens] = torch.cuda.max_memory_allocated() - base
        with torch.inference_mode():  # spot-check the first rows against the fp32 reference
            ref = compute_topk_logprobs_ref(lm_head(hidden[:64]), 5, targets[:64])
        torch.testing.assert_close(got[1][:64], ref[1], atol=1e-4, rtol=1e-5)
        assert torch.equal(got[2][:64], ref[2])
    chunk_logits = chunk * vocab * 2  # one bf16 [chunk, V] buffer
    full_logits = 8192 * vocab * 2
    print(f"peak extra memory: {peaks}, one chunk of logits = {chunk_logits}")
    assert peaks[8192] < 3 * chunk_logits < full_logits
    assert abs(peaks[8192] - peaks[2048]) < 0.1 * chunk_logits
