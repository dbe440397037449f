"""The book's GPU figures: the newest committed result is the one plotted, labelled from the file."""

from __future__ import annotations

import json
import subprocess

import matplotlib
import pytest

from mrv2.bench.book_plots import (
    REPO_ROOT,
    newest_result,
    plot_attention_decode,
    plot_sampler,
    result_label,
    result_meta,
)

matplotlib.use("Agg")

SAMPLER_ROW = {"num_rows": 4, "vocab": 1000, "dtype": "float32", "temperature": 0.6,
               "top_k": -1, "top_p": 1.0, "triton_us": 10.0, "torch_us": 30.0, "speedup": 3.0}
ATTN_CASE = {"num_reqs": 2, "ctx": 64, "kv_bytes": 1000, "us": 1.0, "tbs": 1.5,
             "frac_of_copy": 0.5}


def _sampler(date, commit=None, smoke=False, triton_us=10.0):
    res = {"date": date, "hardware": "GPU X", "smoke": smoke,
           "results": [dict(SAMPLER_ROW, triton_us=triton_us)]}
    if commit:
        res["git_commit"] = commit
    return res


def _write(folder, name, res):
    (folder / name).write_text(json.dumps(res))


def test_newest_result_by_date_skipping_smoke_runs_and_other_kinds(tmp_path):
    _write(tmp_path, "a.json", _sampler("2026-11-29T11:00:00"))
    _write(tmp_path, "b.json", _sampler("2026-11-30T09:00:00"))
    _write(tmp_path, "c.json", _sampler("2026-12-02T09:00:00", smoke=True))       # a CPU smoke run
    _write(tmp_path, "d.json", {"date": "2026-12-03", "benchmark": "paged decode attention",
                                "cases": [ATTN_CASE], "copy_tbs": 3.0})          # another kind
    (tmp_path / "e.json").write_text("{not json")
    path, res = newest_result("sampler", tmp_path)
    assert path.name == "b.json" and res["date"] == "2026-11-30T09:00:00"
    assert newest_result("attention_decode", tmp_path)[0].name == "d.json"
    assert newest_result("sampler", tmp_path / "missing") is None
    with pytest.raises(ValueError, match="kind must be one of"):
        newest_result("throughput", tmp_path)


def _two_commits():
    try:
        out = subprocess.run(["git", "log", "--format=%h", "-2"], cwd=REPO_ROOT,
                             capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        pytest.skip("no git history here")
    commits = out.stdout.split()
    if len(commits) < 2:
        pytest.skip("fewer than two commits")
    return commits  # newest first


def test_on_one_day_the_run_of_the_later_commit_wins(tmp_path):
    new, old = _two_commits()
    # A job that measures the tree after a change, then the tree before it.
    _write(tmp_path, "after.json", _sampler("2026-12-01T16:55:48", commit=new))
    _write(tmp_path, "before.json", _sampler("2026-12-01T16:56:00", commit=old))
    assert newest_result("sampler", tmp_path)[0].name == "after.json"
    # A later day wins whatever the commit.
    _write(tmp_path, "later.json", _sampler("2026-12-02T08:00:00", commit=old))
    assert newest_result("sampler", tmp_path)[0].name == "later.json"


def test_labels_come_from_the_file_in_either_layout():
    flat = {"hardware": "NVIDIA H200", "date": "2026-11-29T10:58:13+00:00",
            "git_commit": "efae9ac1234"}
    nested = {"meta": {"hardware": {"name": "NVIDIA H100"}, "date": "2026-12-01T00:00:00",
                       "git_commit": "0125184"}}
    assert result_label(flat) == "NVIDIA H200, 2026-11-29, commit efae9ac"
    assert result_label(nested) == "NVIDIA H100, 2026-12-01, commit 0125184"
    assert result_label({"hardware": "X", "date": "2026-01-02", "git_commit": "unknown"}) == (
        "X, 2026-01-02, commit not recorded")
    assert result_meta({}) == {"hardware": None, "date": None, "commit": None}


def test_the_figures_carry_the_label_and_one_bar_per_measurement():
    import matplotlib.pyplot as plt

    attn = {"hardware": "GPU X", "date": "2026-11-29", "git_commit": "abc1234",
            "dtype": "bfloat16", "shape": {"num_heads": 16, "num_kv_heads": 8},
            "copy_tbs": 3.0, "cases": [ATTN_CASE, dict(ATTN_CASE, num_reqs=8, tbs=2.5)]}
    ax = plot_attention_decode(attn)
    assert "GPU X, 2026-11-29, commit abc1234" in ax.get_title()
    assert [round(p.get_height(), 2) for p in ax.patches] == [1.5, 2.5]
    samp = _sampler("2026-12-01", commit="abc1234")
    ax = plot_sampler(samp)
    assert "GPU X, 2026-12-01, commit abc1234" in ax.get_title()
    assert sorted(p.get_height() for p in ax.patches) == [10.0, 30.0]
    assert any(t.get_text() == "3.00x" for t in ax.texts)
    plt.close("all")


def test_skinny_chain_figure_one_bar_per_runner_and_rows():
    from mrv2.bench.book_plots import KINDS, plot_skinny_chain

    res = {"date": "2026-12-01T21:47:00", "hardware": "NVIDIA H200", "git_commit": "abc1234",
           "alone": [], "chain": [{"M": m, "runner": r, "us_per_step": us, "weight_mb": 881.0}
                                  for m, r, us in ((1, "cublas", 800.0), (1, "skinny", 500.0),
                                                   (8, "cublas", 700.0), (8, "skinny", 2800.0))]}
    assert KINDS["skinny_gemm"](res) and not KINDS["sampler"](res)
    ax = plot_skinny_chain(res)
    heights = sorted(p.get_height() for p in ax.patches)
    assert heights == [500.0, 700.0, 800.0, 2800.0]
    texts = {t.get_text() for t in ax.texts}
    assert {"0.62x", "4.00x"} <= texts and "NVIDIA H200, 2026-12-01, commit abc1234" in ax.get_title()
