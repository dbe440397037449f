"""The ``shakespeare`` benchmark workload: held-out windows of Tiny Shakespeare's validation
split, one per request (mrv2/bench/workloads.py), and its place in ``bench latency``."""

from __future__ import annotations

import pytest
from test_bench import _run_cli

import mrv2  # noqa: F401  (before transformers: Triton's interpreter mode)
from mrv2.__main__ import main
from mrv2.bench import suite
from mrv2.bench.workloads import shakespeare_workload
from mrv2.models.loader import DEFAULT_MODEL_DIR


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)


def _text(tmp_path, lines: int = 400):
    """A play of numbered lines; returns its path and its last 10% (the validation split)."""
    text = "".join(f"SPEAKER {i}:\nthe line number {i} of the play, and more words.\n"
                   for i in range(lines))
    path = tmp_path / "play.txt"
    path.write_text(text)
    return path, text[int(0.9 * len(text)):]


def test_prompts_are_distinct_line_start_windows_of_the_validation_split(tmp_path, tok):
    path, val = _text(tmp_path)
    wl = shakespeare_workload("s", 5, 12, 7, path, tok, seed=3)
    assert wl.num_requests == 5 and wl.output_lens == [7] * 5 and wl.temperature == 0.0
    assert all(len(p) == 12 for p in wl.prompts)
    assert len({tuple(p) for p in wl.prompts}) == 5           # one prompt per request
    for p in wl.prompts:
        piece = tok.decode(p)
        at = val.find(piece)
        assert at >= 0, piece                                 # held-out text, verbatim
        assert at == 0 or val[at - 1] == "\n", piece          # from a line start
    assert shakespeare_workload("s", 5, 12, 7, path, tok, seed=3).prompts == wl.prompts
    assert shakespeare_workload("s", 5, 12, 7, path, tok, seed=4).prompts != wl.prompts


def test_missing_file_and_bad_sizes_fail_clearly(tmp_path, tok):
    with pytest.raises(FileNotFoundError, match="MRV2_SHARED_DATA"):
        shakespeare_workload("s", 2, 8, 4, tmp_path / "absent.txt", tok)
    path, _ = _text(tmp_path, lines=40)
    with pytest.raises(ValueError, match="input_len"):
        shakespeare_workload("s", 2, 0, 4, path, tok)
    with pytest.raises(ValueError, match="fewer than num_requests=500"):
        shakespeare_workload("s", 500, 8, 4, path, tok)
    with pytest.raises(ValueError, match="latency workload"):
        suite.BenchConfig(kind="throughput", workload="shakespeare")


def test_the_real_text(shared_data, tok):
    """The benchmark's sizes on the real file: 8 requests of 128 tokens from its last 10%."""
    text = (shared_data / "tinyshakespeare.txt").read_text()
    val = text[int(0.9 * len(text)):]
    wl = shakespeare_workload("s", 8, 128, 128, shared_data / "tinyshakespeare.txt", tok)
    assert [len(p) for p in wl.prompts] == [128] * 8 and len(set(map(tuple, wl.prompts))) == 8
    assert all(tok.decode(p) in val for p in wl.prompts)


@pytest.mark.slow
def test_latency_tiny_shakespeare_ngram(tmp_path, shared_data, monkeypatch, capsys):
    """``bench latency --workload shakespeare`` runs (tiny sizes) with a proposer, greedy; a
    missing text file is a clean exit 2 naming the variable."""
    monkeypatch.setenv("MRV2_SHARED_DATA", str(shared_data))
    res = _run_cli(tmp_path, "latency", "--speculative", "ngram", "--workload", "shakespeare",
                   "--batch-sizes", "1")
    assert res["workload"].startswith("shakespeare (a window of tinyshakespeare.txt")
    assert res["workload_stats"]["temperature"] == 0.0
    for name in ("v2", "v2-ngram"):
        assert "error" not in res["runners"][name], res["runners"][name].get("traceback")
        assert res["runners"][name]["batches"][0]["tpot_ms"] > 0
    monkeypatch.setenv("MRV2_SHARED_DATA", str(tmp_path / "nowhere"))
    out = tmp_path / "r2.json"
    code = main(["bench", "latency", "--tiny", "--workload", "shakespeare", "--out", str(out)])
    assert code == 2 and "MRV2_SHARED_DATA" in capsys.readouterr().out
