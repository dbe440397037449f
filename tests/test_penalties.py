"""Penalties: staged histories, per-step counts and the penalty kernel vs plain torch."""

import random

import torch

from mrv2.kernels.input_prep import post_update
from mrv2.kernels.penalties import (
    apply_penalties_ref,
    apply_penalty_writes_ref,
    update_output_counts,
    update_output_counts_ref,
)
from mrv2.platform import DEVICE
from mrv2.sample.penalties import PenaltyState
from mrv2.state import RequestStateTable

V = 300


def _i32(x):
    return torch.tensor(x, dtype=torch.int32, device=DEVICE)


def _history_penalties(logits: list[float], prompt: list[int], output: list[int], rep: float,
                       pres: float, freq: float) -> list[float]:
    """vLLM's semantics from token lists, one row, plain Python."""
    out = list(logits)
    seen = set(prompt) | set(output)
    for t in range(len(out)):
        if t in seen:
            out[t] = out[t] / rep if out[t] > 0 else out[t] * rep
        c = output.count(t)
        out[t] -= freq * c + pres * (c > 0)
    return out


def test_staged_writes_match_reference_and_readmission():
    rng = random.Random(0)
    ps = PenaltyState(5, V, DEVICE)
    ps.prompt_mask.fill_(1)          # a previous owner's garbage must be cleared
    ps.output_counts.fill_(7)
    staged = []
    for row in (0, 2, 3, 4):
        prompt = [rng.randrange(V) for _ in range(rng.randint(1, 40))]
        output = [rng.randrange(8) for _ in range(rng.randint(0, 30))]  # many duplicates
        ps.add_request(row, prompt, output)
        staged.append((row, prompt, output))
    ps.add_request(1, [1, 2, 3])
    ps.remove_request(1)             # added and removed in one step: never written
    ps.apply_staged_writes()
    assert not ps.has_staged_writes
    mask = torch.ones(5, V, dtype=torch.int8)
    counts = torch.full((5, V), 7, dtype=torch.int32)
    apply_penalty_writes_ref(staged, mask, counts)
    torch.testing.assert_close(ps.prompt_mask.cpu(), mask)
    torch.testing.assert_close(ps.output_counts.cpu(), counts)


def test_update_counts_follows_post_update_rule():
    rng = random.Random(1)
    R, L = 6, 12
    table = RequestStateTable(R, L, DEVICE)
    for r in range(R):
        n = [12, 5, 5, 8, 3, 12][r]   # rows 0 and 5 are full: no room to append
        table.add_request(f"r{r}", [rng.randrange(V) for _ in range(n)], 1)
    table.apply_staged_writes()
    # slot -> row; scheduled counts: full prefill, partial chunk (one short), decode-like.
    idx = _i32([3, 1, 2, 0, 5, 4])
    sched = _i32([8, 4, 5, 12, 11, 3])
    sampled = torch.tensor([rng.randrange(V) for _ in range(6)], device=DEVICE)
    counts = torch.zeros(R, V, dtype=torch.int32, device=DEVICE)
    expect = counts.cpu().clone()
    update_output_counts_ref(idx.cpu(), sched.cpu(), sampled.cpu(), 5, table.num_computed_tokens.cpu(),
                             table.total_len.cpu(), L, expect)
    update_output_counts(idx, sched, sampled, 5, table, counts)
    torch.testing.assert_close(counts.cpu(), expect)
    # Slot 0 (row 3) and slot 2 (row 2) append; row 1 is one short; row 0 is full;
    # slot 5 is past num_reqs.
    assert int(expect.sum()) == 2


def test_apply_matches_reference_and_history_semantics():
    rng = random.Random(2)
    R, B = 6, 5
    ps = PenaltyState(R, V, DEVICE)
    table = RequestStateTable(R, 4, DEVICE)
    hist = {}
    for row in range(R):
        prompt = [rng.randrange(V) for _ in range(rng.randint(1, 30))]
        output = [rng.randrange(40) for _ in range(rng.randint(0, 30))]
        ps.add_request(row, prompt, output)
        hist[row] = (prompt, output)
    ps.apply_staged_writes()
    params = [(1.0, 0.0, 0.0), (1.3, 0.5, 0.2), (0.7, -0.4, 1.1), (2.0, 0.0, 0.0),
              (1.0, 1.5, -0.5), (1.1, 0.1, 0.1)]
    for row, (rep, pres, freq) in enumerate(params):
        table.repetition_penalty[row], table.presence_penalty[row] = rep, pres
        table.frequency_penalty[row] = freq
    idx = _i32([0, 4, 2, 1, 3, 5])   # padded: slot 5 is past B
    logits = torch.randn(B, V, device=DEVICE) * 3
    expect = apply_penalties_ref(logits, idx, ps.prompt_mask, ps.output_counts,
                                 table.repetition_penalty, table.presence_penalty,
                                 table.frequency_penalty)
    got = ps.apply(logits.clone(), idx, table)
    torch.testing.assert_close(got, expect)
    assert torch.equal(got[0], logits[0])    # neutral row: untouched, bit for bit
    for b in range(B):
        row = int(idx[b])
        want = _history_penalties(logits[b].tolist(), *hist[row], *params[row])
        torch.testing.assert_close(got[b].cpu(), torch.tensor(want), rtol=1e-5, atol=1e-5)


def test_counts_track_the_state_table_over_steps():
    """Counts equal a bincount of token_ids[prompt_len:total_len] after every step."""
    rng = random.Random(3)
    R, L = 4, 40
    table = RequestStateTable(R, L, DEVICE)
    ps = PenaltyState(R, V, DEVICE)
    rows = []
    for i in range(R):
        prompt = [rng.randrange(V) for _ in range(rng.randint(2, 9))]
        earlier = [rng.randrange(V) for _ in range(rng.randint(0, 4))]   # re-admitted
        row = table.add_request(f"r{i}", prompt + earlier, len(prompt))
        ps.add_request(row, prompt, earlier)
        rows.append(row)
    table.apply_staged_writes()
    ps.apply_staged_writes()
    for step in range(6):
        idx = _i32(rows)
        # Chunked prefill: 3 tokens a step until caught up, then 1.
        left = (table.total_len - table.num_computed_tokens).cpu()[rows]
        sched = _i32([min(3, int(n)) for n in left])
        sampled = torch.randint(0, 12, (R,), device=DEVICE)   # small range: repeats
        ps.update(idx, sched, sampled, R, table)
        post_update(idx, sched, sampled, R, table)
        for row in rows:
            plen, total = int(table.prompt_len[row]), int(table.total_len[row])
            want = torch.bincount(table.token_ids[row, plen:total].long().cpu(), minlength=V)
            assert torch.equal(ps.output_counts[row].cpu().long(), want), (step, row)
