"""The n-gram proposer kernel against its plain-Python reference and hand-worked examples."""

import pytest
import torch

from mrv2.spec_decode.ngram import BLOCK_E, ngram_propose, ngram_propose_ref


def _table(rows: list[list[int]], max_model_len: int = 64):
    token_ids = torch.full((len(rows), max_model_len), 99, dtype=torch.int32)  # junk past L
    for r, x in enumerate(rows):
        token_ids[r, :len(x)] = torch.tensor(x, dtype=torch.int32)
    total_len = torch.tensor([len(x) for x in rows], dtype=torch.int32)
    return token_ids, total_len


def _both(idx, token_ids, total_len, k, lo, hi):
    got = ngram_propose(idx, token_ids, total_len, k, lo, hi)
    ref = ngram_propose_ref(idx, token_ids, total_len, k, lo, hi)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    return got


def test_hand_examples():
    rows = [
        [1, 2, 3, 9, 8, 1, 2, 3],        # suffix 1 2 3 seen at the start -> 9 8 1
        [5, 6, 7, 5, 6, 4, 5, 6],        # 2-gram 5 6: earliest end e=2 -> 7 5 6
        [4, 4, 4, 4],                    # the 3-gram wins: earliest end e=3 -> only 4 follows
        [1, 2, 3, 4],                    # no repeat -> nothing
        [7],                             # one token -> nothing
        [3, 1, 2, 8, 0, 1, 2, 6, 3, 1, 2],   # 3-gram 3 1 2 (e=3) beats 2-gram 1 2
    ]
    token_ids, total_len = _table(rows)
    idx = torch.arange(len(rows), dtype=torch.int32)
    drafts, counts = _both(idx, token_ids, total_len, 3, 2, 3)
    assert drafts.tolist() == [[9, 8, 1], [7, 5, 6], [4, -1, -1], [-1, -1, -1], [-1, -1, -1],
                               [8, 0, 1]]
    assert counts.tolist() == [3, 3, 1, 0, 0, 3]


def test_idx_mapping_and_row_room():
    # Row 1 is near max_model_len = 12: L = 10 leaves room for 1 draft (+ the bonus token).
    # Row 0: the 3-gram 2 1 2 first ends at e=4, and only 2 tokens follow it.
    token_ids, total_len = _table([[1, 2, 1, 2, 1, 2], [1, 2, 3, 1, 2, 3, 1, 2, 3, 1]], 12)
    drafts, counts = _both(torch.tensor([1, 0], dtype=torch.int32), token_ids, total_len, 4, 1, 3)
    assert drafts.tolist() == [[2, -1, -1, -1], [1, 2, -1, -1]] and counts.tolist() == [1, 2]


@pytest.mark.parametrize("k, lo, hi", [(1, 1, 1), (3, 2, 4), (5, 1, 5), (8, 3, 3)])
def test_random_vs_reference(k, lo, hi):
    gen = torch.Generator().manual_seed(k * 10 + hi)
    rows, max_len = 12, 96
    token_ids = torch.randint(0, 3, (rows, max_len), generator=gen, dtype=torch.int32)
    total_len = torch.randint(1, max_len + 1, (rows,), generator=gen, dtype=torch.int32)
    total_len[0], total_len[1] = 1, max_len            # one token; a full row
    idx = torch.randperm(rows, generator=gen)[:9].to(torch.int32)
    _both(idx, token_ids, total_len, k, lo, hi)


def test_block_boundary_and_static_outputs():
    # The only match ends past the first BLOCK_E candidates; outputs go to static buffers.
    length = BLOCK_E + 300
    x = torch.arange(length, dtype=torch.int32) + 10
    x[BLOCK_E + 100:BLOCK_E + 103] = torch.tensor([1, 2, 3])
    x[-3:] = torch.tensor([1, 2, 3])
    token_ids = torch.zeros(2, length + 8, dtype=torch.int32)
    token_ids[1, :length] = x
    total_len = torch.tensor([0, length], dtype=torch.int32)
    out_d = torch.full((4, 3), 7, dtype=torch.int32)
    out_n = torch.full((4,), 7, dtype=torch.int32)
    d, n = ngram_propose(torch.tensor([1], dtype=torch.int32), token_ids, total_len, 3, 2, 3,
                         draft_token_ids=out_d, num_draft_tokens=out_n)
    assert d.tolist() == [x[BLOCK_E + 103:BLOCK_E + 106].tolist()] and n.tolist() == [3]
    assert out_d[0].tolist() == d[0].tolist() and out_d[1].tolist() == [7, 7, 7]
    ref = ngram_propose_ref(torch.tensor([1], dtype=torch.int32), token_ids, total_len, 3, 2, 3)
    assert torch.equal(d, ref[0])


def test_empty_batch_and_bad_args():
    token_ids, total_len = _table([[1, 1]])
    d, n = ngram_propose(torch.zeros(0, dtype=torch.int32), token_ids, total_len, 2, 1, 2)
    assert d.shape == (0, 2) and n.shape == (0,)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        ngram_propose(torch.zeros(1, dtype=torch.int32), token_ids, total_len, 0, 1, 2)
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        ngram_propose(torch.zeros(1, dtype=torch.int32), token_ids, total_len, 2, 3, 2)
