"""Folded KV heads in decode attention: ``kv_fold`` heads of a request in one program.

The compiled kernel takes one KV head a program unless a launch (the table, a caller's
``config``, ``bench_with --paged-launch``) asks for a fold; ``attention_table.fold_rows``
then sizes the program's query rows. Checked here: the row arithmetic, the table's field,
the launch choice, and the kernel against ``paged_attention_ref`` with folds of 2, 4 and 8
(on tile and page boundaries, padding, splits, both loop forms)."""

import json

import pytest
import torch
from script_loader import load_script
from test_kernels_attention import make_batch

from mrv2.kernels import attention
from mrv2.kernels.attention import paged_attention, paged_attention_ref
from mrv2.kernels.attention_table import choose_decode_config, fold_rows, validate_table
from mrv2.platform import HAS_CUDA

#: Decodes at 1 key, around the page (16) and key-tile (16 / 32) boundaries, and a long one.
DECODES = [(0, 1), (14, 1), (15, 1), (16, 1), (31, 1), (32, 1), (95, 1), (200, 1)]


def _table(**entry):
    base = {"batch": 1, "context": 128, "num_splits": 1, "block_n": 32, "num_warps": 4,
            "num_stages": 2}
    return {"num_sms": 132, "num_kv_heads": 8, "entries": [{**base, **entry}]}


@pytest.mark.parametrize("fold, group_pad, q_len, block_q", [
    (8, 2, 1, 1), (4, 2, 1, 2), (2, 2, 1, 4), (2, 1, 1, 8), (8, 1, 1, 2), (8, 2, 3, 4),
    (16, 2, 1, 1)])
def test_fold_rows_gives_tl_dot_its_16_rows_with_the_fewest_tokens(fold, group_pad, q_len,
                                                                   block_q):
    cfg = fold_rows({"kv_fold": fold, "block_q": 99}, q_len, group_pad, 16)
    assert cfg["block_q"] == block_q
    assert cfg["block_q"] * fold * group_pad >= 16


def test_fold_rows_leaves_unfolded_prefill_and_given_rows_alone():
    assert fold_rows({"block_q": 8}, 1, 2, 8) == {"block_q": 8}                  # no fold
    assert fold_rows({"kv_fold": 1, "block_q": 8}, 1, 2, 8)["block_q"] == 8
    assert fold_rows({"kv_fold": 4, "block_q": 32}, 64, 2, 8)["block_q"] == 32   # prefill
    assert fold_rows({"kv_fold": 4, "block_q": 8}, 1, 2, 8, refit=False)["block_q"] == 8


@pytest.mark.parametrize("fold, heads", [(3, 8), (0, 8), (16, 8), (4, 6)])
def test_fold_rows_refuses_a_fold_that_does_not_divide_the_heads(fold, heads):
    with pytest.raises(ValueError, match=f"kv_fold {fold} must be a power of two dividing"):
        fold_rows({"kv_fold": fold}, 1, 2, heads)


def test_table_entries_may_carry_a_fold():
    assert validate_table(_table(kv_fold=8))["entries"][0]["kv_fold"] == 8
    for bad in (3, 0, "2", 1.0):
        with pytest.raises(ValueError, match="kv_fold must be a power of two"):
            validate_table(_table(kv_fold=bad))
    assert "kv_fold" not in choose_decode_config(1, 128, 8, _table())     # none: none given
    assert choose_decode_config(1, 128, 8, _table(kv_fold=8))["kv_fold"] == 8
    assert choose_decode_config(2, 128, 4, _table(kv_fold=8))["kv_fold"] == 4   # 4 heads
    assert choose_decode_config(4, 128, 2, _table(kv_fold=8))["kv_fold"] == 2
    assert choose_decode_config(2, 128, 6, _table(kv_fold=8))["kv_fold"] == 2   # 6 = 2 x 3


def test_pick_config_takes_the_tables_fold_with_its_rows(monkeypatch):
    monkeypatch.setattr(attention, "TRITON_INTERPRET", False)
    monkeypatch.setattr(attention, "load_table", lambda: _table(kv_fold=8))
    monkeypatch.setattr(attention, "_num_sms", lambda: 132)
    cfg = attention._pick_config(1, 8, 2, 1, 128)
    assert (cfg["kv_fold"], cfg["block_q"], cfg["block_n"]) == (8, 1, 32)
    unfolded = attention._pick_config(1, 8, 2, 2, 128)     # 2-token queries: the heuristic
    assert (unfolded["kv_fold"], unfolded["block_q"]) == (1, 8)


@pytest.mark.parametrize("fold", [2, 4, 8])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("one_loop", [True, False])
def test_folded_decode_matches_the_reference(fold, num_splits, one_loop, monkeypatch):
    """8 KV heads, GQA 2 (Qwen3-0.6B's group); padding requests and tokens whose NaN query
    and pages would show any stray read; the interpreter's one masked loop and the GPU's two
    loops (full tiles, then the causal one)."""
    monkeypatch.setattr(attention, "_ONE_LOOP", one_loop)
    q, kv_cache, md = make_batch(DECODES, 16, 8, 16, num_pad_reqs=1, num_pad_tokens=2,
                                 seed=fold)
    expected = paged_attention_ref(q, kv_cache, md, 0.25)
    for block_n in (16, 32):
        cfg = {"kv_fold": fold, "block_n": block_n, "num_splits": num_splits}
        got = paged_attention(q, kv_cache, md, 0.25, config=cfg)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        assert (got[len(DECODES):] == 0).all()              # uncovered padding tokens: zero


def test_a_fold_serves_spec_decode_and_prefill_steps_too():
    """Queries of 3 tokens refit the rows (4 tokens x 4 heads), a prefill keeps its own."""
    reqs = [(40, 3), (0, 3), (17, 2), (0, 24), (9, 1)]
    q, kv_cache, md = make_batch(reqs, 16, 8, 16, seed=5)
    expected = paged_attention_ref(q, kv_cache, md, 0.25)
    got = paged_attention(q, kv_cache, md, 0.25, config={"kv_fold": 4, "block_n": 16})
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_a_bad_fold_is_refused_before_any_work():
    q, kv_cache, md = make_batch([(5, 1)], 12, 6, 16)
    out = torch.full_like(q, 7.0)
    with pytest.raises(ValueError, match="kv_fold 4 must be a power of two dividing"):
        paged_attention(q, kv_cache, md, 0.25, out, config={"kv_fold": 4})
    assert (out == 7.0).all()


def test_an_empty_batch_with_a_fold_returns_its_buffer():
    q, kv_cache, md = make_batch([], 16, 8, 16, num_pad_tokens=2)
    out = torch.full_like(q, 3.0)
    assert paged_attention(q, kv_cache, md, 0.25, out, config={"kv_fold": 8}) is out
    assert (out == 3.0).all()


def test_bench_with_paged_launch_folds_with_its_rows(monkeypatch):
    bw = load_script("bench_with")
    monkeypatch.setattr(attention, "_pick_config", attention._pick_config)
    before = attention._pick_config(16, 8, 2, 1, 160)
    bw.override_paged_launch({"lo": 64, "hi": 256, "kv_fold": 8, "block_n": 16})
    got = attention._pick_config(256, 8, 2, 1, 160)
    assert (got["kv_fold"], got["block_q"], got["block_n"]) == (8, 1, 16)
    assert attention._pick_config(16, 8, 2, 1, 160) == before        # outside lo-hi


def test_sweep_fold_candidates_start_with_the_tables_launch(tmp_path):
    sweep = load_script("sweep_decode_attention")
    base = {"num_splits": 1, "block_n": 64, "num_warps": 2, "num_stages": 3}
    cands = sweep.fold_candidates(256, 96, base)
    assert cands[0] == base
    assert {c["kv_fold"] for c in cands[1:]} == {2, 4, 8}
    assert all(c["num_splits"] <= -(-96 // c["block_n"]) for c in cands)
    res = sweep.main(["--smoke", "--fold", "--out", str(tmp_path / "s.json"),
                      "--write-table", "--table-out", str(tmp_path / "t.json")])
    assert all(p["max_abs_diff_vs_heuristic"] < 1e-5 for p in res["points"])
    assert all(any(t.get("kv_fold") == 2 for t in p["timings"]) for p in res["points"])
    validate_table(json.loads((tmp_path / "t.json").read_text()))


@pytest.mark.skipif(not HAS_CUDA, reason="bf16 on the GPU only")
@pytest.mark.parametrize("fold", [2, 4, 8])
def test_folded_decode_bf16_cuda(fold):
    """The compiled launches ``--fold`` sweeps, at Qwen3-0.6B's head shape, in bf16."""
    reqs = [(c, 1) for c in (0, 15, 16, 63, 64, 95, 127, 500)]
    q, kv_cache, md = make_batch(reqs, 16, 8, 128, dtype=torch.bfloat16, device="cuda",
                                 seed=fold)
    expected = paged_attention_ref(q, kv_cache, md, 128 ** -0.5)
    for block_n, warps, stages in ((16, 8, 2), (16, 8, 3), (32, 4, 2)):
        for splits in (1, 2):
            cfg = {"kv_fold": fold, "block_n": block_n, "num_warps": warps,
                   "num_stages": stages, "num_splits": splits}
            got = paged_attention(q, kv_cache, md, 128 ** -0.5, config=cfg)
            torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2)


def test_a_mixed_context_batch_for_the_sweeps():
    """``bench_attention.decode_batch(spread=...)``: contexts drawn around ``ctx`` (bounds
    kept, ``max_seq_len`` the longest), the same batch for a seed; 0 keeps one context."""
    ba = load_script("bench_attention")
    q, kv, md = ba.decode_batch(64, 40, 4, 2, 16, 16, torch.float32, seed=3, spread=0.5)
    lens = md.seq_lens.tolist()
    assert min(lens) >= 20 and max(lens) <= 60 and len(set(lens)) > 10
    assert md.max_seq_len == max(lens) and md.block_table.shape[1] == -(-max(lens) // 16)
    again = ba.decode_batch(64, 40, 4, 2, 16, 16, torch.float32, seed=3, spread=0.5)[2]
    assert again.seq_lens.tolist() == lens
    assert set(ba.decode_batch(4, 40, 4, 2, 16, 16, torch.float32)[2].seq_lens.tolist()) == {40}
    with pytest.raises(ValueError, match="spread must be in"):
        ba.decode_batch(4, 40, 4, 2, 16, 16, torch.float32, spread=1.0)
    expected = paged_attention_ref(q, kv, md, 0.25)
    got = paged_attention(q, kv, md, 0.25, config={"kv_fold": 2, "block_n": 16})
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
