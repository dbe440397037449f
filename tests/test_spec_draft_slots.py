"""Draft slots and the post-update of accepted tokens: kernels vs references, and the
round trip drafts -> token buffer -> prepare_inputs -> verify -> spec_post_update."""

from types import SimpleNamespace

import torch

from mrv2.kernels.input_prep import prepare_inputs_ref
from mrv2.spec_decode.draft_slots import (
    spec_post_update,
    spec_post_update_ref,
    write_draft_slots,
    write_draft_slots_ref,
)


def _state(rows=5, max_model_len=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    total = torch.randint(1, max_model_len, (rows,), generator=gen, dtype=torch.int32)
    total[0] = max_model_len - 1                          # a row one short of full
    return SimpleNamespace(
        token_ids=torch.randint(0, 50, (rows, max_model_len), generator=gen, dtype=torch.int32),
        total_len=total, num_computed_tokens=(total - 1).clone(),
        last_sampled_token=torch.full((rows,), -1, dtype=torch.int32))


def _clone(st):
    return SimpleNamespace(**{k: v.clone() for k, v in vars(st).items()})


def test_write_draft_slots_vs_reference_and_prepare_inputs():
    st = _state()
    idx = torch.tensor([3, 0, 1], dtype=torch.int32)
    drafts = torch.tensor([[7, 8, 9], [4, 5, -1], [-1, -1, -1]], dtype=torch.int32)
    ref = _clone(st)
    write_draft_slots(idx, drafts, 3, st)
    write_draft_slots_ref(idx, drafts, 3, ref.token_ids, ref.total_len)
    assert torch.equal(st.token_ids, ref.token_ids)
    assert torch.equal(st.total_len, ref.total_len)       # drafts are scratch past total_len
    # The unchanged prep reads [last token, d_1 .. d_K] for a 1 + K query (row 3 has room).
    n_sched = torch.tensor([4, 1, 4], dtype=torch.int32)
    prep = prepare_inputs_ref(idx, n_sched, 3, 9, st.token_ids, st.num_computed_tokens)
    last = int(st.token_ids[3, int(st.total_len[3]) - 1])
    assert prep.input_ids[:4].tolist() == [last, 7, 8, 9]
    last1 = int(st.token_ids[1, int(st.total_len[1]) - 1])
    assert prep.input_ids[5:9].tolist() == [last1, 0, 0, 0]  # no drafts: placeholder ids


def test_spec_post_update_vs_reference():
    st = _state(rows=6, seed=1)
    st.num_computed_tokens[4] = 2                         # row 4: a prefill chunk in flight
    st.total_len[1], st.num_computed_tokens[1] = 5, 4     # row 1: room for 4 more
    idx = torch.tensor([1, 2, 3, 4, 0, 5], dtype=torch.int32)
    k = 3
    n_sched = torch.tensor([1 + k, 1 + k, 1, 2, 1 + k, 1 + k], dtype=torch.int32)
    n_draft = torch.tensor([k, k, 0, 0, k, k], dtype=torch.int32)
    out = torch.tensor([[11, 12, 13, 14], [21, -1, -1, -1], [31, -1, -1, -1],
                        [41, -1, -1, -1], [51, 52, -1, -1], [61, 62, -1, -1]], dtype=torch.int32)
    n_out = torch.tensor([4, 1, 1, 1, 2, 2], dtype=torch.int32)
    before = _clone(st)
    ref = _clone(st)
    spec_post_update(idx, n_sched, n_draft, out, n_out, 6, st)
    spec_post_update_ref(idx, n_sched, n_draft, out, n_out, 6, ref.token_ids,
                         ref.num_computed_tokens, ref.total_len, ref.last_sampled_token)
    for name in vars(st):
        assert torch.equal(getattr(st, name), getattr(ref, name)), name
    # Slot 0 (row 1): all 3 drafts accepted + bonus -> 4 tokens; computed advances by 1 + 3.
    assert st.total_len[1] == 9 and st.num_computed_tokens[1] == 8
    assert st.token_ids[1, 5:9].tolist() == [11, 12, 13, 14] and st.last_sampled_token[1] == 14
    # Slot 3 (row 4): the chunk did not reach the end: nothing appended.
    assert st.total_len[4] == before.total_len[4] and st.last_sampled_token[4] == -1
    # Slot 4 (row 0, one short of full): only one of the two tokens fits.
    assert st.total_len[0] == 16 and st.token_ids[0, 15] == 51 and st.last_sampled_token[0] == 51


def test_empty_batch_is_a_no_op():
    st = _state()
    before = _clone(st)
    z = torch.zeros(0, dtype=torch.int32)
    write_draft_slots(z, torch.zeros(0, 2, dtype=torch.int32), 0, st)
    spec_post_update(z, z, z, torch.zeros(0, 3, dtype=torch.int32), z, 0, st)
    for name in vars(st):
        assert torch.equal(getattr(st, name), getattr(before, name))
