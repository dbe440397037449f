"""GPU-native input prep: prepare_inputs / post_update vs references, and whole steps
of a scheduler-like loop through prepare_input_batch against a pure-Python model."""

import math
import random

import pytest
import torch

from mrv2.block_table import BlockTables
from mrv2.input_batch import InputBuffers, prepare_input_batch
from mrv2.kernels.input_prep import post_update, post_update_ref, prepare_inputs, prepare_inputs_ref
from mrv2.platform import DEVICE
from mrv2.state import RequestStateTable

i32 = torch.int32


def _random_state(g, R, L):
    state = RequestStateTable(R, L, DEVICE)
    state.token_ids.copy_(torch.randint(1, 1000, (R, L), generator=g, dtype=i32))
    state.total_len.copy_(torch.randint(1, L + 1, (R,), generator=g, dtype=i32))
    state.num_computed_tokens.copy_(
        (torch.rand(R, generator=g) * state.total_len.cpu()).to(i32))   # < total_len
    return state


def _run_prepare(state, idx, counts, num_reqs, T_pad):
    B_pad = idx.shape[0]
    sizes = {"query_start_loc": B_pad + 3, "seq_lens": B_pad + 2, "input_ids": T_pad + 2,
             "positions": T_pad + 2, "logits_indices": B_pad + 2}   # 2 spare: must stay -9
    out = {name: torch.full((n,), -9, dtype=i32, device=DEVICE) for name, n in sizes.items()}
    prepare_inputs(idx, counts, num_reqs, T_pad, state, **out)
    return out


@pytest.mark.parametrize("seed,num_reqs,pad_reqs,pad_tokens",
                         [(0, 0, 0, 0), (1, 0, 3, 4), (2, 1, 0, 0), (3, 5, 3, 6),
                          (4, 8, 0, 2), (5, 7, 1, 0)])
def test_prepare_inputs_matches_reference(seed, num_reqs, pad_reqs, pad_tokens):
    g = torch.Generator().manual_seed(seed)
    R, L = 8, 20
    state = _random_state(g, R, L)
    if num_reqs == 1:  # one token: a decode at the very last position of the row
        state.total_len.fill_(L), state.num_computed_tokens.fill_(L - 1)
    rows = torch.randperm(R, generator=g)[:num_reqs].to(i32)
    remaining = (state.total_len[rows.long()] - state.num_computed_tokens[rows.long()]).cpu()
    counts = (torch.rand(num_reqs, generator=g) * remaining).to(i32) + 1   # mixed chunks
    idx = torch.cat([rows, torch.full((pad_reqs,), 4321, dtype=i32)])      # don't-care
    counts = torch.cat([counts, torch.full((pad_reqs,), 55, dtype=i32)])   # don't-care
    T_pad = int(counts[:num_reqs].sum()) + pad_tokens
    idx, counts = idx.to(DEVICE), counts.to(DEVICE)
    out = _run_prepare(state, idx, counts, num_reqs, T_pad)
    out = {name: t.cpu() for name, t in out.items()}
    ref = prepare_inputs_ref(idx, counts, num_reqs, T_pad, state.token_ids,
                             state.num_computed_tokens)
    B_pad = num_reqs + pad_reqs
    torch.testing.assert_close(out["query_start_loc"][:B_pad + 1], ref.query_start_loc)
    torch.testing.assert_close(out["seq_lens"][:B_pad], ref.seq_lens)
    torch.testing.assert_close(out["logits_indices"][:B_pad], ref.logits_indices)
    torch.testing.assert_close(out["input_ids"][:T_pad], ref.input_ids)
    torch.testing.assert_close(out["positions"][:T_pad], ref.positions)
    for name in out:                       # nothing past the padded sizes was written
        extra = {"query_start_loc": B_pad + 1, "seq_lens": B_pad,
                 "logits_indices": B_pad}.get(name, T_pad)
        assert (out[name][extra:] == -9).all(), name
    if num_reqs == 1:
        assert out["input_ids"][0] == state.token_ids[idx[0], L - 1]
        assert out["positions"][0] == L - 1 and out["seq_lens"][0] == L


@pytest.mark.parametrize("seed", [0, 1])
def test_post_update_matches_reference(seed):
    g = torch.Generator().manual_seed(seed)
    R, L, B = 8, 12, 6
    state = _random_state(g, R, L)
    state.total_len[:2] = L                          # full rows: nothing to append
    state.num_computed_tokens[:2] = L - 1
    rows = torch.cat([torch.tensor([0, 1]), 2 + torch.randperm(R - 2, generator=g)])[:B]
    remaining = (state.total_len[rows] - state.num_computed_tokens[rows]).cpu()
    # Some chunks end exactly at total_len (append), some stop short (partial prefill).
    counts = torch.where(torch.rand(B, generator=g) < 0.5, remaining,
                         (torch.rand(B, generator=g) * remaining).to(i32).clamp(min=1))
    idx = torch.cat([rows.to(i32), torch.tensor([3, 3], dtype=i32)])      # 2 padding slots
    counts = torch.cat([counts.to(i32), torch.tensor([9, 9], dtype=i32)])
    sampled = torch.randint(0, 1000, (B + 2,), generator=g)               # int64 is fine
    idx, counts, sampled = idx.to(DEVICE), counts.to(DEVICE), sampled.to(DEVICE)
    names = ("token_ids", "num_computed_tokens", "total_len", "last_sampled_token")
    ref = {n: getattr(state, n).clone() for n in names}
    post_update(idx, counts, sampled, B, state)
    post_update_ref(idx, counts, sampled, B, *(ref[n] for n in names))
    for n in names:
        torch.testing.assert_close(getattr(state, n), ref[n], msg=n)
    assert state.total_len[:2].tolist() == [L, L]    # guarded at max_model_len
    post_update(idx, counts, sampled, 0, state)      # empty batch: a no-op


class _Req:
    def __init__(self, req_id, tokens, prompt_len):
        self.req_id, self.tokens, self.prompt_len = req_id, list(tokens), prompt_len
        self.num_computed, self.blocks, self.row, self.last_sampled = 0, [], -1, -1


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_steps_against_python_model(seed):
    """A scheduler-like loop (add / chunked prefill / decode / finish / preempt) with
    padding: every step's InputBatch and the table after post_update equal the model."""
    rng = random.Random(seed)
    R, L, bs, budget = 6, 24, 4, 20
    C = math.ceil(L / bs)
    state, bt = RequestStateTable(R, L, DEVICE), BlockTables(R, C, bs, budget + 8, DEVICE)
    buffers = InputBuffers(R, budget + 8, DEVICE)
    live: dict[str, _Req] = {}
    next_block, next_id = 0, 0

    def admit(req):  # new, or preempted and re-entering with prompt + output to prefill
        req.row = state.add_request(req.req_id, req.tokens, req.prompt_len)
        req.num_computed, req.blocks, req.last_sampled = 0, [], -1
        bt.append_block_ids(req.row, [], overwrite=True)
        live[req.req_id] = req

    for step in range(20):
        # New requests, finishes and preemptions (the CPU only writes).
        while state.num_free_rows and rng.random() < 0.6:
            n = rng.randint(1, L - 2)
            admit(_Req(f"r{next_id}", [rng.randrange(1, 500) for _ in range(n)],
                       rng.randint(1, n)))
            next_id += 1
        for req in list(live.values()):
            done = len(req.tokens) >= L and req.num_computed >= len(req.tokens)
            if done or rng.random() < 0.08:
                state.remove_request(req.req_id), bt.clear_row(req.row), live.pop(req.req_id)
            elif rng.random() < 0.08:                        # preempt: re-enter as new
                state.remove_request(req.req_id), bt.clear_row(req.row)
                admit(req)
        # Schedule: each request a chunk of its unknown-to-the-cache tokens, in budget.
        sched, left = [], budget
        for req in rng.sample(list(live.values()), len(live)):
            todo = len(req.tokens) - req.num_computed
            if todo <= 0 or left == 0:
                continue
            n = min(rng.randint(1, todo), left)
            left -= n
            need = math.ceil((req.num_computed + n) / bs) - len(req.blocks)
            new = list(range(next_block, next_block + need))
            next_block += need
            bt.append_block_ids(req.row, new, overwrite=False)
            req.blocks += new
            sched.append((req, n))
        B_pad = len(sched) + rng.randint(0, R - len(sched))
        T = sum(n for _, n in sched)
        T_pad = T + rng.randint(0, 8)
        max_q = max([n for _, n in sched], default=0)
        batch = prepare_input_batch(
            buffers, state, bt, [r.req_id for r, _ in sched], [r.row for r, _ in sched],
            [n for _, n in sched], max_q, L, num_reqs_padded=B_pad, num_tokens_padded=T_pad)

        # The model's view of the same step.
        ids, pos, slots, qsl, seq_lens, logits = [], [], [], [0], [], []
        for req, n in sched:
            for p in range(req.num_computed, req.num_computed + n):
                ids.append(req.tokens[p]), pos.append(p)
                slots.append(req.blocks[p // bs] * bs + p % bs)
            qsl.append(qsl[-1] + n), seq_lens.append(req.num_computed + n)
            logits.append(qsl[-1] - 1)
        pad_b, pad_t = B_pad - len(sched), T_pad - T
        assert batch.input_ids.tolist() == ids + [0] * pad_t
        assert batch.positions.tolist() == pos + [0] * pad_t
        assert batch.slot_mapping.tolist() == slots + [-1] * pad_t
        assert batch.query_start_loc.tolist() == qsl + [T] * pad_b
        assert batch.seq_lens.tolist() == seq_lens + [0] * pad_b
        assert batch.logits_indices.tolist()[:len(sched)] == logits
        gathered = batch.block_table.tolist()                # [B_pad, C]
        for b, (req, _) in enumerate(sched):
            assert gathered[b][:len(req.blocks)] == req.blocks
        assert all(x == 0 for row in gathered[len(sched):] for x in row)
        md = batch.attn_metadata
        assert md.num_reqs == B_pad and md.slot_mapping is batch.slot_mapping
        assert md.block_table.shape == (B_pad, C) and md.query_start_loc.shape == (B_pad + 1,)

        # Sample, then update the table on the device; mirror it in the model.
        sampled = torch.randint(1, 500, (B_pad,), dtype=i32).to(DEVICE)
        post_update(batch.idx_mapping, batch.num_scheduled_tokens, sampled, len(sched), state)
        for b, (req, n) in enumerate(sched):
            req.num_computed += n
            if req.num_computed >= len(req.tokens) and len(req.tokens) < L:
                req.tokens.append(int(sampled[b]))
                req.last_sampled = int(sampled[b])
        for req in live.values():
            assert state.num_computed_tokens[req.row] == req.num_computed
            assert state.total_len[req.row] == len(req.tokens)
            assert state.token_ids[req.row, :len(req.tokens)].tolist() == req.tokens
            assert state.last_sampled_token[req.row] == req.last_sampled
    assert next_id > R
