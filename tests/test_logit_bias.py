"""logit_bias / allowed_token_ids / min_tokens: the kernel vs a plain torch reference."""

import random

import pytest
import torch

from mrv2.platform import DEVICE
from mrv2.sample.logit_bias import LogitBiasState, apply_logit_bias_ref
from mrv2.sampling_params import SamplingParams
from mrv2.state import RequestStateTable

V = 200


def _random_params(rng: random.Random) -> SamplingParams:
    kind = rng.randrange(5)
    sp = SamplingParams(max_tokens=None)
    if kind in (1, 4):
        sp.logit_bias = {rng.randrange(V): rng.uniform(-5, 5) for _ in range(rng.randint(1, 90))}
    if kind in (2, 4):
        sp.allowed_token_ids = [rng.randrange(V) for _ in range(rng.randint(1, 60))]
    if kind in (3, 4):
        sp.min_tokens = rng.randint(1, 6)
        sp.all_stop_token_ids = {rng.randrange(V) for _ in range(rng.randint(1, 5))}
    return sp


def test_kernel_matches_reference():
    rng = random.Random(0)
    R = 8
    table = RequestStateTable(R, 32, DEVICE)
    lb = LogitBiasState(R, V, DEVICE, max_logit_bias=100)
    # Every row first belongs to a request with all three rules: the new owners below
    # must not inherit them (a rule-less owner only gets its header zeroed).
    every_rule = SamplingParams(max_tokens=None, logit_bias={3: 9.0}, allowed_token_ids=[3, 4],
                                min_tokens=5)
    every_rule.all_stop_token_ids = {4}
    for row in range(R):
        lb.add_request(row, every_rule)
    lb.apply_staged_writes()
    for row in range(R):
        lb.remove_request(row)
    params, num_output = {}, {}
    for i in range(R):
        sp = _random_params(rng)
        plen, n_out = rng.randint(1, 10), rng.randint(0, 8)
        row = table.add_request(f"r{i}", [rng.randrange(V) for _ in range(plen + n_out)], plen)
        lb.add_request(row, sp)
        params[row], num_output[row] = sp, n_out
    table.apply_staged_writes()
    lb.apply_staged_writes()
    assert not lb.has_staged_writes
    rows = [5, 0, 7, 2, 3, 6, 1]
    idx = torch.tensor(rows + [4], dtype=torch.int32, device=DEVICE)  # padded past B
    logits = torch.randn(len(rows), V, device=DEVICE)
    expect = apply_logit_bias_ref(logits, rows, params, num_output)
    got = lb.apply(logits.clone(), idx, table)
    torch.testing.assert_close(got, expect)
    for b, row in enumerate(rows):
        if not lb.row_active[row]:
            assert torch.equal(got[b], logits[b])


def test_rule_less_rows_write_nothing_or_only_their_header():
    """A request without rules stages nothing on a clean row, and only a header reset on a
    row whose previous owner had rules; either way the kernel leaves its logits alone."""
    table = RequestStateTable(2, 16, DEVICE)
    lb = LogitBiasState(2, V, DEVICE)
    plain = SamplingParams(max_tokens=None)
    lb.add_request(0, plain)
    assert not lb.has_staged_writes and not lb.row_active[0]   # clean row: nothing to write
    ruled = SamplingParams(max_tokens=None, logit_bias={7: -100.0})
    lb.add_request(1, ruled)
    lb.apply_staged_writes()
    assert lb.ints[1, 0].item() == 1                             # one bias entry
    lb.remove_request(1)
    lb.add_request(1, plain)                                     # a rule-less new owner
    assert lb._staged == {1: None}                               # header reset only
    lb.apply_staged_writes()
    assert lb.ints[1, :4].tolist() == [0, 0, 0, 0]
    assert lb.ints[1, 4].item() == 7                             # the rest is never read
    for row in (0, 1):
        table.add_request(f"r{row}", [1, 2], 2)
    table.apply_staged_writes()
    lb.add_request(0, ruled)                                     # a batch with a rule somewhere
    lb.apply_staged_writes()
    logits = torch.randn(2, V, device=DEVICE)
    got = lb.apply(logits.clone(), torch.tensor([1, 0], dtype=torch.int32, device=DEVICE), table)
    assert torch.equal(got[0], logits[0])                        # row 1: untouched
    assert got[1, 7].item() == pytest.approx(logits[1, 7].item() - 100.0)


def test_min_tokens_lifts_once_enough_tokens_were_generated():
    table = RequestStateTable(2, 16, DEVICE)
    lb = LogitBiasState(2, V, DEVICE)
    sp = SamplingParams(min_tokens=3)
    sp.all_stop_token_ids = {7, 199}
    for n_out, banned in [(0, True), (2, True), (3, False)]:
        row = table.add_request("a", list(range(4 + n_out)), 4)
        lb.add_request(row, sp)
        table.apply_staged_writes()
        lb.apply_staged_writes()
        logits = torch.zeros(1, V, device=DEVICE)
        lb.apply(logits, torch.tensor([row], dtype=torch.int32, device=DEVICE), table)
        assert bool(torch.isinf(logits[0, [7, 199]]).all()) == banned
        assert torch.isfinite(logits[0, :7]).all()
        table.remove_request("a")
        lb.remove_request(row)


def test_allowed_only_is_ever_sampled_and_bad_ids_fail():
    lb = LogitBiasState(1, V, DEVICE, max_logit_bias=2)
    table = RequestStateTable(1, 8, DEVICE)
    table.add_request("a", [1], 1)
    table.apply_staged_writes()
    lb.add_request(0, SamplingParams(allowed_token_ids=[3, 64, 65, 199]))
    lb.apply_staged_writes()
    logits = lb.apply(torch.randn(64, V, device=DEVICE) * 10,
                      torch.zeros(64, dtype=torch.int32, device=DEVICE), table)
    assert set(torch.argmax(logits, -1).tolist()) <= {3, 64, 65, 199}
    with pytest.raises(ValueError, match="max_logit_bias"):
        lb.add_request(0, SamplingParams(logit_bias={1: 1.0, 2: 1.0, 3: 1.0}))
    with pytest.raises(ValueError, match="allowed_token_ids"):
        lb.add_request(0, SamplingParams(allowed_token_ids=[V]))
