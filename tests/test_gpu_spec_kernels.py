"""Speculative-decoding kernels compiled on a GPU: equal to their references, unbiased,
and free of CPU-GPU syncs (the lead runs these; CI has no GPU)."""

from types import SimpleNamespace

import pytest
import torch

from mrv2.spec_decode import (
    exact_verify,
    ngram_propose,
    ngram_propose_ref,
    probabilistic_verify,
    spec_post_update,
    write_draft_slots,
)
from mrv2.spec_decode.verify import exact_verify_ref, probabilistic_verify_ref

pytestmark = pytest.mark.gpu
DEV = "cuda"


def _sampling(rows, gen):
    temp = torch.rand(rows, generator=gen) + 0.3
    temp[0] = 0.0
    which = torch.arange(rows) % 3
    return SimpleNamespace(temperature=temp, top_k=torch.where(which == 1, 20, -1).int(),
                           top_p=torch.where(which == 2, 0.9, 1.0),
                           min_p=torch.zeros(rows), seed=torch.arange(rows) * 7919 + 1)


def _to(ns, dev):
    return SimpleNamespace(**{k: v.to(dev) for k, v in vars(ns).items()})


@pytest.mark.parametrize("vocab", [151936, 1000])
def test_verify_kernels_equal_reference_on_gpu(vocab):
    gen = torch.Generator().manual_seed(0)
    b, k, rows = 16, 3, 8
    st = _sampling(rows, gen)
    logits = torch.randn(b * (k + 1), vocab, generator=gen) * 3
    idx = torch.randint(0, rows, (b,), generator=gen, dtype=torch.int32)
    base = torch.randint(0, 4000, (b,), generator=gen)
    drafts = logits.view(b, k + 1, vocab)[:, :k].argmax(-1).int()
    drafts[::4, 1] = -1
    cols = (st.temperature, st.top_k, st.top_p, st.min_p, st.seed)
    g = exact_verify(logits.to(DEV), drafts.to(DEV), idx.to(DEV), base.to(DEV), _to(st, DEV))
    r = exact_verify_ref(logits, drafts, idx, base, *cols)
    assert torch.equal(g.output_token_ids.cpu(), r.output_token_ids)
    for lg in (logits, logits.bfloat16()):                     # fp32, and bf16 read by the kernel
        g = probabilistic_verify(lg.to(DEV), drafts.to(DEV), idx.to(DEV), base.to(DEV),
                                 _to(st, DEV))
        r = probabilistic_verify_ref(lg.float(), drafts, idx, base, *cols)
        # NOTE: exp / sums round differently on the GPU: allow a rare near-tie flip.
        assert (g.output_token_ids.cpu() != r.output_token_ids).float().mean() < 0.05


def test_ngram_on_gpu():
    gen = torch.Generator().manual_seed(1)
    token_ids = torch.randint(0, 3, (64, 3000), generator=gen, dtype=torch.int32)
    total_len = torch.randint(1, 3000, (64,), generator=gen, dtype=torch.int32)
    idx = torch.randperm(64, generator=gen)[:40].int()
    g = ngram_propose(idx.to(DEV), token_ids.to(DEV), total_len.to(DEV), 4, 2, 5)
    r = ngram_propose_ref(idx, token_ids, total_len, 4, 2, 5)
    assert torch.equal(g[0].cpu(), r[0]) and torch.equal(g[1].cpu(), r[1])


def test_speculative_step_does_not_sync():
    gen = torch.Generator().manual_seed(2)
    b, k, vocab, rows = 8, 3, 32000, 8
    st = _to(_sampling(rows, gen), DEV)
    i32 = {"dtype": torch.int32, "device": DEV}
    table = SimpleNamespace(
        token_ids=torch.randint(0, 4, (rows, 512), generator=gen, dtype=torch.int32).to(DEV),
        total_len=torch.full((rows,), 200, **i32),
        num_computed_tokens=torch.full((rows,), 199, **i32),
        last_sampled_token=torch.zeros(rows, **i32),
        draft_token_ids=torch.full((rows, k), -1, **i32))
    idx = torch.arange(b, dtype=torch.int32, device=DEV)
    logits = torch.randn(b * (k + 1), vocab, device=DEV)
    n_sched = torch.full((b,), k + 1, dtype=torch.int32, device=DEV)
    n_draft = torch.full((b,), k, dtype=torch.int32, device=DEV)
    for mode in ("warm-up", "check"):
        if mode == "check":
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            drafts, _ = ngram_propose(idx, table.token_ids, table.total_len, k, 1, 3)
            write_draft_slots(drafts, idx, b, table)
            base = table.num_computed_tokens[idx.long()]
            for verify in (exact_verify, probabilistic_verify):
                res = verify(logits.clone(), drafts, idx, base, st)
            spec_post_update(idx, n_sched, n_draft, res.output_token_ids, res.num_output_tokens,
                             b, table)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
