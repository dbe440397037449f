"""scripts/standard_steps.py: its step accounting on hand-made steps, and a CPU smoke run."""


import pytest
from script_loader import load_script


def _script():
    return load_script("standard_steps")


def test_summarize_splits_prefill_and_decode_and_buckets_by_batch():
    s = _script()
    recs = [{"step": 0, "tokens": 100, "reqs": 4, "ctx": 100},     # prefill
            {"step": 1, "tokens": 40, "reqs": 40, "ctx": 4000},    # decode, 40 requests
            {"step": 2, "tokens": 70, "reqs": 70, "ctx": 7000},    # decode, 70 requests
            {"step": 3, "tokens": 0, "reqs": 0, "ctx": 0},         # empty: skipped
            {"step": 4, "tokens": 300, "reqs": 300, "ctx": 300}]   # no GPU span: skipped
    gpu = {0: (0.0, 5.0), 1: (5.0, 6.5), 2: (6.5, 9.0), 3: (9.0, 9.1)}
    info = {"weight_bytes": 1_192_099_840, "kv_bytes_per_token": 114_688}  # Qwen3-0.6B bf16
    tot, buckets = s.summarize(recs, gpu, info, bandwidth_gbs=4240.0)
    assert (tot["prefill_steps"], tot["prefill_gpu_ms"]) == (1, 5.0)
    assert (tot["decode_steps"], tot["decode_gpu_ms"]) == (2, 4.0)
    roof = lambda ctx: (1_192_099_840 + ctx * 114_688) / 4.24e12 * 1e3  # bytes / (bytes/s)
    assert tot["decode_roofline_ms"] == pytest.approx(roof(4000) + roof(7000))
    assert list(buckets) == [32, 64]
    assert buckets[64]["steps"] == 1 and buckets[64]["gpu_ms"] == pytest.approx(2.5)
    assert buckets[32]["mean_ctx"] == pytest.approx(100.0)


@pytest.mark.slow
def test_tiny_run_records_every_step(tmp_path):
    res = _script().main(["--tiny", "--out", str(tmp_path / "s.json")])
    assert res["run"]["output_tokens"] > 0
    assert sum(r["tokens"] for r in res["recs"]) >= res["run"]["output_tokens"]
    assert any(r["tokens"] > r["reqs"] for r in res["recs"])  # the prefills are seen


def test_set_assigns_a_knob_before_the_run_and_refuses_a_typo(tmp_path, monkeypatch):
    from mrv2.kernels import attention
    s = _script()
    rule = '[{"lo": 1, "hi": 8, "keys": 64}]'
    monkeypatch.setattr(attention, "DECODE_PARTITIONS", [])
    seen = {}

    def build_llm(*args, **kwargs):  # the knob as the run would see it, then stop
        seen["rules"] = list(attention.DECODE_PARTITIONS)
        raise RuntimeError("stop")
    monkeypatch.setattr(s.llm_runs, "build_llm", build_llm)
    with pytest.raises(RuntimeError, match="stop"):
        s.main(["--tiny", "--out", str(tmp_path / "s.json"),
                "--set", f"mrv2.kernels.attention:DECODE_PARTITIONS={rule}"])
    assert seen["rules"] == [{"lo": 1, "hi": 8, "keys": 64}]
    with pytest.raises(ValueError, match="no attribute"):
        s.main(["--tiny", "--out", str(tmp_path / "s.json"),
                "--set", "mrv2.kernels.attention:NO_SUCH_KNOB=1"])
