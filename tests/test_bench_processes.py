"""scripts/bench_processes.py: variants parsed, figures read from both bench kinds, medians and
ratios, and one real round of the tiny model in fresh processes."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
try:
    import bench_processes
finally:
    sys.path.pop(0)


def test_variants_parse_and_bad_ones_are_named():
    assert bench_processes.parse_variant("base=") == ("base", [])
    assert bench_processes.parse_variant('on=--set "m:A=[1, 2]" --set m:B=true') == \
        ("on", ["--set", "m:A=[1, 2]", "--set", "m:B=true"])
    with pytest.raises(ValueError, match="NAME=ARGS"):
        bench_processes.parse_variant("no-equals")


def test_figures_of_latency_and_throughput_results():
    lat = {"runners": {"v2": {"batches": [{"batch_size": 1, "tpot_ms": 0.7, "ttft_ms": 2.0}]},
                       "v1": {"error": "boom"}}}
    assert bench_processes.figures(lat) == {"v2/b1/tpot_ms": 0.7, "v2/b1/ttft_ms": 2.0}
    thr = {"runners": {"v2": {"output_tok_s": 9.0}, "v1": {"output_tok_s": 6.0}}}
    assert bench_processes.figures(thr) == {"v2/output_tok_s": 9.0, "v1/output_tok_s": 6.0}
    dec = {"profile": {"points": [{"batch": 64, "context": 192, "gpu_ms_per_step": 1.5,
                                   "kernels_per_step": 294.0}]}}
    assert bench_processes.figures(dec) == {"decode/b64/c192/gpu_ms": 1.5,
                                            "decode/b64/c192/kernels": 294.0}


def test_medians_and_ratios_to_the_first_variant():
    rep = bench_processes.summarize({"a": {"figures": {"x": [1.0, 3.0, 2.0]}},
                                     "b": {"figures": {"x": [1.0, 1.0, 1.5]}}})
    assert rep["variants"]["a"]["median"] == {"x": 2.0}
    assert rep["ratios"] == {"a": {"x": 1.0}, "b": {"x": 0.5}}


def test_bad_command_lines_exit_2(capsys):
    assert bench_processes.main(["--out", "x.json"]) == 2                     # no --
    assert bench_processes.main(["--out", "x", "--", "bench", "latency", "--out", "y"]) == 2
    assert bench_processes.main(["--out", "x", "--variant", "a=", "--variant", "a=", "--",
                                 "bench", "latency"]) == 2
    assert "error" in capsys.readouterr().err


@pytest.mark.slow
def test_one_round_of_the_tiny_model_in_fresh_processes(tmp_path):
    out = tmp_path / "p.json"
    assert bench_processes.main(["--rounds", "1", "--out", str(out), "--variant", "base=",
                                 "--variant", "pdl-off=--set mrv2.kernels.pdl:PDL_ENABLED=false",
                                 "--", "bench", "latency", "--tiny", "--runner", "v2",
                                 "--batch-sizes", "1"]) == 0
    rep = json.loads(out.read_text())
    assert set(rep["variants"]) == {"base", "pdl-off"}
    assert len(rep["variants"]["base"]["figures"]["v2/b1/tpot_ms"]) == 1
    assert rep["ratios"]["base"]["v2/b1/tpot_ms"] == 1.0
    assert rep["hardware"]["device"] in ("cpu", "cuda")
