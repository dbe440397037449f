"""Timed runs of the mrv2 runners (V2, and the V1-style baseline) through ``LLM.generate``.

One ``LLM`` per runner: built, warmed up with a small generate, then timed on the
workload with device syncs around the whole ``generate`` call only. Optional
extras reuse the same ``LLM``: the HF subset (so the HF ratio compares the same
requests), a batch-size sweep, a ``torch.profiler`` trace and a per-step timeline.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
import time
import warnings
from dataclasses import dataclass

from mrv2.bench.timing import count_triton_compiles, throughput_figures, timed
from mrv2.bench.workloads import Workload


@dataclass
class ModelSpec:
    """Which model every runner builds (same weights for all: same loader, same seed).

    Args:
        model: a Hugging Face folder, or ``None`` for the embedded tiny Qwen3.
        load_format: ``"auto"`` (safetensors) or ``"dummy"`` (random weights from the config).
        dtype: ``"auto"`` (bf16 on a GPU, fp32 on the CPU) or a dtype name.
        seed: seeds the dummy weights and the requests' sampling seeds.
    """

    model: str | None
    load_format: str = "auto"
    dtype: str = "auto"
    seed: int = 0


@dataclass
class EngineSizes:
    """``LLM`` sizes and switches shared by the mrv2 runners."""

    max_num_seqs: int
    max_model_len: int
    max_num_batched_tokens: int | None = None
    enforce_eager: bool = False
    async_scheduling: bool | None = None
    cudagraph_mode: str | None = None  # LLM(cudagraph_mode=...) of the mrv2 runners
    enable_prefix_caching: bool = True
    speculative_config: dict | None = None  # V2 only: LLM(speculative_config=...)


def caching_variants(runners: list[str], caching: list[bool]) -> list[tuple[str, str, bool]]:
    """``(label, runner, enable_prefix_caching)`` for every mrv2 runner and caching setting.

    With both settings the runner without caching is labelled ``<runner>-no-pc``;
    with one setting the label is the runner's name (the JSON's settings say which).
    """
    return [(name if on or len(caching) == 1 else f"{name}-no-pc", name, on)
            for name in runners for on in caching]


def runner_variants(runners: list[str], caching: list[bool],
                    specs: list[tuple[str, dict | None]] = (("", None),)
                    ) -> list[tuple[str, str, bool, dict | None]]:
    """``(label, runner, enable_prefix_caching, speculative_config)`` of every variant.

    The V2 runner gets every speculative variant of ``specs`` (``mrv2.bench.spec``; label
    ``v2<suffix>``, before any ``-no-pc``); the V1 baseline only the plain one.
    """
    out = []
    for label, name, on in caching_variants(runners, caching):
        for suffix, cfg in (specs if name == "v2" else [("", None)]):
            out.append((label.replace(name, name + suffix, 1), name, on, cfg))
    return out


def build_llm(spec: ModelSpec, runner: str, sizes: EngineSizes):
    """``LLM(runner=...)`` with token-id prompts only (no tokenizer)."""
    from mrv2 import LLM

    return LLM(model=spec.model, load_format=spec.load_format, dtype=spec.dtype, seed=spec.seed,
               skip_tokenizer_init=True, max_num_seqs=sizes.max_num_seqs,
               max_num_batched_tokens=sizes.max_num_batched_tokens,
               max_model_len=sizes.max_model_len, enforce_eager=sizes.enforce_eager,
               runner=runner, async_scheduling=sizes.async_scheduling,
               cudagraph_mode=sizes.cudagraph_mode,
               enable_prefix_caching=sizes.enable_prefix_caching,
               speculative_config=sizes.speculative_config)


def generate_timed(llm, wl: Workload, max_tokens: int | None = None) -> dict:
    """One timed ``llm.generate`` of the workload (no progress bar: it costs host time).

    The prefix cache is emptied first unless the workload keeps it warm
    (``Workload.keep_prefix_cache``): a repeated run must not hit its own prompts.

    Returns:
        ``throughput_figures`` of the run (output tokens counted from the outputs),
        ``triton_compiles``: kernel variants compiled inside the timed run (should be 0),
        ``cached_prompt_tokens`` / ``prompt_tokens``: the prefix-cache hits, and
        ``spec_decode``: the acceptance counts of this run (``mrv2.bench.spec``; ``None``
        without speculative decoding).
    """
    from mrv2.bench import spec

    steps0 = llm.engine.num_steps
    if not wl.keep_prefix_cache:
        llm.kv_manager.reset_prefix_cache()
    requests, params = wl.requests(), wl.sampling_params(max_tokens)  # built before the clock
    before = spec.snapshot(llm)
    with count_triton_compiles() as compiled:
        outs, wall = timed(lambda: llm.generate(requests, params, use_tqdm=False))
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    res = throughput_figures(wall, n_out, llm.engine.num_steps - steps0)
    res["triton_compiles"] = len(compiled)
    res["cached_prompt_tokens"] = sum(o.num_cached_tokens for o in outs)
    res["prompt_tokens"] = sum(len(r["prompt_token_ids"]) for r in requests)
    res["spec_decode"] = spec.delta(before, spec.snapshot(llm))
    if compiled:
        res["compiled_kernels"] = sorted(set(compiled))
    return res


def warm_up(llm, wl: Workload, num_requests: int, max_tokens: int) -> float:
    """A small untimed generate (JIT compilation, allocator, first-call costs); returns seconds.

    Output lengths are staggered from 1 to ``max_tokens`` (the longest alone), so the batch
    shrinks step by step down to 1 and kernels meet odd batch sizes too: Triton compiles
    a variant per size class (divisible by 16, equal to 1, other), and a compilation
    inside the timed run would be counted as runner time.
    """
    k = min(num_requests, wl.num_requests)
    lens = [max_tokens] if k == 1 else [1 + i * (max_tokens - 1) // (k - 1) for i in range(k)]
    small = Workload(f"{wl.name}-warmup", wl.prompts[:k], lens, wl.temperature)
    requests, params = small.requests(), small.sampling_params()
    return timed(lambda: llm.generate(requests, params, use_tqdm=False))[1]


def describe(llm) -> dict:
    """The resolved settings of a built ``LLM`` (for the results JSON)."""
    return {"runner": llm.runner_name, "async_scheduling": llm.async_scheduling,
            "cudagraph_mode": llm.cudagraph_mode,
            "dtype": str(llm.dtype).removeprefix("torch."), "device": str(llm.device),
            "max_num_seqs": llm.scheduler_config.max_num_seqs,
            "max_num_batched_tokens": llm.scheduler_config.max_num_batched_tokens,
            "max_model_len": llm.scheduler_config.max_model_len,
            "num_gpu_blocks": getattr(llm.kv_manager, "num_blocks", None),
            "enable_prefix_caching": llm.kv_manager.enable_caching,
            "block_size": llm.cache_config.block_size,
            "speculative_config": _spec_settings(llm)}


def _spec_settings(llm) -> dict | None:
    """The resolved ``SpeculativeConfig`` of a built ``LLM`` (``None``: no speculation)."""
    step = getattr(llm.runner, "spec", None)
    cfg = getattr(step, "config", None)
    if cfg is None:
        return None
    return {f: getattr(cfg, f) for f in ("method", "num_speculative_tokens", "prompt_lookup_max",
                                         "prompt_lookup_min", "model", "verification",
                                         "sync_accepted_counts")}


def profile_steps(llm, wl: Workload, out_dir: str | pathlib.Path, tag: str,
                  active: int = 5) -> str:
    """Chrome trace (``torch.profiler``) of ``active`` steps once the prefills are done.

    Runs the workload's first ``max_num_seqs`` requests; the profiler's schedule skips
    the prefill steps, and every request asks for enough tokens to still be running
    then, so the recorded steps are decodes of a full batch. ``engine.step`` is wrapped
    (on this instance only) to advance the profiler schedule once per step.

    Returns:
        The path of the trace (``<out_dir>/trace_<tag>.json``; open it in Perfetto).
    """
    from torch.profiler import ProfilerActivity, profile, schedule

    from mrv2 import platform

    sub = wl.subset(min(wl.num_requests, llm.scheduler_config.max_num_seqs))
    budget = llm.scheduler_config.max_num_batched_tokens
    wait, warmup = math.ceil(sum(sub.input_lens) / budget) + 1, 2
    path = pathlib.Path(out_dir) / f"trace_{tag}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if platform.HAS_CUDA else [])
    engine = llm.engine
    plan = schedule(wait=wait, warmup=warmup, active=active, repeat=1)
    with warnings.catch_warnings(), profile(activities=acts, schedule=plan,
                 on_trace_ready=lambda p: p.export_chrome_trace(str(path))) as prof:
        warnings.filterwarnings("ignore", message=".*Profiler clears events")
        step = engine.step

        def profiled_step():
            out = step()
            prof.step()
            return out

        engine.step = profiled_step  # NOTE: an instance attribute shadows the method
        try:
            llm.generate(sub.requests(), sub.sampling_params(wait + warmup + active + 3),
                         use_tqdm=False)
        finally:
            vars(engine).pop("step", None)
    return str(path)


def timeline_summary(llm, wl: Workload, max_tokens: int = 64) -> dict | None:
    """Mean ms per CPU phase and GPU span of one short run, from ``mrv2.timeline``.

    Returns:
        ``Timeline.summary()``, or ``None`` when ``mrv2.timeline`` is absent or the
        engine recorded nothing.
    """
    try:
        from mrv2.timeline import Timeline
    except ImportError:
        return None
    sub = wl.subset(min(wl.num_requests, llm.scheduler_config.max_num_seqs))
    engine, tl = llm.engine, Timeline()
    before = getattr(engine, "timeline", None)
    engine.timeline = tl
    try:
        llm.generate(sub.requests(), sub.sampling_params(min(max_tokens, max(sub.output_lens))),
                     use_tqdm=False)
    finally:
        engine.timeline = before
    if hasattr(tl, "finalize"):
        tl.finalize()
    summary = tl.summary()
    return summary if summary.get("cpu_ms") or summary.get("gpu_ms") else None


def run_throughput(spec: ModelSpec, runner: str, sizes: EngineSizes, wl: Workload, *,
                   warmup_requests: int, warmup_tokens: int, subset: Workload | None = None,
                   sweep: list[Workload] | None = None, profile_dir: str | None = None,
                   timeline: bool = False, repeats: int = 1, log=print,
                   label: str | None = None) -> tuple[dict, dict]:
    """Build one mrv2 runner and time it on the workload (and the extras asked for).

    With ``repeats > 1`` the workload is timed that many times and the fastest run is
    reported (all are kept under ``runs``): a first full run also catches one-time costs
    the small warm-up could not reach (e.g. kernels compiled for longer contexts).
    ``label`` names the run in the log and the profile trace (default: ``runner``).

    Returns:
        ``(figures, model_info)``: the runner's figures for the JSON, and the model's
        size facts for the roofline (``mrv2.bench.roofline.model_info``).
    """
    from mrv2.bench.roofline import model_info
    from mrv2.bench.timing import sweep_rows

    t0 = time.perf_counter()
    llm = build_llm(spec, runner, sizes)
    res = {"build_s": time.perf_counter() - t0, "settings": describe(llm)}
    info = model_info(llm.model, llm.hf_config, llm.dtype)
    runner = label or runner  # what the log and the profile trace are named
    log(f"[bench] {runner}: built in {res['build_s']:.1f} s; warm-up")
    res["warmup_s"] = warm_up(llm, wl, warmup_requests, warmup_tokens)
    runs = []
    for i in range(repeats):
        log(f"[bench] {runner}: timed run {i + 1}/{repeats} of {wl.num_requests} requests")
        runs.append(generate_timed(llm, wl))
    res.update(min(runs, key=lambda r: r["wall_s"]), num_requests=wl.num_requests)
    if repeats > 1:
        res["runs"] = runs
    log(f"[bench] {runner}: {res['output_tok_s']:,.1f} output tok/s ({res['wall_s']:.2f} s, "
        f"{res['steps']} steps, {res['triton_compiles']} Triton compiles inside)")
    extras = []  # (key in the JSON, what to run), all on the same LLM
    if subset is not None:
        extras.append(("subset", lambda: {"num_requests": subset.num_requests,
                                          **generate_timed(llm, subset)}))
    if sweep:
        extras.append(("sweep", lambda: sweep_rows(
            lambda w, m: generate_timed(llm, w, m), sweep,
            warm_up=lambda w: warm_up(llm, w, w.num_requests, 3))))
    if profile_dir:
        extras.append(("profile_trace", lambda: profile_steps(llm, wl, profile_dir, runner)))
    if timeline:
        extras.append(("timeline", lambda: timeline_summary(llm, wl)))
    for key, fn in extras:
        log(f"[bench] {runner}: {key}")
        try:  # NOTE: a failing extra must not lose the figures measured above
            res[key] = fn()
        except Exception as e:  # noqa: BLE001
            log(f"[bench] {runner}: {key} FAILED: {type(e).__name__}: {e}")
            res[f"{key}_error"] = f"{type(e).__name__}: {e}"
    return res, info


def run_latency(spec: ModelSpec, runners: list[str], sizes: EngineSizes,
                batches: list[Workload], *, iters: int, caching: tuple[bool, ...] = (True,),
                specs: list[tuple[str, dict | None]] = (("", None),),
                log=print) -> dict[str, tuple[dict, dict | None]]:
    """Build every mrv2 runner named, then measure TTFT/TPOT with the runners taking turns
    (:func:`mrv2.bench.timing.interleaved_latency_rows`; the latency sizes are small, so
    the runners fit on the device together).

    Args:
        caching: prefix caching settings; each runner is built once per setting
            (labels from :func:`caching_variants`).
        specs: speculative variants of the V2 runner (:func:`runner_variants`).

    Returns:
        Label -> ``(figures, model_info)`` as :func:`run_throughput`; a runner that
        fails to build gets ``({"error": ..., "traceback": ...}, None)``.
    """
    from mrv2.bench.report import error_row
    from mrv2.bench.roofline import model_info
    from mrv2.bench.timing import interleaved_latency_rows

    out, built = {}, {}
    for name, runner, on, spec_cfg in runner_variants(runners, list(caching), list(specs)):
        t0 = time.perf_counter()
        try:
            llm = build_llm(spec, runner, dataclasses.replace(
                sizes, enable_prefix_caching=on, speculative_config=spec_cfg))
        except Exception as e:  # noqa: BLE001  (the other runners still run)
            out[name] = (error_row(name, e, log), None)
            continue
        res = {"build_s": time.perf_counter() - t0, "settings": describe(llm)}
        res["warmup_s"] = sum(warm_up(llm, w, w.num_requests, 3) for w in batches)
        built[name] = (llm, res, model_info(llm.model, llm.hf_config, llm.dtype))
    if built:
        log(f"[bench] {', '.join(built)}: latency at batch sizes "
            f"{[w.num_requests for w in batches]}, runners taking turns")
        rows = interleaved_latency_rows(
            {name: (lambda w, m, llm=llm: generate_timed(llm, w, m))
             for name, (llm, _, _) in built.items()}, batches, iters)
        for name, (_, res, info) in built.items():
            res["batches"] = rows[name]
            out[name] = (res, info)
    return out
