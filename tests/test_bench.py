"""The benchmark harness (``python -m mrv2 bench``) on the CPU: tiny runs, roofline
arithmetic, the transformers baseline's weights and token counts, and the plots."""

import importlib.util
import json
import pathlib
import types

import pytest
import torch

import mrv2  # noqa: F401  (before transformers: Triton's interpreter mode)
from mrv2.__main__ import main
from mrv2.bench import hf_runs, llm_runs, plots, suite
from mrv2.bench.roofline import copy_bandwidth, decode_roofline, kv_bytes_per_token, weight_bytes
from mrv2.bench.workloads import make_workload, random_workload

HAS_V1 = importlib.util.find_spec("mrv2.v1") is not None


def _run_cli(tmp_path, *args) -> dict:
    out = tmp_path / "r.json"
    assert main(["bench", *args, "--tiny", "--out", str(out)]) == 0
    return json.loads(out.read_text())


def _check_header(res: dict):
    for key in ("date", "hardware", "versions", "git_commit", "config", "model_info",
                "copy_bandwidth", "roofline", "ratios", "notes", "runners"):
        assert key in res, key
    assert res["versions"]["torch"] == torch.__version__
    assert res["copy_bandwidth"]["bandwidth_gbs"] > 0


def test_throughput_tiny_v2_and_hf(tmp_path):
    res = _run_cli(tmp_path, "throughput", "--runner", "v2,hf", "--hf-max-requests", "2",
                   "--profile", str(tmp_path / "prof"), "--repeats", "2")
    _check_header(res)
    v2, hf = res["runners"]["v2"], res["runners"]["hf"]
    wl = res["workload_stats"]
    assert v2["output_tokens"] == wl["output_tokens"] and v2["output_tok_s"] > 0
    assert v2["steps"] > 0 and v2["mean_step_ms"] > 0 and v2["num_requests"] == 4
    assert len(v2["runs"]) == 2 and v2["wall_s"] == min(r["wall_s"] for r in v2["runs"])
    assert v2["triton_compiles"] == 0  # the interpreter compiles nothing; recorded anyway
    # hf ran the first 2 requests only; v2 timed the same 2 for the ratio.
    assert hf["num_requests"] == 2 == v2["subset"]["num_requests"]
    assert hf["output_tokens"] == v2["subset"]["output_tokens"] and hf["short_rows"] == 0
    assert res["ratios"]["v2/hf"] == pytest.approx(
        v2["subset"]["output_tok_s"] / hf["output_tok_s"])
    assert res["roofline"]["decode"]["tok_s"] > 0
    trace = json.loads(pathlib.Path(v2["profile_trace"]).read_text())
    assert trace["traceEvents"], "empty profiler trace"


def test_latency_tiny(tmp_path):
    runners = ["v2", "v1"] if HAS_V1 else ["v2"]
    res = _run_cli(tmp_path, "latency", "--runner", ",".join(runners))
    _check_header(res)
    for name in runners:
        rows = res["runners"][name]["batches"]
        assert [r["batch_size"] for r in rows] == [1, 2]
        for r in rows:
            assert r["ttft_ms"] > 0 and r["e2e_ms"] > 0 and r["tpot_ms"] is not None
            assert r["tpot_ms"] == pytest.approx(
                (r["e2e_ms"] - r["ttft_ms"]) / (r["output_len"] - 1))
            assert r["triton_compiles"] == 0
    assert [r["batch"] for r in res["roofline"]["per_batch"]] == [1, 2]


def test_latency_runners_take_turns():
    """Each timed run of one runner is followed by the same run of the other (fake
    runners record the order); TTFT/TPOT come from each runner's own runs."""
    from mrv2.bench.timing import interleaved_latency_rows

    calls = []

    def fake(name, step_s):
        def generate(wl, max_tokens):
            calls.append((name, wl.num_requests, max_tokens))
            n = max_tokens or wl.output_lens[0]
            return {"wall_s": n * step_s, "steps": n, "triton_compiles": 0}
        return generate

    batches = [random_workload(f"b{b}", b, (4, 4), (5, 5), 50) for b in (1, 3)]
    rows = interleaved_latency_rows({"v2": fake("v2", 0.001), "v1": fake("v1", 0.002)},
                                    batches, iters=2)
    timed_b1 = [c for c in calls if c[1] == 1][4:]   # after 2 untimed runs per runner
    assert timed_b1 == [("v2", 1, 1), ("v1", 1, 1)] * 2 + [("v2", 1, None), ("v1", 1, None)] * 2
    assert [r["batch_size"] for r in rows["v1"]] == [1, 3]
    assert rows["v2"][0]["ttft_ms"] == pytest.approx(1.0)
    assert rows["v1"][1]["tpot_ms"] == pytest.approx((10.0 - 2.0) / 4)


def test_compile_counter_hooks_triton_and_restores_the_previous_hook():
    """``count_triton_compiles`` sees every call of Triton's cache-miss hook, chains to
    the hook installed before it, and puts that hook back on exit."""
    from triton import knobs

    from mrv2.bench.timing import count_triton_compiles

    seen = []
    before = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = lambda **kw: seen.append(kw["fn"].name)
    try:
        outer = knobs.runtime.jit_cache_hook
        with count_triton_compiles() as names:
            for kernel in ("_prepare_inputs_kernel", "_post_update_kernel"):
                # What Triton's JITFunction does on a miss, just before compiling.
                assert not knobs.runtime.jit_cache_hook(fn=types.SimpleNamespace(name=kernel),
                                                        key=None, repr="", compile={},
                                                        is_manual_warmup=False,
                                                        already_compiled=False)
        assert names == ["_prepare_inputs_kernel", "_post_update_kernel"]
        assert seen == names  # chained
        assert knobs.runtime.jit_cache_hook is outer  # restored
    finally:
        knobs.runtime.jit_cache_hook = before


@pytest.mark.skipif(not HAS_V1, reason="mrv2.v1 (the V1-style baseline) does not exist yet")
def test_throughput_tiny_v1(tmp_path):
    res = _run_cli(tmp_path, "throughput", "--runner", "v1", "--workload", "host-bound")
    v1 = res["runners"]["v1"]
    assert "error" not in v1, v1.get("traceback")
    assert v1["settings"]["runner"] == "v1" and v1["output_tok_s"] > 0
    assert v1["output_tokens"] == res["workload_stats"]["output_tokens"]


def test_failing_runner_is_an_error_row(tmp_path, monkeypatch):
    def broken(spec, runner, sizes):
        raise RuntimeError(f"runner {runner} cannot be built")

    monkeypatch.setattr(llm_runs, "build_llm", broken)
    out = tmp_path / "r.json"
    assert main(["bench", "throughput", "--tiny", "--runner", "v1", "--out", str(out)]) == 1
    row = json.loads(out.read_text())["runners"]["v1"]
    assert row["error"] == "RuntimeError: runner v1 cannot be built"


def test_latency_failing_runner_keeps_the_other(tmp_path, monkeypatch):
    build = llm_runs.build_llm

    def v1_broken(spec, runner, sizes):
        if runner == "v1":
            raise RuntimeError("runner v1 cannot be built")
        return build(spec, runner, sizes)

    monkeypatch.setattr(llm_runs, "build_llm", v1_broken)
    out = tmp_path / "r.json"
    assert main(["bench", "latency", "--tiny", "--runner", "v2,v1", "--out", str(out)]) == 0  # one ran
    runners = json.loads(out.read_text())["runners"]
    assert runners["v1"]["error"] == "RuntimeError: runner v1 cannot be built"
    assert [r["batch_size"] for r in runners["v2"]["batches"]] == [1, 2]


def test_hf_baseline_same_weights_and_token_counts():
    spec = llm_runs.ModelSpec(None)
    model, info = hf_runs.build_hf_model(spec)
    net, _ = __import__("mrv2.models.loader", fromlist=["load_model"]).load_model(None)
    for name, t in net.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], t, rtol=0, atol=0)
    assert info["weight_bytes"] == weight_bytes(net)
    # Uneven outputs in one batch: every row runs to the longest, only requested ones count.
    wl = random_workload("t", 3, (3, 9), (2, 5), info["vocab_size"], seed=1)
    r = hf_runs.generate_timed(model, wl, batch_size=2)
    assert r["output_tokens"] == wl.output_tokens and r["short_rows"] == 0
    assert r["generated_tokens"] >= r["output_tokens"] and r["num_batches"] == 2


def test_hf_key_mismatch_fails_loudly():
    src, dst = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2, bias=False)
    with pytest.raises(ValueError, match="only in mrv2 \\['bias'\\]"):
        hf_runs.copy_weights(src, dst)


def test_roofline_arithmetic():
    cfg = types.SimpleNamespace(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                head_dim=8, hidden_size=32, vocab_size=100)
    # layers x (K, V) x H_kv x D x 4 bytes
    assert kv_bytes_per_token(cfg, torch.float32) == 2 * 2 * 2 * 8 * 4
    assert kv_bytes_per_token(cfg, torch.bfloat16) == 128
    r = decode_roofline(1000, 256, batch=4, context=10, bandwidth_gbs=1.0)
    assert r["bytes"] == 1000 + 256 * 4 * 10 == 11240
    assert r["step_ms"] == pytest.approx(11240 / 1e9 * 1e3)
    assert r["tok_s"] == pytest.approx(4 / (11240 / 1e9))
    tied = torch.nn.Module()
    tied.a, tied.b = torch.nn.Linear(4, 3, bias=False), torch.nn.Linear(4, 3, bias=False)
    tied.b.weight = tied.a.weight
    assert weight_bytes(tied) == 4 * 3 * 4  # a shared weight counts once
    assert copy_bandwidth("cpu", nbytes=1 << 16, iters=2)["bandwidth_gbs"] > 0


def test_workload_roofline_walks_the_schedule():
    """Hand-counted schedules: weights once per decode step, each request's context."""
    from mrv2.bench.roofline import workload_roofline

    # One slot: request 0 (2 in, 3 out) decodes 2 tokens at contexts 3 and 4; request 1
    # (3 in, 1 out) gets its only token from the prefill: no decode step.
    r = workload_roofline(10, 1, [2, 3], [3, 1], max_num_seqs=1, bandwidth_gbs=1e-9)
    assert (r["decode_steps"], r["kv_bytes"], r["bytes"]) == (2, 3 + 4, 2 * 10 + 7)
    assert r["tok_s"] == pytest.approx(4 / 27)  # 4 output tokens over 27 bytes at 1 B/s
    # Two slots: both decode in step 1 (contexts 3 and 4), request 1 is done after it.
    r = workload_roofline(10, 1, [2, 3], [3, 2], max_num_seqs=2, bandwidth_gbs=1e-9)
    assert (r["decode_steps"], r["kv_bytes"]) == (2, (3 + 4) + 4)
    # A freed slot goes to the next waiting request.
    r = workload_roofline(0, 1, [1, 1, 1], [2, 3, 2], max_num_seqs=2, bandwidth_gbs=1e-9)
    assert (r["decode_steps"], r["kv_bytes"]) == (2, (2 + 2) + (3 + 2))  # C joins in step 2


def test_workloads_are_seeded_and_in_range():
    a = make_workload("standard", 1000, seed=3)
    b = make_workload("standard", 1000, seed=3)
    assert a.prompts == b.prompts and a.output_lens == b.output_lens and a.num_requests == 256
    assert all(100 <= n <= 1024 for n in a.input_lens + a.output_lens)
    assert all(0 <= t < 1000 for p in a.prompts for t in p)
    hb = make_workload("host-bound", 1000, input_len=5)
    assert hb.num_requests == 1024 and set(hb.input_lens) == {5} and set(hb.output_lens) == {128}
    assert all(sp.ignore_eos and sp.temperature == 0.6 for sp in a.sampling_params()[:3])


def _synthetic(kind: str) -> dict:
    roof = [{"batch": b, "context": 100, "step_ms": 1.0 + b / 100, "tok_s": b / (1e-3 + b / 1e5)}
            for b in (1, 8, 32)]
    if kind == "latency":
        row = lambda b, s: {"batch_size": b, "ttft_ms": 5.0 * s + b, "tpot_ms": 2.0 * s + b / 10,
                            "e2e_ms": 300.0, "output_len": 128}
        return {"benchmark": "latency", "hardware": {"name": "H200"},
                "runners": {"v2": {"batches": [row(b, 1) for b in (1, 8, 32)]},
                            "v1": {"batches": [row(b, 2) for b in (1, 8, 32)]},
                            "hf": {"error": "RuntimeError: boom"}},
                "roofline": {"bandwidth_gbs": 4000.0, "per_batch": roof}}
    sweep = [{"batch_size": b, "output_tok_s": 100.0 * b} for b in (1, 8, 32)]
    tl = {"cpu_ms": {"schedule": 0.1, "prep": 0.3, "forward": 1.0, "output": 0.2},
          "gpu_ms_per_step": 1.5}
    return {"benchmark": "throughput", "workload": "standard", "hardware": {"name": "H200"},
            "runners": {"v2": {"output_tok_s": 20000.0, "mean_step_ms": 9.0, "num_requests": 256,
                               "sweep": sweep, "timeline": tl},
                        "v1": {"output_tok_s": 14000.0, "mean_step_ms": 12.0, "num_requests": 256,
                               "timeline": tl},
                        "hf": {"output_tok_s": 3000.0, "mean_step_ms": 30.0, "num_requests": 64}},
            "roofline": {"bandwidth_gbs": 4000.0, "sweep": roof,
                         "decode": {"batch": 256, "context": 843, "step_ms": 6.1,
                                    "tok_s": 42000.0}}}


def test_plots_from_synthetic_results(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    thr, lat = _synthetic("throughput"), _synthetic("latency")
    assert len(plots.plot_throughput(thr).patches) == 3
    assert plots.plot_roofline(thr).get_xscale() == "log"
    assert plots.plot_step_split(thr) is not None
    assert len(plots.plot_latency(lat)) == 2
    assert plots.plot_roofline(lat).get_legend() is not None
    path = tmp_path / "thr.json"
    path.write_text(json.dumps(thr))
    for src, name in ((path, "a.png"), (lat, "b.png")):
        assert plots.save_plots(src, tmp_path / name).stat().st_size > 1000
    plt.close("all")


def test_ratios():
    runners = {"v2": {"output_tok_s": 30.0, "subset": {"output_tok_s": 20.0}},
               "v1": {"output_tok_s": 20.0}, "hf": {"output_tok_s": 10.0}}
    assert suite.throughput_ratios(runners) == {"v2/v1": 1.5, "v2/hf": 2.0, "v1/hf": 2.0}
    lat = _synthetic("latency")["runners"]
    r = suite.latency_ratios(lat)
    assert set(r) == {"v2/v1"} and r["v2/v1"]["tpot"]["1"] == pytest.approx(2.1 / 4.1)


@pytest.mark.parametrize("kind", ["decode", "timeline"])
def test_step_benchmarks_tiny(tmp_path, kind):
    """``bench decode`` / ``bench timeline`` run end to end on the CPU (tiny sizes)."""
    out = tmp_path / f"{kind}.json"
    extra = ["--compare-eager"] if kind == "decode" else []
    assert main(["bench", kind, "--tiny", "--plot", "--out", str(out)] + extra) == 0
    data = json.loads(out.read_text())
    assert data["meta"]["git_commit"] and data["meta"]["hardware"]
    if kind == "decode":
        assert all(ms > 0 for ms in data["eager"].values())
        prof = data["profile"]
        assert [(p["batch"], p["context"]) for p in prof["points"]] == [(1, 8), (2, 8)]
        for p in prof["points"]:
            assert p["wall_ms_per_step"] > 0 and p["roofline"]["step_ms"] > 0
            assert p["kernels_per_step"] > 0 and p["kernels"]       # CPU: top-level torch ops
            assert p["roofline"]["batch"] == p["batch"]
        assert out.with_name(out.stem + "_eager.png").stat().st_size > 0
    else:
        for name in ("sync", "async"):
            assert data[name]["output_tok_per_s"] > 0
            assert {"schedule", "prep", "wait"} <= set(data[name]["summary"]["cpu_ms"])
    assert out.with_suffix(".png").stat().st_size > 0


def test_shared_prefix_workload_draws_new_distinct_tokens_each_run():
    from mrv2.bench.workloads import SharedPrefixWorkload

    wl = make_workload("shared-prefix", 1000, seed=3, num_requests=3, prefix_len=8,
                       suffix_len=2, output_len=4)
    assert isinstance(wl, SharedPrefixWorkload) and wl.keep_prefix_cache
    assert wl.input_lens == [10] * 3 and wl.output_lens == [4] * 3
    assert all(p[:8] == wl.prefix for p in wl.prompts)
    first, second = wl.requests(), wl.requests()
    for draw in (first, second):
        assert all(r["prompt_token_ids"][:8] == wl.prefix for r in draw)
    tails = ([tuple(p[8:]) for p in wl.prompts]
             + [tuple(r["prompt_token_ids"][8:]) for r in first + second])
    assert len(set(tails)) == len(tails)                       # no whole prompt repeats
    again = make_workload("shared-prefix", 1000, seed=3, num_requests=3, prefix_len=8,
                          suffix_len=2, output_len=4)
    assert again.prompts == wl.prompts and again.requests() == first   # seeded
    assert not make_workload("standard", 1000, tiny=True).keep_prefix_cache


def test_generate_timed_empties_the_prefix_cache_unless_the_workload_keeps_it():
    resets = []

    class FakeLLM:
        engine = types.SimpleNamespace(num_steps=0)
        kv_manager = types.SimpleNamespace(reset_prefix_cache=lambda: resets.append(1))

        def generate(self, requests, params, use_tqdm):
            return [types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=[1])],
                                          num_cached_tokens=2) for _ in requests]

    llm_runs.generate_timed(FakeLLM(), make_workload("standard", 100, tiny=True))
    assert len(resets) == 1
    res = llm_runs.generate_timed(FakeLLM(), make_workload("shared-prefix", 100, tiny=True))
    assert len(resets) == 1 and res["cached_prompt_tokens"] == 2 * 4
    assert res["prompt_tokens"] == 4 * (32 + 5)


@pytest.mark.slow
def test_shared_prefix_tiny_with_and_without_caching(tmp_path):
    res = _run_cli(tmp_path, "throughput", "--workload", "shared-prefix", "--runner", "v2",
                   "--prefix-caching", "both", "--num-requests", "2")
    on, off = res["runners"]["v2"], res["runners"]["v2-no-pc"]
    assert on["settings"]["enable_prefix_caching"] and not off["settings"]["enable_prefix_caching"]
    # The warm-up cached the 32-token prefix (2 blocks of 16); the timed run hit it.
    assert on["cached_prompt_tokens"] == 2 * 32 and off["cached_prompt_tokens"] == 0
    assert on["output_tokens"] == off["output_tokens"] == 2 * 3
    assert res["ratios"]["v2/v2-no-pc"] == pytest.approx(on["output_tok_s"] / off["output_tok_s"])
    assert res["workload_stats"]["prefix_len"] == 32


def test_tables_print_the_fraction_of_the_roofline():
    from mrv2.bench.report import latency_table, throughput_table

    thr = throughput_table(_synthetic("throughput"))
    v2 = next(line for line in thr.splitlines() if line.startswith("v2 "))
    assert "of roof" in thr and f"{20000 / 42000:.0%}" in v2          # vs the step roofline
    lat = _synthetic("latency")
    text = latency_table(lat)
    bound = {r["batch"]: r["step_ms"] for r in lat["roofline"]["per_batch"]}
    v1_b8 = next(line for line in text.splitlines() if line.startswith("v1 ") and " 8 " in line)
    assert f"{bound[8] / (2.0 * 2 + 0.8):.0%}" in v1_b8                 # roofline / TPOT


def test_step_kernels_is_the_per_step_difference():
    from mrv2.bench.decode_profile import step_kernels

    short = {"gemm": [10, 100.0], "prefill_only": [3, 50.0]}
    long = {"gemm": [30, 300.0], "prefill_only": [3, 50.0], "gumbel": [4, 40.0]}
    rows = step_kernels(short, long, steps=2)
    assert rows == [{"name": "gemm", "launches_per_step": 10.0, "ms_per_step": 0.1},
                    {"name": "gumbel", "launches_per_step": 2.0, "ms_per_step": 0.02}]


def test_busy_us_counts_overlapping_kernels_once():
    from mrv2.bench.decode_profile import busy_us

    assert busy_us([]) == 0.0
    assert busy_us([(0.0, 2.0)]) == 2.0
    # a PDL kernel starting inside its predecessor, one nested, a gap, one touching
    assert busy_us([(5.0, 7.0), (0.0, 3.0), (1.0, 4.0), (1.5, 2.0), (7.0, 8.0)]) == 4.0 + 3.0


def test_decode_warmup_waits_for_the_last_prefill_chunk():
    from mrv2.bench.decode_profile import decode_warmup

    assert decode_warmup(1, 128, 8192, 4) == 4              # one prefill step: as asked
    assert decode_warmup(256, 32, 8192, 4) == 4             # exactly the budget
    # 196,608 prompt tokens, 8,192 a step less up to 256 decodes: 25 steps, then one more
    assert decode_warmup(256, 768, 8192, 4) == 26
    assert decode_warmup(4, 8, 16, 1) == 4                  # 32 tokens at 12 a step: 3 + 1


def test_profile_decode_records_its_warmup_and_refuses_a_too_long_run():
    from mrv2.bench.decode_profile import profile_decode

    kw = {"model": None, "dtype": "float32", "max_model_len": 16,
          "max_num_batched_tokens": 16, "skip_tokenizer_init": True}
    res = profile_decode(kw, batch_sizes=(4,), contexts=(8,), steps=2, warmup=1, repeats=1)
    (point,) = res["points"]
    assert point["warmup_steps"] == 4
    assert point["roofline"]["context"] == 8 + 4 + 1.5   # the measured steps' mean context
    with pytest.raises(ValueError, match="above max_model_len=16"):
        profile_decode(kw, batch_sizes=(4,), contexts=(8,), steps=5, warmup=1, repeats=1)


def test_context_ranges_spread_a_batch_over_lengths():
    import argparse

    from mrv2.bench.cli import _context_list
    from mrv2.bench.decode_profile import _mixed_prompts, context_label, context_lengths

    assert context_lengths(128, 3) == [128, 128, 128]
    spread = context_lengths((100, 1024), 5, seed=3)
    assert sorted(spread) == [100, 331, 562, 793, 1024]     # evenly from lo to hi, both in
    assert spread == context_lengths((100, 1024), 5, seed=3) != sorted(spread)  # seeded order
    assert context_lengths((7, 9), 1) == [7] and context_lengths((5, 5), 2) == [5, 5]
    for bad in (0, (0, 4), (9, 4)):
        with pytest.raises(ValueError, match="context"):
            context_lengths(bad, 2)
    assert [len(p["prompt_token_ids"]) for p in _mixed_prompts([3, 9, 5], 50, seed=1)] == [3, 9, 5]
    assert context_label(128) == "128" and context_label((100, 1024)) == "100-1024"
    assert _context_list("128, 1024,100-1024") == [128, 1024, (100, 1024)]
    for bad in ("0", "9-4", "a-b", "", "12-"):
        with pytest.raises(argparse.ArgumentTypeError):
            _context_list(bad)


def test_profile_decode_of_a_mixed_batch_takes_its_mean_context():
    from mrv2.bench.decode_profile import profile_decode

    kw = {"model": None, "dtype": "float32", "max_model_len": 32,
          "max_num_batched_tokens": 16, "skip_tokenizer_init": True}
    # lengths 4, 7, 9, 12: mean 8, 32 prompt tokens at 16 a step (less 4 decodes): 3 chunks + 1
    res = profile_decode(kw, batch_sizes=(4,), contexts=((4, 12),), steps=2, warmup=1, repeats=1)
    (point,) = res["points"]
    assert (point["context"], point["mean_context"], point["warmup_steps"]) == ("4-12", 8.0, 4)
    assert point["roofline"]["context"] == 8 + 4 + 1.5
    # 4, 12, 20, 28: a uniform batch of their mean (16) would fit, the longest does not
    with pytest.raises(ValueError, match="4-28 needs 38 tokens"):
        profile_decode(kw, batch_sizes=(4,), contexts=((4, 28),), steps=2, warmup=1, repeats=1)


def test_bench_decode_takes_a_max_model_len_and_refuses_one_too_short(tmp_path, capsys):
    out = tmp_path / "d.json"
    assert main(["bench", "decode", "--tiny", "--max-model-len", "64", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["profile"]["settings"]["max_model_len"] == 64
    # the tiny points need 8 prompt + 1 + 1 warm-up + 2 measured = 12 tokens a request
    assert main(["bench", "decode", "--tiny", "--max-model-len", "11",
                 "--out", str(tmp_path / "e.json")]) == 2
    assert "above max_model_len=11" in capsys.readouterr().out
    assert main(["bench", "decode", "--tiny", "--max-model-len", "0",
                 "--out", str(tmp_path / "f.json")]) == 2
    assert "max_model_len must be >= 1" in capsys.readouterr().out
