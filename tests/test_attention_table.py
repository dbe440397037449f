"""The decode-attention launch table: its chooser, its validation, and every launch it holds
(each distinct split count / key block) against the torch reference on the CPU."""

import json

import pytest
import torch
from script_loader import load_script
from test_kernels_attention import make_batch

from mrv2.kernels import attention
from mrv2.kernels.attention import paged_attention, paged_attention_ref
from mrv2.kernels.attention_table import (
    GRID_BATCH,
    GRID_CONTEXT,
    choose_decode_config,
    default_table,
    heuristic_decode_config,
    load_table,
    validate_table,
)


def _table():
    return {"num_sms": 132, "num_kv_heads": 8, "entries": [
        {"batch": b, "context": c, "num_splits": 8 // b if b < 8 else 1,
         "block_n": 32 if c < 1024 else 64, "num_warps": 4, "num_stages": 2 + (b > 4)}
        for b in (1, 4, 16) for c in (128, 1024)]}


def test_committed_table_is_valid_and_covers_the_grid():
    table = load_table()
    assert table is not None and table["num_kv_heads"] >= 1
    points = {(e["batch"], e["context"]) for e in table["entries"]}
    assert points >= {(b, c) for b in GRID_BATCH for c in GRID_CONTEXT}


def test_default_table_is_the_heuristic_at_every_grid_point():
    table = default_table(num_sms=132, num_kv_heads=8)
    for e in table["entries"]:
        cfg = heuristic_decode_config(e["batch"], e["context"], 8, 132)
        assert {k: e[k] for k in cfg} == cfg
    # batch 1, context 4096: 8 programs on 132 SMs -> split, parts of >= 512 keys
    one = next(e for e in table["entries"] if (e["batch"], e["context"]) == (1, 4096))
    assert one["num_splits"] == 8 and (one["num_warps"], one["num_stages"]) == (4, 2)


def test_chooser_takes_the_grid_point_at_or_below():
    t = _table()
    assert choose_decode_config(4, 1024, 8, t) == {"num_splits": 2, "block_n": 64,
                                                   "num_warps": 4, "num_stages": 2}
    assert choose_decode_config(15, 4000, 8, t)["num_stages"] == 2      # -> (4, 1024)
    assert choose_decode_config(16, 1023, 8, t)["block_n"] == 32        # -> (16, 128)
    assert choose_decode_config(1, 1, 8, t)["num_splits"] == 1          # capped: one key tile
    assert choose_decode_config(1, 100, 8, t)["num_splits"] == 4        # 100 keys: 4 tiles of 32
    assert choose_decode_config(1000, 10**6, 8, t)["num_stages"] == 3   # above: the largest
    # KV heads: 8 requests x 4 KV heads are the programs of 4 x 8
    assert choose_decode_config(8, 1024, 4, t) == choose_decode_config(4, 1024, 8, t)
    # a sparse table: the nearest entry
    sparse = {**t, "entries": [e for e in t["entries"] if e["batch"] != 4 or e["context"] != 128]}
    assert choose_decode_config(4, 200, 8, sparse)["block_n"] in (32, 64)


def test_bad_tables_name_the_field(tmp_path):
    with pytest.raises(ValueError, match="num_sms"):
        validate_table({"num_kv_heads": 8, "entries": []})
    bad = _table()
    bad["entries"][2]["block_n"] = 48
    with pytest.raises(ValueError, match=r"entries\[2\].block_n"):
        validate_table(bad)
    bad["entries"][2]["block_n"] = 64
    bad["entries"][0]["num_splits"] = 0
    with pytest.raises(ValueError, match=r"entries\[0\].num_splits"):
        validate_table(bad)
    path = tmp_path / "t.json"
    path.write_text(json.dumps(_table()))
    assert load_table(str(path))["entries"][0]["batch"] == 1
    assert load_table(str(tmp_path / "none.json")) is None


def test_pick_config_uses_the_table_on_its_gpu(monkeypatch):
    t = _table()
    monkeypatch.setattr(attention, "TRITON_INTERPRET", False)
    monkeypatch.setattr(attention, "load_table", lambda: t)
    monkeypatch.setattr(attention, "_num_sms", lambda: 132)
    cfg = attention._pick_config(4, 8, 2, 1, 1024)
    assert (cfg["num_splits"], cfg["block_n"], cfg["num_stages"]) == (2, 64, 2)
    monkeypatch.setattr(attention, "_num_sms", lambda: 78)               # another GPU
    assert attention._pick_config(4, 8, 2, 1, 1024)["num_splits"] == \
        heuristic_decode_config(4, 1024, 8, 78)["num_splits"]
    monkeypatch.setattr(attention, "_num_sms", lambda: 132)
    assert attention._pick_config(4, 8, 2, 3, 1024)["num_splits"] == \
        heuristic_decode_config(4, 1024, 8, 132, 3, 8)["num_splits"]    # spec decode: heuristic


def test_the_fused_decode_kernel_takes_more_splits_at_short_contexts(monkeypatch):
    """decode_attention.pick_config: at max_seq_len < SHORT_CONTEXT, 5-15 requests take 4
    splits of 64 keys and 17-32 take 2 (measured in the model), 16 and long contexts the
    table's; one request its own launch; warps and stages stay the table's."""
    from mrv2.kernels import decode_attention
    monkeypatch.setattr(attention, "TRITON_INTERPRET", False)
    monkeypatch.setattr(attention, "_num_sms", lambda: 132)
    table = attention._pick_config
    for n, splits in ((8, 4), (5, 4), (15, 4), (24, 2), (32, 2)):
        cfg = decode_attention.pick_config(n, 8, 2, 1, 256)
        assert (cfg["num_splits"], cfg["block_n"]) == (splits, 64), n
        assert (cfg["num_warps"], cfg["num_stages"]) == \
            (table(n, 8, 2, 1, 256)["num_warps"], table(n, 8, 2, 1, 256)["num_stages"])
    assert decode_attention.pick_config(16, 8, 2, 1, 256) == table(16, 8, 2, 1, 256)
    assert decode_attention.pick_config(8, 8, 2, 1, 1024) == table(8, 8, 2, 1, 1024)
    assert decode_attention.pick_config(8, 8, 2, 1, 100)["num_splits"] == 2   # 2 key tiles
    assert decode_attention.pick_config(1, 8, 2, 1, 256)["num_splits"] == 4   # ONE_REQUEST


def test_every_launch_in_the_table_matches_the_reference():
    table = load_table()
    choices = sorted({(e["num_splits"], e["block_n"]) for e in table["entries"]})
    for splits, block_n in choices:
        # contexts: one key, one partial tile, and enough for every split (some empty)
        reqs = [(0, 1), (16, 1), (splits * block_n + 4, 1)]
        q, kv_cache, md = make_batch(reqs, num_heads=4, num_kv_heads=2, head_dim=16, seed=splits)
        ref = paged_attention_ref(q, kv_cache, md, 0.25)
        out = paged_attention(q, kv_cache, md, 0.25,
                              config={"num_splits": splits, "block_n": block_n})
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


def test_sweep_script_smoke_writes_a_valid_table(tmp_path):
    sweep = _sweep_module()
    table_path = tmp_path / "table.json"
    res = sweep.main(["--smoke", "--out", str(tmp_path / "s.json"), "--write-table",
                      "--table-out", str(table_path)])
    assert [(p["batch"], p["context"]) for p in res["points"]] == [(1, 40), (2, 130)]
    assert all(p["us"] > 0 and p["max_abs_diff_vs_heuristic"] < 1e-5 for p in res["points"])
    table = load_table(str(table_path))
    assert len(table["entries"]) == len(GRID_BATCH) * len(GRID_CONTEXT)


def _sweep_module():
    return load_script("sweep_decode_attention")


def test_sweep_wide_candidates_have_small_tiles_and_few_splits_at_large_batches():
    sweep = _sweep_module()
    big = sweep.candidates(128, quick=False, smoke=False, wide_batch=256)
    assert {c["num_splits"] for c in big} == {1, 2}
    assert any(c["block_n"] == 16 and c["num_warps"] == 1 and c["num_stages"] == 2 for c in big)
    # every split keeps at least one key tile: 40 keys in 16-key tiles allow 3 splits at most
    small = sweep.candidates(40, quick=False, smoke=False, wide_batch=1)
    assert max(c["num_splits"] for c in small if c["block_n"] == 16) == 2
    assert max(c["num_splits"] for c in small if c["block_n"] == 128) == 1


def test_sweep_update_table_keeps_the_entries_it_did_not_sweep(tmp_path):
    sweep = _sweep_module()
    table_path = tmp_path / "table.json"
    old = default_table()
    marked = next(e for e in old["entries"] if (e["batch"], e["context"]) == (4, 512))
    marked.update(num_splits=3, block_n=32, num_warps=1, num_stages=5)
    table_path.write_text(json.dumps(old))
    args = ["--smoke", "--out", str(tmp_path / "s.json"), "--write-table",
            "--table-out", str(table_path)]
    sweep.main([*args, "--update-table"])  # the smoke grid holds no table point
    kept = {(e["batch"], e["context"]): e for e in json.loads(table_path.read_text())["entries"]}
    assert (kept[(4, 512)]["num_splits"], kept[(4, 512)]["num_warps"]) == (3, 1)
    sweep.main(args)  # without --update-table: the heuristic again
    fresh = {(e["batch"], e["context"]): e for e in json.loads(table_path.read_text())["entries"]}
    assert fresh[(4, 512)]["num_warps"] != 1


def test_a_partition_rule_wins_over_the_fused_kernels_launches(monkeypatch):
    """decode_attention.pick_config applies ``attention.DECODE_PARTITIONS`` after its own
    short-context and one-request launches: a matching rule's parts, else those launches
    (with ``part_tiles`` 0, whatever the table said)."""
    from mrv2.kernels import decode_attention
    monkeypatch.setattr(attention, "TRITON_INTERPRET", False)
    monkeypatch.setattr(attention, "_num_sms", lambda: 132)
    monkeypatch.setattr(attention, "DECODE_PARTITIONS",
                        [{"lo": 8, "hi": 32, "min_seq_len": 1024, "keys": 256}])
    cfg = decode_attention.pick_config(16, 8, 2, 1, 2048)
    assert (cfg["num_splits"], cfg["part_tiles"], cfg["block_n"]) == (8, 4, 64)
    assert decode_attention.pick_config(16, 8, 2, 1, 256)["part_tiles"] == 0   # short: its own
    one = decode_attention.pick_config(1, 8, 2, 1, 2048)                       # no rule for 1
    assert (one["num_splits"], one["part_tiles"]) == (32, 0)
