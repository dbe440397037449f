"""``exact_accept_rows`` (mrv2/spec_decode/accept_rows.py) against its torch reference and
against the ops it replaced (gather, mask, ``exact_accept``, draft count)."""

import pytest
import torch

from mrv2.spec_decode.accept_rows import exact_accept_rows, exact_accept_rows_ref
from mrv2.spec_decode.verify import exact_accept


def _case(num_reqs, k, num_rows_table=9, seed=0, vocab=3):
    g = torch.Generator().manual_seed(seed)
    # A small vocabulary: drafts often match the target, so every run length occurs.
    table = torch.randint(-1, vocab, (num_rows_table, k), generator=g, dtype=torch.int32)
    idx_mapping = torch.randperm(num_rows_table, generator=g)[:num_reqs].to(torch.int32)
    k_b = torch.randint(0, k + 1, (num_reqs,), generator=g, dtype=torch.int32)
    width = 1 + k_b.long()
    row_start = torch.cumsum(width, 0) - width
    gather = row_start[:, None] + torch.minimum(torch.arange(k + 1)[None, :], k_b.long()[:, None])
    sampled = torch.randint(0, vocab, (int(width.sum()),), generator=g, dtype=torch.int64)
    return table, idx_mapping, sampled, gather, k_b


@pytest.mark.parametrize("num_reqs,k,seed", [(0, 3, 0), (1, 1, 1), (1, 3, 2), (5, 3, 3),
                                             (7, 4, 4), (300, 3, 5), (9, 5, 6)])
def test_matches_reference_and_old_path(num_reqs, k, seed):
    table, idx, sampled, gather, k_b = _case(num_reqs, k, num_rows_table=max(9, num_reqs),
                                             seed=seed)
    got = exact_accept_rows(table, idx, sampled, gather, k_b)
    want = exact_accept_rows_ref(table, idx, sampled, gather, k_b)
    for g_, w_ in zip(got, want):
        assert torch.equal(g_, w_)
    # The previous eager path: gather the drafts, exact_accept, count the drafts.
    drafts = table[idx.long()]
    old = exact_accept(drafts, sampled[gather], k_b)
    assert torch.equal(got.output_token_ids, old.output_token_ids)
    assert torch.equal(got.num_output_tokens, old.num_output_tokens)
    assert torch.equal(got.num_accepted, old.num_accepted)
    slots = torch.arange(k)
    count = ((drafts >= 0) & (slots[None, :] < k_b[:, None])).sum(1)
    assert torch.equal(got.num_draft_tokens.long(), count)


def test_all_accepted_takes_the_bonus_and_no_spec_takes_the_sample():
    table = torch.tensor([[5, 6, 7], [1, 2, 3]], dtype=torch.int32)
    idx = torch.tensor([1, 0], dtype=torch.int32)
    k_b = torch.tensor([3, 0], dtype=torch.int32)
    sampled = torch.tensor([1, 2, 3, 9, 4])                     # rows 0-3: request 0; 4: 1
    gather = torch.tensor([[0, 1, 2, 3], [4, 4, 4, 4]])
    out = exact_accept_rows(table, idx, sampled, gather, k_b)
    assert out.output_token_ids.tolist() == [[1, 2, 3, 9], [4, -1, -1, -1]]
    assert out.num_output_tokens.tolist() == [4, 1]
    assert out.num_accepted.tolist() == [3, 0]
    assert out.num_draft_tokens.tolist() == [3, 0]


def test_minus_one_draft_is_never_accepted_even_if_it_equals_the_sample():
    table = torch.tensor([[-1, 2]], dtype=torch.int32)
    out = exact_accept_rows(table, torch.tensor([0], dtype=torch.int32),
                            torch.tensor([-1, 2, 3]), torch.tensor([[0, 1, 2]]),
                            torch.tensor([2], dtype=torch.int32))
    assert out.output_token_ids.tolist() == [[-1, -1, -1]]  # position 0: the sample
    assert out.num_accepted.tolist() == [0] and out.num_draft_tokens.tolist() == [1]


@pytest.mark.parametrize("field,kw", [
    ("gather", {"gather": torch.zeros(2, 3, dtype=torch.int64)}),
    ("num_spec_tokens", {"num_spec_tokens": torch.zeros(3, dtype=torch.int32)}),
    ("draft_token_ids", {"draft_token_ids": torch.zeros(4, dtype=torch.int32)}),
    ("sampled", {"sampled": torch.zeros(2, 2, dtype=torch.int64)})])
def test_bad_shapes_name_the_field(field, kw):
    args = {"draft_token_ids": torch.zeros(4, 3, dtype=torch.int32),
            "idx_mapping": torch.zeros(2, dtype=torch.int32),
            "sampled": torch.zeros(8, dtype=torch.int64),
            "gather": torch.zeros(2, 4, dtype=torch.int64),
            "num_spec_tokens": torch.zeros(2, dtype=torch.int32)}
    args.update(kw)
    with pytest.raises(ValueError, match=field):
        exact_accept_rows(**args)


def test_outputs_are_contiguous():
    """Kernels downstream (spec_post_update) read the outputs as flat arrays."""
    table, idx, sampled, gather, k_b = _case(4, 3)
    for t in exact_accept_rows(table, idx, sampled, gather, k_b):
        assert t.is_contiguous()
