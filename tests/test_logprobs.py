"""Top-k logprob kernels against a full ``log_softmax``, and vLLM's SampleLogprobs format."""

import pytest
import torch
from device_utils import on_device

import mrv2  # noqa: F401  (turns on the interpreter without CUDA)
from mrv2.kernels.logprobs import (
    compute_topk_logprobs,
    compute_topk_logprobs_ref,
    gather_logprobs,
    gather_logprobs_ref,
    row_logsumexp,
    row_logsumexp_ref,
    token_ranks,
    token_ranks_ref,
)
from mrv2.outputs import Logprob
from mrv2.sample.logprobs import sample_logprobs_to_output

_on_device = on_device


compute_topk_logprobs = _on_device(compute_topk_logprobs)
gather_logprobs = _on_device(gather_logprobs)
row_logsumexp = _on_device(row_logsumexp)
token_ranks = _on_device(token_ranks)


TOL = {"atol": 1e-5, "rtol": 1e-5}


def tie_free_logits(num_rows: int, vocab: int, seed: int = 0) -> torch.Tensor:
    """``[N, V]`` fp32 logits with distinct values in every row (a random permutation)."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.rand(num_rows, vocab, generator=g).argsort(dim=1).float()  # [N, V]
    return perm * (9.0 / vocab) - 4.0 + 0.3 * torch.randn(num_rows, 1, generator=g)


# V not a multiple of the block; several blocks; one block; two vocab splits per row.
SHAPES = [(4, 2500, 1024, None), (3, 1000, None, None), (5, 3000, 1024, 2), (1, 2049, 2048, None)]


@pytest.mark.parametrize("num_rows,vocab,block_v,splits", SHAPES)
def test_logsumexp_gather_and_ranks_match_reference(num_rows, vocab, block_v, splits):
    logits = tie_free_logits(num_rows, vocab)
    kw = {"block_v": block_v, "num_splits": splits}
    lse = row_logsumexp(logits, **kw)  # [N]
    torch.testing.assert_close(lse, row_logsumexp_ref(logits), **TOL)
    ids = torch.randint(0, vocab, (num_rows, 7))  # [N, 7]
    torch.testing.assert_close(gather_logprobs(logits, lse, ids), gather_logprobs_ref(logits, ids),
                               **TOL)
    tok = ids[:, 0]
    assert torch.equal(token_ranks(logits, tok, **kw), token_ranks_ref(logits, tok))


def test_large_offsets_and_all_masked_row():
    # Shift invariance (no overflow of exp), and a row of -inf but one entry.
    logits = tie_free_logits(3, 1500) + torch.tensor([[0.0], [1000.0], [-1000.0]])
    logits[2, :] = float("-inf")
    logits[2, 17] = 3.0
    lse = row_logsumexp(logits, block_v=1024)
    torch.testing.assert_close(lse, row_logsumexp_ref(logits), **TOL)
    assert token_ranks(logits, torch.tensor([0, 0, 17]))[2] == 1


def test_empty_batch():
    logits = torch.zeros(0, 1000)
    ids, lps, ranks = compute_topk_logprobs(logits, 5, torch.zeros(0, dtype=torch.int64))
    assert ids.shape == (0, 6) and lps.shape == (0, 6) and ranks.shape == (0,)
    assert row_logsumexp(logits).shape == (0,)


@pytest.mark.parametrize("num_logprobs", [0, 1, 5, 20])
def test_topk_logprobs_match_reference(num_logprobs):
    num_rows, vocab = 6, 2500
    logits = tie_free_logits(num_rows, vocab, seed=num_logprobs)
    order = logits.argsort(dim=1, descending=True)  # [N, V]
    # Rows 0-2 sample a top-k token (the best, the k-th), rows 3-5 one far outside.
    pick = torch.tensor([0, max(num_logprobs - 1, 0), 0, 30, 700, vocab - 1])
    sampled = order[torch.arange(num_rows), pick]  # [N]
    ids, lps, ranks = compute_topk_logprobs(logits, num_logprobs, sampled, block_v=1024)
    ref_ids, ref_lps, ref_ranks = compute_topk_logprobs_ref(logits, num_logprobs, sampled)
    assert ids.shape == lps.shape == (num_rows, num_logprobs + 1)
    assert torch.equal(ids, ref_ids) and torch.equal(ids[:, 0], sampled)
    torch.testing.assert_close(lps, ref_lps, **TOL)
    assert torch.equal(ranks, ref_ranks) and torch.equal(ranks, pick + 1)


def test_single_row():
    logits = tie_free_logits(1, 1200)
    sampled = logits.argmax(dim=1)
    ids, lps, ranks = compute_topk_logprobs(logits, 3, sampled)
    assert ids[0, 0] == ids[0, 1] == sampled[0] and ranks.tolist() == [1]
    torch.testing.assert_close(lps[0, 0], torch.log_softmax(logits, -1).max(), **TOL)


def test_ties_share_the_best_rank():
    # Convention: rank = 1 + number of STRICTLY larger logits; tied tokens share the best
    # rank of their group (vLLM's kernel counts >= and gives them the worst one).
    logits = torch.zeros(1, 1100)
    logits[0, [5, 9]] = 2.0     # tied best
    logits[0, [1, 2, 3]] = 1.0  # tied third
    tok = torch.tensor([[9], [5], [2], [1000]]).view(-1)
    r = token_ranks(logits.expand(4, -1).contiguous(), tok, block_v=1024)
    assert r.tolist() == [1, 1, 3, 6]
    assert torch.equal(r, token_ranks_ref(logits.expand(4, -1).contiguous(), tok))


def test_no_full_vocab_log_softmax(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("the [N, V] log-probability matrix was built")

    monkeypatch.setattr(torch, "log_softmax", boom)
    monkeypatch.setattr(torch.Tensor, "log_softmax", boom)
    monkeypatch.setattr(torch.nn.functional, "log_softmax", boom)
    compute_topk_logprobs(tie_free_logits(2, 1000), 4, torch.tensor([1, 2]))


def test_bad_num_logprobs():
    with pytest.raises(ValueError, match="num_logprobs"):
        compute_topk_logprobs(torch.zeros(1, 10), 11, torch.tensor([0]))


def test_sample_logprobs_to_output():
    logits = tie_free_logits(2, 1000, seed=3)
    order = logits.argsort(dim=1, descending=True)
    sampled = torch.stack([order[0, 1], order[1, 50]])  # row 0 in the top-3, row 1 outside
    ids, lps, ranks = compute_topk_logprobs(logits, 3, sampled)
    ref = torch.log_softmax(logits, -1)
    out = sample_logprobs_to_output(ids, lps, ranks, 3, detok=lambda t: f"<{t}>")
    # In the top-k: k entries, its rank is its place; outside: k + 1, its true rank.
    assert len(out[0]) == 3 and len(out[1]) == 4
    s0, s1 = int(sampled[0]), int(sampled[1])
    assert list(out[0]) == [s0] + [int(order[0, 0]), int(order[0, 2])]
    assert out[0][s0].rank == 2 and out[1][s1].rank == 51
    assert [out[1][int(t)].rank for t in order[1, :3]] == [1, 2, 3]
    assert out[1][s1].decoded_token == f"<{s1}>"
    assert out[1][s1].logprob == pytest.approx(float(ref[1, s1]), abs=1e-5)
    assert isinstance(out[0][s0], Logprob)
    # Per-row k, and k = 0: the sampled token only, no text without detok.
    per_row = sample_logprobs_to_output(ids, lps, ranks, [0, 1])
    assert list(per_row[0]) == [s0] and per_row[0][s0] == Logprob(float(lps[0, 0]), 2, None)
    assert len(per_row[1]) == 2
    with pytest.raises(ValueError):
        sample_logprobs_to_output(ids, lps, ranks, 4)


@pytest.mark.gpu
def test_gpu_bf16_qwen3_vocab():
    vocab = 151_936
    g = torch.Generator(device="cuda").manual_seed(0)
    for num_rows in (1, 8, 512):  # few rows: the vocab-split path; many: one program per row
        logits = (torch.randn(num_rows, vocab, device="cuda", generator=g) * 4).bfloat16()
        sampled = torch.randint(0, vocab, (num_rows,), device="cuda", generator=g)
        ids, lps, ranks = compute_topk_logprobs(logits, 20, sampled)
        _, ref_lps, ref_ranks = (t.cpu() for t in compute_topk_logprobs_ref(logits, 20, sampled))
        assert torch.equal(ids[:, 0], sampled.cpu())
        # bf16 logits tie often: compare the top-k logprobs by value, ranks exactly.
        torch.testing.assert_close(lps, ref_lps, atol=1e-4, rtol=1e-5)
        assert torch.equal(ranks, ref_ranks)
        torch.testing.assert_close(row_logsumexp(logits), row_logsumexp_ref(logits).cpu(),
                                   atol=1e-4, rtol=1e-5)
