"""Batch-level logits processors: no-repeat n-gram and a ban list, vs plain Python."""

import random

import pytest
import torch

from mrv2.kernels.input_prep import post_update
from mrv2.platform import DEVICE
from mrv2.sample.logit_bias import LogitBiasState
from mrv2.sample.logits_processors import (
    NoRepeatNGramLogitsProcessor,
    TokenBanLogitsProcessor,
    apply_logits_processors,
    no_repeat_ngram_banned_ref,
)
from mrv2.sample.penalties import PenaltyState
from mrv2.sampling_params import SamplingParams
from mrv2.state import RequestStateTable

V = 64


def _table_with_histories(rng, n_rows, max_len, alphabet, proc):
    table = RequestStateTable(n_rows, max_len, DEVICE)
    histories = []
    for i in range(n_rows):
        ids = [rng.randrange(alphabet) for _ in range(rng.randint(1, max_len // 2))]
        row = table.add_request(f"r{i}", ids, max(1, len(ids) // 2))
        proc.add_request(row, ids[:max(1, len(ids) // 2)], SamplingParams())
        histories.append(ids)
    table.apply_staged_writes()
    proc.apply_staged_writes()
    return table, histories


@pytest.mark.parametrize("n", [1, 2, 3])
def test_no_repeat_ngram_bans_exactly_the_reference_set(n):
    rng = random.Random(n)
    proc = NoRepeatNGramLogitsProcessor(n, 6, DEVICE)
    table, histories = _table_with_histories(rng, 6, 48, 5, proc)
    rows = [3, 0, 5, 1, 4, 2]
    logits = proc.apply(torch.zeros(6, V, device=DEVICE),
                        torch.tensor(rows, dtype=torch.int32, device=DEVICE), table)
    for b, row in enumerate(rows):
        got = set(torch.isinf(logits[b]).nonzero().flatten().tolist())
        assert got == no_repeat_ngram_banned_ref(histories[row], n), (b, row)


def test_no_repeat_ngram_never_repeats_while_generating():
    rng = random.Random(7)
    n, R, L = 3, 4, 40
    proc = NoRepeatNGramLogitsProcessor(n, R, DEVICE, enabled_for=lambda sp: sp.seed != 1)
    table = RequestStateTable(R, L, DEVICE)
    for i in range(R):
        # A prompt with no repeated trigram, so any repeat would be the processor's fault.
        ids = [0, 1, 2, 3, 4, 5][:rng.randint(3, 6)]
        row = table.add_request(f"r{i}", ids, len(ids))
        proc.add_request(row, ids, SamplingParams(seed=i))   # row 1 (seed 1) is off
    table.apply_staged_writes()
    proc.apply_staged_writes()
    idx = torch.arange(R, dtype=torch.int32, device=DEVICE)
    sched = (table.total_len - table.num_computed_tokens).to(torch.int32)
    g = torch.Generator().manual_seed(7)  # CPU draws: the same logits on every device
    for _ in range(20):
        # Favour few tokens strongly, so repeats would be likely without the processor.
        logits = torch.randn(R, V, generator=g).to(DEVICE)
        logits[:, :6] += 8
        sampled = proc.apply(logits, idx, table).argmax(-1)
        post_update(idx, sched, sampled, R, table)
        sched = torch.ones(R, dtype=torch.int32, device=DEVICE)
    for row in range(R):
        toks = table.token_ids[row, :int(table.total_len[row])].tolist()
        grams = [tuple(toks[i:i + n]) for i in range(len(toks) - n + 1)]
        assert (len(grams) == len(set(grams))) == (row != 1), row


def test_token_ban_is_never_sampled():
    table = RequestStateTable(2, 8, DEVICE)
    banned = [0, 5, 63]
    procs = [TokenBanLogitsProcessor(banned, DEVICE)]
    logits = torch.randn(256, V, device=DEVICE)
    logits[:, banned] += 100
    idx = torch.zeros(256, dtype=torch.int32, device=DEVICE)
    out = apply_logits_processors(procs, logits, idx, table)
    assert not set(out.argmax(-1).tolist()) & set(banned)
    assert torch.isinf(out[:, banned]).all() and torch.isfinite(out[:, 1:5]).all()


@pytest.mark.gpu
def test_no_sync_on_gpu():
    R, L = 8, 256
    table = RequestStateTable(R, L, DEVICE)
    ps, lb = PenaltyState(R, V, DEVICE), LogitBiasState(R, V, DEVICE)
    procs = [NoRepeatNGramLogitsProcessor(3, R, DEVICE), TokenBanLogitsProcessor([1, 2], DEVICE)]
    sp = SamplingParams(min_tokens=2, logit_bias={3: 1.0}, allowed_token_ids=list(range(40)))
    sp.all_stop_token_ids = {4}
    for i in range(R):
        row = table.add_request(f"r{i}", list(range(10)), 10)
        ps.add_request(row, list(range(10)))
        lb.add_request(row, sp)
        for p in procs:
            p.add_request(row, list(range(10)), sp)
    table.apply_staged_writes()
    ps.apply_staged_writes()
    lb.apply_staged_writes()
    for p in procs:
        p.apply_staged_writes()
    idx = torch.arange(R, dtype=torch.int32, device=DEVICE)
    sched = torch.full((R,), 10, dtype=torch.int32, device=DEVICE)
    logits = torch.randn(R, V, device=DEVICE)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ps.apply(logits, idx, table)
        lb.apply(logits, idx, table)
        apply_logits_processors(procs, logits, idx, table)
        sampled = logits.argmax(-1)
        ps.update(idx, sched, sampled, R, table)
        post_update(idx, sched, sampled, R, table)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert set(sampled.tolist()) <= set(range(40)) - {1, 2, 4}
