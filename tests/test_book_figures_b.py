"""mrv2.bench.book_figures_b: the newest result is picked by what the JSON holds, and labelled."""

from __future__ import annotations

import json

import matplotlib
import pytest

from mrv2.bench.book_figures_b import (
    kernel_counts,
    newest_result,
    plot_decode_step_times_b,
    plot_kernels_per_step,
    plot_spec_tpot,
    provenance,
    results_dir,
    spec_tpot_ratios,
)

matplotlib.use("Agg")

GPU = {"device": "cuda", "name": "NVIDIA H200"}


def _meta(date, commit="abc1234", hardware=GPU):
    return {"date": date, "hardware": hardware, "git_commit": commit, "load_format": "dummy",
            "versions": {"torch": "x"}}


def _steps(date, **kw):
    return {"context": 128, "steps": 8, "repeats": 1, "eager": {"1": 10.0, "64": 11.0},
            "graphs": {"1": 1.0, "64": 2.0}, "meta": _meta(date, **kw)}


def _latency(date, runners=("v2", "v1"), **config):
    return {"benchmark": "latency", "date": date, "hardware": GPU, "git_commit": "def5678",
            "config": {"workload": "standard", "tiny": False, **config},
            "runners": {r: {"batches": []} for r in runners}}


def _write(folder, name, res):
    (folder / name).write_text(json.dumps(res))


def test_newest_by_the_date_inside_not_the_name(tmp_path):
    _write(tmp_path, "a_newer.json", _steps("2026-12-02T00:00:00+00:00", commit="new0001"))
    _write(tmp_path, "z_older.json", _steps("2026-11-01T00:00:00+00:00", commit="old0001"))
    path, res = newest_result("decode_steps", folder=tmp_path)
    assert path.name == "a_newer.json" and res["meta"]["git_commit"] == "new0001"
    both = {**_profile(), **_steps("2026-12-03T00:00:00+00:00")}   # bench decode --compare-eager
    _write(tmp_path, "m_both.json", both)
    assert newest_result("decode_steps", folder=tmp_path)[0].name == "m_both.json"
    assert newest_result("decode_profile", folder=tmp_path)[0].name == "m_both.json"


def test_experiment_runs_are_never_the_figure(tmp_path):
    """A variant run kept as evidence (``"experiment": true``) is skipped however new."""
    _write(tmp_path, "default.json", _latency("2026-11-01"))
    _write(tmp_path, "variant.json", {**_latency("2026-12-09"), "experiment": True})
    path, _ = newest_result("latency", workload="standard", runners=("v2",), folder=tmp_path)
    assert path.name == "default.json"


def test_other_gpus_are_evidence_not_the_figure(tmp_path):
    """The book plots the H200 (``BOOK_GPU``): a newer H100 run is kept but not plotted."""
    _write(tmp_path, "h200.json", _steps("2026-12-01T00:00:00+00:00"))
    h100 = {"device": "cuda", "name": "NVIDIA H100 80GB HBM3"}
    _write(tmp_path, "h100.json", _steps("2026-12-07T00:00:00+00:00", hardware=h100))
    assert newest_result("decode_steps", folder=tmp_path)[0].name == "h200.json"
    assert newest_result("decode_steps", folder=tmp_path, gpu_only=False)[0].name == "h100.json"


def test_latency_filters_workload_runners_speculation_graph_mode_and_cpu_runs(tmp_path):
    _write(tmp_path, "plain.json", _latency("2026-11-01"))
    _write(tmp_path, "spec.json", _latency("2026-12-05", speculative="ngram"))
    _write(tmp_path, "eager_prefill.json",
           _latency("2026-12-05", cudagraph_mode="FULL_DECODE_ONLY"))
    _write(tmp_path, "v2_only.json", _latency("2026-12-05", runners=("v2",)))
    _write(tmp_path, "other_workload.json", _latency("2026-12-05", workload="shared-prefix"))
    _write(tmp_path, "tiny.json", _latency("2026-12-06", tiny=True))
    _write(tmp_path, "broken.json", "{not json")
    want = {"kind": "latency", "workload": "standard", "runners": ("v2", "v1")}
    assert newest_result(**want, folder=tmp_path)[0].name == "plain.json"
    assert newest_result(**want, folder=tmp_path, gpu_only=False)[0].name == "tiny.json"
    assert newest_result("latency", workload="standard", runners=("v2",), speculative=True,
                         folder=tmp_path)[0].name == "spec.json"
    assert newest_result("throughput", folder=tmp_path) == (None, None)
    with pytest.raises(ValueError, match="kind must be one of"):
        newest_result("serve", folder=tmp_path)


def test_provenance_prefers_the_top_level_commit():
    res = {"meta": _meta("2026-12-01T17:00:33+00:00", commit="8359b84a70cb"),
           "git_commit": "0125184"}
    assert provenance(res) == "NVIDIA H200 · 2026-12-01 · commit 0125184"
    want = "NVIDIA H200 · 2026-11-29 · commit def5678"
    assert provenance(_latency("2026-11-29T15:38:29")) == want


def _profile():
    kernels = [{"name": "void at::native::fill<float>(int, float)", "launches_per_step": 4.0},
               {"name": "_rms_norm_kernel", "launches_per_step": 5.0},
               {"name": "gemm", "launches_per_step": 2.0},
               {"name": "_gumbel_block_argmax_kernel", "launches_per_step": 1.0}]
    return {"profile": {"model_info": {"num_layers": 2},
                        "points": [{"batch": 1, "context": 10, "kernels_per_step": 12.0,
                                    "kernels": kernels}]},
            "meta": _meta("2026-12-01")}


def test_kernel_counts_per_layer():
    counts = kernel_counts(_profile(), batch=1)
    assert counts["total"] == 12.0
    assert counts["per_layer"] == 2 + 2 + 1          # 4 // 2 + 5 // 2 + 2 // 2; 1 < 2 layers
    with pytest.raises(ValueError, match="no point of batch 8"):
        kernel_counts(_profile(), batch=8)


def test_figures_are_labelled_with_hardware_date_and_commit():
    ax = plot_kernels_per_step(_profile())
    assert ax.get_title().startswith("NVIDIA H200 · 2026-12-01 · commit abc1234")
    assert [t.get_text() for t in ax.get_yticklabels()][-1] == "fill"   # templates stripped
    ax = plot_decode_step_times_b(_steps("2026-11-29T14:54:52+00:00"))
    assert "NVIDIA H200 · 2026-11-29 · commit abc1234" in ax.get_title()


def test_the_committed_results_have_the_book_figures():
    for kind in ("decode_steps", "decode_profile"):
        path, res = newest_result(kind, folder=results_dir())
        assert path is not None, kind
        assert provenance(res).startswith("NVIDIA H200")


def test_spec_tpot_ratios_divide_by_the_plain_runner_of_the_same_batch():
    res = {"config": {"num_speculative_tokens": 3}, "runners": {
        "v2": {"batches": [{"batch_size": 1, "tpot_ms": 2.0}, {"batch_size": 8, "tpot_ms": 4.0}]},
        "v2-ngram": {"batches": [{"batch_size": 1, "tpot_ms": 1.0,
                                  "spec_decode": {"mean_accepted_length": 3.5}},
                                 {"batch_size": 8, "tpot_ms": 3.0}]},
        "v2-ngram-sync": {"batches": [{"batch_size": 1, "tpot_ms": 1.5}]}}}
    assert spec_tpot_ratios(res) == {"ngram": {1: (0.5, 3.5), 8: (0.75, None)}}
    ax = plot_spec_tpot([res])
    assert [t.get_text() for t in ax.get_xticklabels()] == ["n-gram\nK=3\nb1", "n-gram\nK=3\nb8"]
