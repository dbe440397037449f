"""Top-k / top-p / min-p threshold-search kernel vs the sort-based torch reference."""

import numpy as np
import pytest
import torch
from device_utils import on_device
from scipy import stats

import mrv2  # noqa: F401  (turns on the interpreter without CUDA)
from mrv2.kernels.gumbel import gumbel_sample
from mrv2.kernels.top_k_top_p import apply_top_k_top_p_min_p, apply_top_k_top_p_min_p_ref
from mrv2.kernels.top_k_top_p_row import apply_top_k_top_p_min_p_row
from mrv2.platform import DEVICE

_on_device = on_device


apply_top_k_top_p_min_p = _on_device(apply_top_k_top_p_min_p)
apply_top_k_top_p_min_p_row = _on_device(apply_top_k_top_p_min_p_row)
gumbel_sample = _on_device(gumbel_sample)


NEG_INF = float("-inf")


def _knobs(num_state_rows, g, vocab):
    """Random per-state-row knobs; each filter is off in about a third of the rows."""
    temp = torch.rand(num_state_rows, generator=g) + 0.3
    temp[::7] = 0.0                                                       # greedy rows
    top_k = torch.randint(1, 80, (num_state_rows,), generator=g, dtype=torch.int32)
    top_k[torch.rand(num_state_rows, generator=g) < 0.35] = -1
    top_k[::11] = vocab                                                   # k >= V: off
    top_p = torch.rand(num_state_rows, generator=g) * 0.9 + 0.05
    top_p[torch.rand(num_state_rows, generator=g) < 0.35] = 1.0
    min_p = torch.rand(num_state_rows, generator=g) * 0.3
    min_p[torch.rand(num_state_rows, generator=g) < 0.4] = 0.0
    return temp, top_k, top_p, min_p


def _run(logits, *args, **kw):
    out = logits.clone()
    assert apply_top_k_top_p_min_p(out, *args, **kw) is out
    return out


@pytest.mark.parametrize("num_rows, vocab, block_v, scale", [
    (1, 100, None, 1.0),     # B = 1, V < BLOCK_V
    (14, 1000, 1024, 3.0),
    (10, 2500, 1024, 1.0),   # V not a multiple of BLOCK_V: three blocks per pass
])
def test_equals_reference(num_rows, vocab, block_v, scale):
    g = torch.Generator().manual_seed(vocab)
    num_state_rows = num_rows + 6
    knobs = _knobs(num_state_rows, g, vocab)
    idx = torch.randperm(num_state_rows, generator=g)[:num_rows].to(torch.int32)
    logits = torch.randn(num_rows, vocab, generator=g) * scale         # tie-free
    logits[:, :: 13] = NEG_INF                                           # already masked ids
    out = _run(logits, idx, *knobs, block_v=block_v)
    ref = apply_top_k_top_p_min_p_ref(logits, idx, *knobs)
    assert torch.equal(out, ref)
    assert (out > NEG_INF).any(dim=1).all()
    # The one-program-per-row kernel itself (mrv2/kernels/top_k_top_p_row.py), not through
    # the dispatcher (whose default it is).
    row = logits.clone()
    assert apply_top_k_top_p_min_p_row(row, idx, *knobs, block_v=block_v) is row
    assert torch.equal(row, ref)


def test_each_filter_alone_and_the_extremes():
    g = torch.Generator().manual_seed(1)
    vocab = 600
    logits = torch.randn(8, vocab, generator=g) * 2
    temp = torch.tensor([1.0, 0.7, 1.0, 1.3, 1.0, 1.0, 1.0, 1.0])
    top_k = torch.tensor([5, -1, -1, 1, -1, -1, 0, 600], dtype=torch.int32)
    top_p = torch.tensor([1.0, 0.5, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0])
    min_p = torch.tensor([0.0, 0.0, 0.1, 0.0, 0.0, 1.0, 0.0, 0.0])
    idx = torch.arange(8, dtype=torch.int32)
    out = _run(logits, idx, temp, top_k, top_p, min_p, block_v=256)
    assert torch.equal(out, apply_top_k_top_p_min_p_ref(logits, idx, temp, top_k, top_p, min_p))
    kept = (out > NEG_INF).sum(1).tolist()
    assert kept[0] == 5 and kept[3] == kept[4] == kept[5] == 1 and kept[6] == kept[7] == vocab
    assert torch.equal(out[6:], logits[6:])                               # all off: untouched


def test_ties_at_the_threshold_are_all_kept():
    logits = torch.tensor([[5.0, 3.0, 1.0, 3.0, 0.0, 3.0]])
    idx = torch.zeros(1, dtype=torch.int32)
    one, off = torch.ones(1), torch.zeros(1)
    out = _run(logits, idx, one, torch.tensor([2], dtype=torch.int32), one, off)
    assert (out > NEG_INF).tolist() == [[True, True, False, True, False, True]]
    tied_top = torch.tensor([[2.0, 2.0, 1.0]])                            # the top token is tied
    out = _run(tied_top, idx, one, torch.tensor([1], dtype=torch.int32), one, off)
    assert (out > NEG_INF).tolist() == [[True, True, False]]


def test_empty_batch_and_greedy_rows_untouched():
    temp = torch.zeros(3)
    k = torch.full((3,), 2, dtype=torch.int32)
    p, mp = torch.full((3,), 0.5), torch.full((3,), 0.5)
    empty = torch.empty(0, 10)
    assert apply_top_k_top_p_min_p(empty, torch.empty(0, dtype=torch.int32), temp, k, p, mp) is empty
    logits = torch.randn(3, 40)
    out = _run(logits, torch.arange(3, dtype=torch.int32), temp, k, p, mp)
    assert torch.equal(out, logits)


@pytest.mark.parametrize("top_k, top_p, min_p, temperature", [
    (20, 1.0, 0.0, 1.0),
    (-1, 0.8, 0.0, 0.7),
    (-1, 1.0, 0.05, 1.5),
    (40, 0.9, 0.02, 1.0),
])
def test_chi_squared_of_truncated_sampling(top_k, top_p, min_p, temperature):
    """Gumbel samples after truncation follow the renormalised truncated softmax."""
    g = torch.Generator().manual_seed(top_k + 7)
    vocab, num = 300, 12_000
    row = torch.randn(1, vocab, generator=g) * 1.5
    idx = torch.zeros(1, dtype=torch.int32)
    knobs = (torch.tensor([temperature]), torch.tensor([top_k], dtype=torch.int32),
             torch.tensor([top_p]), torch.tensor([min_p]))
    masked = _run(row, idx, *knobs, block_v=128)
    assert torch.equal(masked, apply_top_k_top_p_min_p_ref(row, idx, *knobs))
    logits = masked.expand(num, vocab).contiguous()
    out = gumbel_sample(logits, torch.zeros(num, dtype=torch.int32), knobs[0],
                        torch.tensor([99], dtype=torch.int64), torch.arange(num), block_v=128)
    counts = np.bincount(out.numpy(), minlength=vocab)
    keep = (masked[0] > NEG_INF).numpy()
    assert counts[~keep].sum() == 0                                        # never a removed id
    probs = torch.softmax(masked[0].double() / temperature, -1).numpy()[keep]
    obs = counts[keep]
    exp = probs * num
    big = exp >= 5
    obs = np.append(obs[big], obs[~big].sum())
    exp = np.append(exp[big], exp[~big].sum())
    if exp[-1] < 5:
        obs, exp = obs[:-1], exp[:-1]
    assert stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue > 1e-3
    # the untruncated softmax is rejected (the removed ids are never drawn)
    full = torch.softmax(row[0].double() / temperature, -1).numpy() * num
    big = full >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(full[big], full[~big].sum())
    assert stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue < 1e-6


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_large_vocab(dtype):
    g = torch.Generator().manual_seed(3)
    num_rows, vocab = 32, 151_936
    knobs = _knobs(num_rows, g, vocab)
    idx = torch.arange(num_rows, dtype=torch.int32)
    logits = torch.randn(num_rows, vocab, generator=g) * 3
    if dtype == torch.float32:
        out = _run(logits.to(DEVICE), idx.to(DEVICE), *(t.to(DEVICE) for t in knobs))
        ref = apply_top_k_top_p_min_p_ref(logits, idx, *knobs)
        # top-p masses are fp32 sums in another order: allow a token at the edge to differ
        assert ((out.cpu() > NEG_INF) != (ref > NEG_INF)).sum(1).max() <= 1
    else:
        # bf16 has many exact ties: check top-k alone, where ties are all kept by design
        temp = torch.ones(num_rows)
        top_k = torch.randint(1, 50, (num_rows,), generator=g, dtype=torch.int32)
        off_p, off_mp = torch.ones(num_rows), torch.zeros(num_rows)
        lb = logits.to(torch.bfloat16)
        out = _run(lb.to(DEVICE), idx.to(DEVICE), temp.to(DEVICE), top_k.to(DEVICE),
                   off_p.to(DEVICE), off_mp.to(DEVICE)).cpu()
        kth = torch.stack([lb[i].float().topk(int(top_k[i])).values[-1] for i in range(num_rows)])
        assert torch.equal(out > NEG_INF, lb.float() >= kth[:, None])


@pytest.mark.parametrize("vocab", [256, 257, 512])   # one block, one block + 1, two blocks
def test_each_search_variant_at_block_edges(vocab):
    """k alone, p alone, both, min-p alone (one Z pass, no search), flat and tied rows."""
    g = torch.Generator().manual_seed(vocab + 5)
    rows = 10
    logits = torch.randn(rows, vocab, generator=g) * 2
    logits[6] = 0.0                                       # flat: every token tied
    logits[7, :] = -3.0
    logits[7, [0, vocab - 1]] = 4.0                       # a tie at both edges of the row
    logits[8, 1::2] = NEG_INF                             # half masked
    temp = torch.tensor([1.0, 0.6, 1.2, 0.9, 1.0, 1.0, 1.0, 1.0, 0.8, 1.0])
    top_k = torch.tensor([7, -1, 12, -1, 1, vocab - 1, 3, 1, 9, 2], dtype=torch.int32)
    top_p = torch.tensor([1.0, 0.7, 0.5, 1.0, 1.0, 1.0, 0.3, 0.9, 0.6, 1e-7])
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.2, 0.1, 0.0, 0.0, 0.0, 0.05, 0.0])
    idx = torch.arange(rows, dtype=torch.int32).flip(0)   # through idx_mapping, reversed
    knobs = (temp, top_k, top_p, min_p)
    for num_pivots in (4, 16):
        out = _run(logits, idx, *knobs, block_v=256, num_pivots=num_pivots)
        assert torch.equal(out, apply_top_k_top_p_min_p_ref(logits, idx, *knobs))
    straight = torch.arange(rows, dtype=torch.int32)
    kept = (_run(logits, straight, *knobs, block_v=256) > NEG_INF).sum(1)
    assert kept[6].item() == vocab                        # flat row, k = 3: all tied, all kept
    assert kept[7].item() == 2                            # k = 1 keeps both tied top tokens
    assert kept[9].item() == 1                            # tiny top_p: the top token only
