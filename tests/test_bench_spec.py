"""The benchmark with speculative decoding: variants, acceptance counts, spec workloads
(split from test_bench.py, whose helpers it uses)."""

from __future__ import annotations

import os
import types

import pytest
from test_bench import _run_cli

import mrv2  # noqa: F401  (before transformers: Triton's interpreter mode)
from mrv2.__main__ import main
from mrv2.bench import llm_runs, suite
from mrv2.bench import spec as spec_bench
from mrv2.bench.workloads import make_workload, random_workload


def test_latency_tiny_speculative_ngram_three_rows(tmp_path):
    """``--speculative ngram --sync-accepted-counts``: v2 without speculation, with it, and
    with the sync, in one job, on the embedded model's own loop (greedy): the n-gram drafts
    are real, so acceptance is > 0; the counts are those of the timed runs."""
    res = _run_cli(tmp_path, "latency", "--speculative", "ngram", "--num-speculative-tokens",
                   "3", "--sync-accepted-counts", "--workload", "repetitive")
    assert list(res["runners"]) == ["v2", "v2-ngram", "v2-ngram-sync"]
    assert res["workload"].startswith("repetitive (the embedded model's own greedy loop")
    assert res["workload_stats"]["temperature"] == 0.0
    runners = res["runners"]
    assert runners["v2"]["settings"]["speculative_config"] is None
    assert runners["v2-ngram"]["settings"]["speculative_config"]["sync_accepted_counts"] is False
    assert runners["v2-ngram-sync"]["settings"]["speculative_config"]["sync_accepted_counts"]
    for name in runners:
        assert "error" not in runners[name], runners[name].get("traceback")
        for row in runners[name]["batches"]:
            assert row["tpot_ms"] > 0 and row["triton_compiles"] == 0
            s = row["spec_decode"]
            if name == "v2":
                assert s is None
                continue
            assert 0 < s["num_accepted_tokens"] <= s["num_draft_tokens"] <= s["num_draft_slots"]
            assert s["num_draft_slots"] <= 3 * s["num_spec_steps"]
            assert sum(s["accepted_length_histogram"]) == s["num_spec_steps"]
            assert s["mean_accepted_length"] == pytest.approx(
                1 + s["num_accepted_tokens"] / s["num_spec_steps"])
            assert len(s["acceptance_per_position"]) == 3
    for pair in ("v2-ngram/v2", "v2-ngram-sync/v2", "v2-ngram-sync/v2-ngram"):
        assert set(res["ratios"][pair]["tpot"]) == {"1", "2"}, pair
    assert any("SpecDecodeStats" in n for n in res["notes"])


@pytest.mark.slow
def test_throughput_tiny_speculative_draft_model(tmp_path):
    res = _run_cli(tmp_path, "throughput", "--speculative", "draft_model", "--workload",
                   "repetitive", "--num-requests", "2")
    plain, spec = res["runners"]["v2"], res["runners"]["v2-draft_model"]
    assert "error" not in spec, spec.get("traceback")
    assert plain["output_tokens"] == spec["output_tokens"] == 2 * 6
    assert plain["spec_decode"] is None and spec["spec_decode"]["num_spec_steps"] > 0
    assert spec["settings"]["speculative_config"]["model"].endswith(
        "tiny-qwen3-shakespeare-draft")
    assert res["ratios"]["v2-draft_model/v2"] == pytest.approx(
        spec["output_tok_s"] / plain["output_tok_s"])


@pytest.mark.parametrize("args, match", [
    (["--sync-accepted-counts"], "sync_accepted_counts needs speculative"),
    (["--num-speculative-tokens", "2"], "num_speculative_tokens needs speculative"),
    (["--speculative", "ngram", "--runner", "v1"], "needs the v2 runner"),
    (["--speculative", "ngram", "--num-speculative-tokens", "0"], "must be >= 1"),
])
def test_bad_speculative_options_exit_2(tmp_path, capsys, args, match):
    assert main(["bench", "latency", "--tiny", *args, "--out", str(tmp_path / "r.json")]) == 2
    assert match in capsys.readouterr().out


def test_draft_model_with_another_model_needs_a_draft_path():
    from mrv2.bench.llm_runs import ModelSpec

    cfg = suite.BenchConfig(kind="latency", runners=["v2"], speculative="draft_model")
    with pytest.raises(ValueError, match="needs --draft-model"):
        suite.spec_variants(cfg, ModelSpec("/some/model"))


def test_spec_counts_are_diffed_around_the_timed_run():
    """``generate_timed`` reports only what the runner's stats counted inside the run (the
    stats object lives on across runs), and the derived figures follow from the counts."""
    from mrv2.spec_decode.metrics import SpecDecodeStats

    stats = SpecDecodeStats(3)
    stats.observe(3, 3, 3)                              # an earlier run (a warm-up)
    out = types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=[1] * 5)],
                                num_cached_tokens=0)

    def generate(requests, params, use_tqdm):
        for a in (0, 1, 3, 1):                          # four request-steps, a accepted each
            stats.observe(3, 3, a)
        return [out]

    llm = types.SimpleNamespace(engine=types.SimpleNamespace(num_steps=0), generate=generate,
                                kv_manager=types.SimpleNamespace(reset_prefix_cache=lambda: 0),
                                runner=types.SimpleNamespace(spec_decode_stats=stats))
    wl = random_workload("w", 1, (4, 4), (5, 5), 50)
    s = llm_runs.generate_timed(llm, wl)["spec_decode"]
    assert s["num_spec_steps"] == 4 and s["num_accepted_tokens"] == 5
    assert s["num_draft_tokens"] == 12 and s["accepted_per_position"] == [3, 1, 1]
    assert s["accepted_length_histogram"] == [1, 2, 0, 1]
    assert s["mean_accepted_length"] == pytest.approx(1 + 5 / 4)
    assert s["acceptance_per_position"] == pytest.approx([0.75, 0.25, 0.25])
    merged = spec_bench.merge([s, None, s])
    assert merged["num_accepted_tokens"] == 10 and merged["accepted_length_histogram"] == [2, 4, 0, 2]


def test_repetitive_workload_repeats_a_loop():
    from mrv2.bench.workloads import EMBEDDED_LOOP

    wl = make_workload("repetitive", 2048, tiny=True, loop=EMBEDDED_LOOP)
    assert wl.temperature == 0.0 and wl.input_lens == [16] * 4
    for i, p in enumerate(wl.prompts):                 # the loop, rotated by the request index
        assert p == [EMBEDDED_LOOP[(i + t) % 11] for t in range(16)]
    other = make_workload("repetitive", 50_000, seed=3, num_requests=3, input_len=30)
    for p in other.prompts:                            # a random 11-gram, repeated
        assert p[11:] == p[:19] and max(p) < 50_000
    assert other.prompts[0][:11] != other.prompts[1][:11]


def test_spec_variant_labels_and_pairs():
    variants = spec_bench.spec_variants("ngram", 2, sync=True, prompt_lookup_max=4)
    assert variants[0] == ("", None) and variants[2][1]["sync_accepted_counts"] is True
    assert variants[1][1] == {"method": "ngram", "num_speculative_tokens": 2,
                              "prompt_lookup_max": 4}
    labels = [v[0] for v in llm_runs.runner_variants(["v2", "v1"], [True, False], variants)]
    assert labels == ["v2", "v2-ngram", "v2-ngram-sync", "v2-no-pc", "v2-ngram-no-pc",
                      "v2-ngram-sync-no-pc", "v1", "v1-no-pc"]
    pairs = spec_bench.spec_pairs(labels, variants)
    assert ("v2-ngram-no-pc", "v2-no-pc") in pairs and ("v2-ngram-sync", "v2-ngram") in pairs
    assert ("v2-ngram-sync", "v2") in pairs and len(pairs) == 6


def test_the_embedded_model_named_by_its_folder_is_recognised():
    """On a GPU the default model is the Qwen3-0.6B shape: the embedded model is named with
    --model, and still gets its own loop and its shipped draft."""
    from mrv2.bench.llm_runs import ModelSpec
    from mrv2.models.loader import DEFAULT_MODEL_DIR

    assert suite.is_embedded(ModelSpec(None)) and suite.is_embedded(ModelSpec(
        str(DEFAULT_MODEL_DIR)))
    assert not suite.is_embedded(ModelSpec(str(DEFAULT_MODEL_DIR), load_format="dummy"))
    cfg = suite.BenchConfig(kind="latency", runners=["v2"], speculative="draft_model")
    variants = suite.spec_variants(cfg, ModelSpec(str(DEFAULT_MODEL_DIR) + "/"))
    assert variants[1][1]["model"] == str(spec_bench.EMBEDDED_DRAFT_DIR)


def test_cli_parses_speculative_methods_before_anything_imports_triton():
    """``--speculative`` is parsed (importing the proposers, hence Triton kernels) before the
    CLI imports mrv2.platform: on a CPU the interpreter must already be on by then."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "mrv2", "bench", "latency", "--speculative",
                           "bogus"], check=False, capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "--speculative takes one or a comma list of" in proc.stderr
    assert "ImportError" not in proc.stderr
