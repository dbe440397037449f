"""The chunked (rows x chunks programs) top-k / top-p / min-p search vs the sort reference.

The kernels of ``mrv2/kernels/top_k_top_p_chunked.py``, launched as the GPU path would by
``apply_top_k_top_p_min_p(..., method="chunked")`` (their only caller).

Small vocabularies with small chunks, so a row spans several chunks and a chunk several
blocks under the interpreter (the GPU default is 4096-wide chunks of 512-wide blocks).
"""

import pytest
import torch
from device_utils import on_device
from test_top_k_top_p import _knobs as _suite_knobs

import mrv2  # noqa: F401  (turns on the interpreter without CUDA)
from mrv2.kernels.top_k_top_p import (
    apply_top_k_top_p_min_p,
    apply_top_k_top_p_min_p_ref,
    top_k_top_p_workspace,
)
from mrv2.platform import DEVICE, HAS_CUDA

apply_top_k_top_p_min_p = on_device(apply_top_k_top_p_min_p)

NEG_INF = float("-inf")
CHUNKED = {"method": "chunked", "block_v": 64, "chunk_v": 128}


def _run(logits, *args, **kw):
    out = logits.clone()
    assert apply_top_k_top_p_min_p(out, *args, **kw) is out
    return out


def _knobs(rows):
    """temperature, top_k, top_p, min_p from per-row tuples."""
    temp, k, p, mp = zip(*rows)
    return (torch.tensor(temp), torch.tensor(k, dtype=torch.int32), torch.tensor(p),
            torch.tensor(mp))


def test_mixed_rows_permuted_idx_mapping():
    """Every filter alone and combined, the extremes, greedy and off rows, in one batch."""
    g = torch.Generator().manual_seed(11)
    vocab = 300                                  # 2 full chunks + 44 logits; 5 blocks
    rows = [  # (temperature, top_k, top_p, min_p)
        (1.0, 1, 1.0, 0.0),        # k = 1
        (0.7, vocab, 1.0, 0.0),    # k = V: off
        (1.0, vocab - 1, 1.0, 0.0),
        (1.2, -1, 1e-7, 0.0),      # tiny top_p: the top token only
        (1.0, -1, 0.0, 0.0),       # top_p = 0: the top token only
        (0.9, -1, 0.6, 0.0),
        (1.0, -1, 1.0, 0.1),       # min-p alone
        (1.0, -1, 1.0, 1.0),       # min_p = 1: the top token only
        (0.8, 9, 0.7, 0.02),       # all three
        (1.0, 30, 0.9, 0.0),
        (0.0, 5, 0.5, 0.1),        # greedy: untouched
        (1.0, 0, 1.0, 0.0),        # all off: untouched
        (1.3, 4, 1.0, 0.05),
    ]
    knobs = _knobs(rows)
    num_rows = len(rows)
    logits = torch.randn(num_rows, vocab, generator=g) * 2.5              # tie-free
    logits[:, 5::17] = NEG_INF                                            # already masked ids
    logits[4, 200:] = NEG_INF                                             # a masked tail
    idx = torch.randperm(num_rows, generator=g).to(torch.int32)
    # batch slot i reads state row idx[i]: lay the logits out so slot i gets row idx[i]'s data
    out = _run(logits, idx, *knobs, **CHUNKED)
    ref = apply_top_k_top_p_min_p_ref(logits, idx, *knobs)
    assert torch.equal(out, ref)
    slot = {int(r): i for i, r in enumerate(idx)}                         # state row -> slot
    kept = (out > NEG_INF).sum(1)
    assert kept[slot[0]] == 1 and kept[slot[3]] == 1 and kept[slot[4]] == 1
    assert kept[slot[7]] == 1 and kept[slot[12]] == 4
    for r in (1, 10, 11):                                                 # off / greedy
        assert torch.equal(out[slot[r]], logits[slot[r]])


@pytest.mark.parametrize("num_rows, vocab, block_v, chunk_v, num_pivots", [
    (1, 100, 32, 64, 16),       # one row, V < 2 chunks, the last chunk half padding
    (6, 257, 128, 256, 4),      # V = a chunk + 1; 4 pivots: 16 rounds
    (2, 300, 32, 128, 2),       # 2 pivots: bisection, 32 rounds
])
def test_random_rows_equal_reference(num_rows, vocab, block_v, chunk_v, num_pivots):
    g = torch.Generator().manual_seed(vocab)
    temp = torch.rand(num_rows, generator=g) + 0.4
    top_k = torch.randint(1, 40, (num_rows,), generator=g, dtype=torch.int32)
    top_k[1::3] = -1
    top_p = torch.rand(num_rows, generator=g) * 0.9 + 0.05
    top_p[2::3] = 1.0
    min_p = torch.rand(num_rows, generator=g) * 0.2
    min_p[::2] = 0.0
    logits = torch.randn(num_rows, vocab, generator=g) * 3
    logits[:, ::11] = NEG_INF
    idx = torch.arange(num_rows, dtype=torch.int32).flip(0)
    knobs = (temp, top_k, top_p, min_p)
    out = _run(logits, idx, *knobs, method="chunked", block_v=block_v, chunk_v=chunk_v,
               num_pivots=num_pivots)
    assert torch.equal(out, apply_top_k_top_p_min_p_ref(logits, idx, *knobs))


def test_block_maxima_bounds():
    """k <= the number of blocks and a peaked top-p start the search from the block maxima;
    the top values packed into one block (a weak bound) and top_p = 0 still match."""
    g = torch.Generator().manual_seed(9)
    vocab = 1024                                 # 4 chunks of 8 blocks: 32 block maxima
    logits = torch.randn(8, vocab, generator=g) * 3
    logits[2, 40:60] = torch.linspace(20.0, 15.0, 20)                     # all in one block
    logits[3, 700:720] = torch.linspace(20.0, 15.0, 20)
    rows = [(0.6, 20, 0.95, 0.0), (0.6, -1, 0.95, 0.0), (1.0, 12, 1.0, 0.0),
            (0.6, 30, 0.99, 0.01), (1.0, 5, 0.0, 0.0), (2.0, 32, 0.5, 0.0),
            (1.0, 200, 0.05, 0.0),     # top-p decides: the top-k search starts above its answer
            (1.0, 1, 0.999, 0.0)]      # top-k decides: the top-p search starts above its answer
    knobs = _knobs(rows)
    idx = torch.arange(8, dtype=torch.int32)
    out = _run(logits, idx, *knobs, method="chunked", block_v=32, chunk_v=256)
    assert torch.equal(out, apply_top_k_top_p_min_p_ref(logits, idx, *knobs))
    assert (out[2] > NEG_INF).sum() == 12 and (out[4] > NEG_INF).sum() == 1


def test_the_first_suites_random_knobs():
    """test_top_k_top_p.py's random knobs (greedy, k >= V, each filter off in ~1/3 rows)."""
    g = torch.Generator().manual_seed(2500)
    num_rows, vocab = 10, 2500
    knobs = _suite_knobs(num_rows + 6, g, vocab)
    idx = torch.randperm(num_rows + 6, generator=g)[:num_rows].to(torch.int32)
    logits = torch.randn(num_rows, vocab, generator=g)
    logits[:, ::13] = NEG_INF
    out = _run(logits, idx, *knobs, method="chunked", block_v=256, chunk_v=1024)
    assert torch.equal(out, apply_top_k_top_p_min_p_ref(logits, idx, *knobs))


def test_ties_across_chunks_are_all_kept_and_odd_rows():
    """Tied values in different chunks, a flat row, a tied top, an all -inf row."""
    g = torch.Generator().manual_seed(5)
    vocab = 200
    logits = (torch.randn(5, vocab, generator=g) * 2).round()            # many exact ties
    logits[2] = 0.0                                                       # flat
    logits[3] = -1.0
    logits[3, [3, 150]] = 2.0                                             # top tied across chunks
    logits[4] = NEG_INF                                                   # nothing to keep
    top_k = torch.tensor([7, 25, 3, 1, 2], dtype=torch.int32)
    one, off = torch.ones(5), torch.zeros(5)
    idx = torch.arange(5, dtype=torch.int32)
    out = _run(logits, idx, one, top_k, one, off, **CHUNKED)
    # expected from torch.topk: everything at least the k-th largest value
    kth = torch.stack([logits[i].topk(int(top_k[i])).values[-1] for i in range(4)])
    keep = logits[:4] >= kth[:, None]                                     # [4, V]
    assert torch.equal(out[:4] > NEG_INF, keep)
    assert torch.equal(out[:4][keep], logits[:4][keep])
    assert (out[4] == NEG_INF).all() and (out[2] > NEG_INF).all()


def test_workspace_reuse_empty_batch_and_bad_arguments():
    g = torch.Generator().manual_seed(2)
    vocab = 150
    ws = top_k_top_p_workspace(4, vocab, DEVICE, block_v=64, chunk_v=128)
    knobs = _knobs([(1.0, 3, 0.8, 0.0), (0.9, -1, 0.5, 0.05), (1.0, 10, 1.0, 0.0),
                    (1.1, 2, 1.0, 0.0)])
    for num_rows in (3, 2):                                              # fewer rows than ws
        logits = torch.randn(num_rows, vocab, generator=g) * 2
        idx = torch.randperm(4, generator=g)[:num_rows].to(torch.int32)
        out = _run(logits, idx, *knobs, workspace=ws, **CHUNKED)
        assert torch.equal(out, apply_top_k_top_p_min_p_ref(logits, idx, *knobs))
    empty = torch.empty(0, vocab)
    assert apply_top_k_top_p_min_p(empty, torch.empty(0, dtype=torch.int32), *knobs,
                                   **CHUNKED) is empty
    logits = torch.randn(2, vocab)
    idx = torch.arange(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="workspace"):
        apply_top_k_top_p_min_p(logits, idx, *knobs, workspace=ws, method="chunked",
                                block_v=32, chunk_v=32)                  # other chunk count
    with pytest.raises(ValueError, match="chunk_v"):
        apply_top_k_top_p_min_p(logits, idx, *knobs, method="chunked", block_v=64, chunk_v=96)
    with pytest.raises(ValueError, match="method"):
        apply_top_k_top_p_min_p(logits, idx, *knobs, method="sort")
    with pytest.raises(ValueError, match="num_pivots"):
        apply_top_k_top_p_min_p(logits, idx, *knobs, method="chunked", num_pivots=6)


def test_cached_workspace_grows_with_the_rows_and_the_default_method():
    """Without a workspace the dispatcher keeps one per (device, vocab, config) and grows it
    when a call brings more rows; the default method is chunked on the GPU, row here."""
    from mrv2.kernels import top_k_top_p as mod

    g = torch.Generator().manual_seed(5)
    vocab = 200
    mod._WORKSPACES.clear()
    dev = torch.device(DEVICE)
    key = (dev if dev.type != "cuda" else torch.device("cuda", torch.cuda.current_device()),
           vocab, 64, 128, 16)
    sizes = []
    for num_rows in (2, 5, 3, 9):
        knobs = _knobs([(1.0, 1 + r % 7, 0.3 + 0.06 * r, 0.01 * (r % 3))
                        for r in range(num_rows)])
        logits = torch.randn(num_rows, vocab, generator=g) * 3
        idx = torch.randperm(num_rows, generator=g).to(torch.int32)
        out = _run(logits, idx, *knobs, **CHUNKED)
        assert torch.equal(out, apply_top_k_top_p_min_p_ref(logits, idx, *knobs))
        sizes.append(mod._WORKSPACES[key].bracket.shape[0])
    assert sizes == [2, 5, 5, 10]                  # grown (doubled or to fit), never shrunk
    logits = torch.randn(3, vocab, generator=g)
    knobs = _knobs([(1.0, 4, 1.0, 0.0)] * 3)
    idx = torch.arange(3, dtype=torch.int32)
    mod._WORKSPACES.clear()
    assert torch.equal(_run(logits, idx, *knobs), apply_top_k_top_p_min_p_ref(logits, idx, *knobs))
    # Only the chunked search keeps a workspace: it ran exactly when it is the default.
    assert bool(mod._WORKSPACES) == (not mod.TRITON_INTERPRET)


def test_reserve_sizes_the_dispatcher_workspace_once():
    """``reserve_top_k_top_p_workspace`` makes the scratch a later call of up to that many
    rows uses, so a step never allocates (the GPU soak's memory_allocated check found the
    growth); off the GPU it keeps nothing, the row method needing no scratch."""
    from mrv2.kernels import top_k_top_p as mod

    mod._WORKSPACES.clear()
    mod.reserve_top_k_top_p_workspace(12, 300, DEVICE)
    if mod.TRITON_INTERPRET or torch.device(DEVICE).type != "cuda":
        assert not mod._WORKSPACES
        return
    (ws,) = mod._WORKSPACES.values()
    assert ws.bracket.shape[0] == 12
    knobs = tuple(t.to(DEVICE) for t in _knobs([(1.0, 3, 0.7, 0.0)] * 7))
    logits = torch.randn(7, 300, device=DEVICE)
    idx = torch.arange(7, dtype=torch.int32, device=DEVICE)
    before = torch.cuda.memory_allocated()
    apply_top_k_top_p_min_p(logits, idx, *knobs)
    assert list(mod._WORKSPACES.values()) == [ws]            # the same scratch, not regrown
    # (the reserve names "cuda", the logits "cuda:0": one key, not two)
    assert torch.cuda.memory_allocated() == before
    mod._WORKSPACES.clear()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_chunked_matches_row_kernel_and_replays_in_a_cuda_graph(dtype):
    """256 x 151,936: chunked == the one-program-per-row kernel; a captured graph replays it."""
    if not HAS_CUDA:
        pytest.skip("needs CUDA")
    g = torch.Generator(device=DEVICE).manual_seed(0)
    num_rows, vocab = 256, 151_936
    logits = (torch.randn(num_rows, vocab, device=DEVICE, generator=g) * 3).to(dtype)
    idx = torch.randperm(num_rows, device=DEVICE, generator=g).to(torch.int32)
    temp = torch.rand(num_rows, device=DEVICE, generator=g) + 0.3
    temp[::9] = 0.0
    top_k = torch.randint(1, 100, (num_rows,), device=DEVICE, generator=g, dtype=torch.int32)
    top_k[::4] = -1
    top_p = torch.rand(num_rows, device=DEVICE, generator=g) * 0.5 + 0.5
    top_p[1::3] = 1.0
    min_p = torch.where(torch.arange(num_rows, device=DEVICE) % 5 == 0, 0.05, 0.0)
    knobs = (temp, top_k, top_p, min_p)
    row = apply_top_k_top_p_min_p(logits.clone(), idx, *knobs, method="row")
    chunked = apply_top_k_top_p_min_p(logits.clone(), idx, *knobs, method="chunked")
    # top-p masses are fp32 sums in another order: only the tokens tied at one row's edge
    # (one value; bf16 has many ties) may differ
    differ = (row > NEG_INF) != (chunked > NEG_INF)                       # [B, V]
    for i in differ.any(1).nonzero().flatten().tolist():
        assert logits[i][differ[i]].float().unique().numel() == 1
    k_only = apply_top_k_top_p_min_p(logits.clone(), idx, temp, top_k, torch.ones_like(top_p),
                                     torch.zeros_like(min_p), method="chunked")
    k_row = apply_top_k_top_p_min_p(logits.clone(), idx, temp, top_k, torch.ones_like(top_p),
                                    torch.zeros_like(min_p), method="row")
    assert torch.equal(k_only, k_row)
    ws = top_k_top_p_workspace(num_rows, vocab, DEVICE)
    work = logits.clone()
    apply_top_k_top_p_min_p(work, idx, *knobs, workspace=ws)             # compile outside
    graph = torch.cuda.CUDAGraph()
    work.copy_(logits)
    with torch.cuda.graph(graph):
        apply_top_k_top_p_min_p(work, idx, *knobs, workspace=ws)
    work.copy_(logits)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(work, chunked)


def _open_after_each_round(logits, idx, knobs, ws, **kw):
    """The output, and the rows with a search in use whose bracket is still open, after
    each ``_narrow_kernel``."""
    from mrv2.kernels import top_k_top_p as mod

    rows, vocab = logits.shape
    seen, orig = [], mod._narrow_kernel
    _temp, top_k, top_p, _min_p = (t[idx.long()] for t in knobs)               # per slot
    use_k = ((top_k > 0) & (top_k < vocab)).to(ws.bracket.device)
    use_p = (top_p < 1.0).to(ws.bracket.device)

    class _Spy:
        def __getitem__(self, grid):
            def run(*args, **kwargs):
                orig[grid](*args, **kwargs)
                b = ws.bracket[:rows, :4]
                seen.append(int(((use_k & ((b[:, 1] - b[:, 0]) > 1))
                                 | (use_p & ((b[:, 3] - b[:, 2]) > 1))).sum()))
            return run
    mod._narrow_kernel = _Spy()
    try:
        out = _run(logits, idx, *knobs, workspace=ws, **kw)
    finally:
        mod._narrow_kernel = orig
    return out, seen


@pytest.mark.parametrize("slots", [None, "exact", "one_short"])
@pytest.mark.parametrize("sub_v", [1024, 32])   # the slots in one step, or 4 steps a chunk
def test_candidates_finish_the_search_or_fall_back(monkeypatch, slots, sub_v):
    """The gather pass keeps every key above the bracket's lo when each chunk's fit in
    CAND_SLOTS; the row's searches then end in ``_finish_kernel``, before any round. A
    chunk with one candidate too many sends its row through the ordinary rounds. Both ways
    equal the sort reference; "exact" sets the slots to the largest count a chunk of this
    batch has (it fits)."""
    from mrv2.kernels import top_k_top_p as mod

    monkeypatch.setattr(mod, "GATHER_SUB_V", sub_v)
    g = torch.Generator().manual_seed(21)
    num_rows, vocab, P = 6, 512, 2                # 4 chunks of 4 blocks; 2 pivots: bisection
    kw = {"method": "chunked", "block_v": 32, "chunk_v": 128, "num_pivots": P}
    logits = torch.randn(num_rows, vocab, generator=g) * 3
    logits[:, 7::29] = NEG_INF
    knobs = _knobs([(0.6, 5, 1.0, 0.0), (0.8, 5, 0.9, 0.0), (1.0, 3, 1.0, 0.02),
                    (0.7, 12, 0.5, 0.0), (1.0, 2, 1.0, 0.0), (0.9, 6, 0.99, 0.0)])
    idx = torch.randperm(num_rows, generator=g).to(torch.int32)
    ref = apply_top_k_top_p_min_p_ref(logits, idx, *knobs)
    ws = mod.top_k_top_p_workspace(num_rows, vocab, DEVICE, block_v=32, chunk_v=128,
                                   num_pivots=P)
    out, seen = _open_after_each_round(logits, idx, knobs, ws, **kw)
    assert torch.equal(out, ref)
    num_cand = ws.cand[:num_rows, :, 0].view(torch.int32)                   # [B, NC]
    assert (num_cand >= 1).any(1).all()           # every row had candidates (k <= blocks)
    if slots is None:
        assert num_cand.max() <= mod.CAND_SLOTS and seen[0] == 0            # all finished
        return
    most = int(num_cand.max())
    assert most >= 2
    monkeypatch.setattr(mod, "CAND_SLOTS", most if slots == "exact" else most - 1)
    ws = mod.top_k_top_p_workspace(num_rows, vocab, DEVICE, block_v=32, chunk_v=128,
                                   num_pivots=P)
    out, seen = _open_after_each_round(logits, idx, knobs, ws, **kw)
    assert torch.equal(out, ref)
    assert torch.equal(ws.cand[:num_rows, :, 0].view(torch.int32), num_cand)
    overflow = int((num_cand > mod.CAND_SLOTS).any(1).sum())
    assert overflow == (0 if slots == "exact" else (num_cand == most).any(1).sum())
    # bisection (2 pivots) cannot close a bracket of several keys in one round
    assert seen[0] == overflow and seen[-1] == 0


def test_candidates_with_ties_and_a_wide_top_p_row():
    """A top-p-only row whose bracket holds a whole chunk (it falls back) beside top-k rows
    that finish on their candidates, tied candidates (all kept), and -inf logits."""
    from mrv2.kernels import top_k_top_p as mod

    g = torch.Generator().manual_seed(4)
    num_rows, vocab = 4, 384
    logits = (torch.randn(num_rows, vocab, generator=g) * 2).round()        # many ties
    logits[3] = torch.randn(vocab, generator=g) * 0.01                      # flat: wide top-p
    logits[1, ::5] = NEG_INF
    knobs = _knobs([(1.0, 4, 1.0, 0.0), (0.7, 5, 1.0, 0.0), (1.0, 2, 1.0, 0.0),
                    (1.0, -1, 0.9, 0.0)])
    idx = torch.arange(num_rows, dtype=torch.int32)
    ws = mod.top_k_top_p_workspace(num_rows, vocab, DEVICE, block_v=32, chunk_v=128)
    out, seen = _open_after_each_round(logits, idx, knobs, ws, method="chunked",
                                       block_v=32, chunk_v=128)
    # top-k rows: everything at least the k-th largest value (ties kept); the flat row has
    # no ties, so it equals the sort reference
    kth = torch.stack([logits[i].topk(int(knobs[1][i])).values[-1] for i in range(3)])
    assert torch.equal(out[:3] > NEG_INF, logits[:3] >= kth[:, None])
    assert torch.equal(out[3], apply_top_k_top_p_min_p_ref(logits, idx, *knobs)[3])
    num_cand = ws.cand[:num_rows, :, 0].view(torch.int32)                   # [B, NC]
    # the wide row: every block's max lies above lo, so _init_kernel marked it overflowed
    # and the gather pass skipped it; the top-k rows were gathered
    assert (num_cand[3] == mod.CAND_SLOTS + 1).all()
    assert (num_cand[:3] <= mod.CAND_SLOTS).all()
    assert seen[0] <= 1


def test_rows_that_overflow_their_slots_take_the_rounds(monkeypatch):
    """One candidate slot a chunk sends most rows through the pivot rounds, over a row
    whose last chunk is partly past its end; they close and equal the sort reference."""
    from mrv2.kernels import top_k_top_p as mod

    monkeypatch.setattr(mod, "CAND_SLOTS", 1)
    g = torch.Generator().manual_seed(77)
    num_rows, vocab = 5, 700                      # 6 chunks of 128, the last one 60 logits
    logits = torch.randn(num_rows, vocab, generator=g) * 3
    logits[:, 3::31] = NEG_INF
    knobs = _knobs([(0.6, 20, 0.95, 0.0), (1.0, -1, 0.8, 0.0), (0.8, 7, 1.0, 0.05),
                    (1.0, 40, 0.5, 0.0), (0.5, 3, 0.99, 0.0)])
    idx = torch.arange(num_rows, dtype=torch.int32).flip(0)
    ws = mod.top_k_top_p_workspace(num_rows, vocab, DEVICE, block_v=32, chunk_v=128)
    out, seen = _open_after_each_round(logits, idx, knobs, ws, method="chunked", block_v=32,
                                       chunk_v=128)
    assert torch.equal(out, apply_top_k_top_p_min_p_ref(logits, idx, *knobs))
    assert seen[0] >= 3 and seen[-1] == 0          # most rows fell back, and all closed


def _key_ref(s: torch.Tensor) -> torch.Tensor:
    """fp32 -> int32 key ordered like the floats (the kernels' ``_key``)."""
    bits = s.view(torch.int32)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


def test_gather_kernel_equals_a_torch_gather():
    """``top_k_top_p_cand._gather_kernel`` against torch, from the bracket it read: per
    chunk the count of keys above the open searches' lowest lo and, when they fit, those
    keys and their s = x / T in id order; a row ``_init_kernel`` marked (more than half the
    blocks' maxima above lo) keeps the SLOTS + 1 mark untouched."""
    from mrv2.kernels import top_k_top_p as mod

    g = torch.Generator().manual_seed(31)
    num_rows, vocab, bv, cv = 5, 700, 32, 128
    logits = torch.randn(num_rows, vocab, generator=g) * 3
    logits[:, 4::37] = NEG_INF
    logits[4] = torch.randn(vocab, generator=g) * 0.01         # flat: top-p alone overflows
    knobs = _knobs([(0.6, 20, 0.95, 0.0), (0.8, 5, 1.0, 0.0), (1.0, -1, 0.5, 0.0),
                    (0.7, 12, 0.9, 0.02), (1.0, -1, 0.99, 0.0)])
    idx = torch.arange(num_rows, dtype=torch.int32)
    ws = mod.top_k_top_p_workspace(num_rows, vocab, DEVICE, block_v=bv, chunk_v=cv)
    seen, orig = {}, mod._finish_kernel

    class _Spy:                          # the bracket and candidates the finish reads
        def __getitem__(self, grid):
            def run(*args, **kwargs):
                seen["bracket"] = ws.bracket[:num_rows, :4].clone()
                seen["cand"] = ws.cand[:num_rows].clone()
                orig[grid](*args, **kwargs)
            return run
    mod._finish_kernel = _Spy()
    try:
        out = _run(logits, idx, *knobs, method="chunked", block_v=bv, chunk_v=cv, workspace=ws)
    finally:
        mod._finish_kernel = orig
    assert torch.equal(out, apply_top_k_top_p_min_p_ref(logits, idx, *knobs))
    slots, nc = mod.CAND_SLOTS, -(-vocab // cv)
    b, cand = seen["bracket"].cpu(), seen["cand"].cpu()
    temp, top_k, top_p, _ = knobs
    s = logits / temp[:, None]                                   # [B, V] what the kernels see
    key = _key_ref(s).to(torch.int64)
    pad = nc * cv - vocab
    checked = 0
    for r in range(num_rows):
        use_k, use_p = 0 < int(top_k[r]) < vocab, float(top_p[r]) < 1.0
        need_k = use_k and int(b[r, 1] - b[r, 0]) > 1
        need_p = use_p and int(b[r, 3] - b[r, 2]) > 1
        if not (need_k or need_p):
            continue
        lo = min(int(b[r, 0]) if need_k else 2**31, int(b[r, 2]) if need_p else 2**31)
        counts = cand[r, :, 0].view(torch.int32)                                 # [NC]
        # the skip rule, from the block maxima (the bracket's lo is the init's)
        lo_c = min(int(b[r, 0]) if use_k else 2**31, int(b[r, 2]) if use_p else 2**31)
        bmax = torch.cat([s[r], torch.full((pad,), NEG_INF)]).view(-1, bv).amax(1)
        if 2 * int((_key_ref(bmax).to(torch.int64) > lo_c).sum()) > nc * (cv // bv):
            assert (counts == slots + 1).all(), r
            continue
        for c in range(nc):
            sel = torch.nonzero(key[r, c * cv:(c + 1) * cv] > lo).flatten() + c * cv
            assert int(counts[c]) == len(sel), (r, c)
            if 0 < len(sel) <= slots:
                n = len(sel)
                assert torch.equal(cand[r, c, 1:1 + n].view(torch.int32).to(torch.int64),
                                   key[r, sel]), (r, c)
                assert torch.equal(cand[r, c, 1 + slots:1 + slots + n], s[r, sel]), (r, c)
                checked += 1
    assert checked >= 5                     # chunks whose slots were compared (7 here)
    assert (cand[4, :, 0].view(torch.int32) == slots + 1).all()   # the flat row: skipped
