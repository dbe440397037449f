"""Run every runner of one benchmark in one process, one after another.

Each runner (``v2``, ``v1``, ``hf``) is built, warmed up, timed and then freed
(``del``, ``gc.collect()``, ``torch.cuda.empty_cache()``) before the next one, so
they share the GPU's memory but never hold it at the same time. A runner that
fails is recorded as an error row and the others still run.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
from dataclasses import dataclass, field

from mrv2 import platform
from mrv2.bench import hf_runs, llm_runs, spec
from mrv2.bench.report import REPO_ROOT, environment, error_row
from mrv2.bench.roofline import copy_bandwidth, decode_roofline, workload_roofline
from mrv2.bench.timing import free_device_memory
from mrv2.bench.workloads import (
    EMBEDDED_LOOP,
    SHAKESPEARE_FILE,
    make_workload,
    random_workload,
    repetitive_workload,
    shakespeare_workload,
    shared_prefix_workload,
)

RUNNERS = ("v2", "v1", "hf")
#: ``--prefix-caching`` -> the settings each mrv2 runner is built with.
PREFIX_CACHING = {"on": (True,), "off": (False,), "both": (True, False)}


@dataclass
class BenchConfig:
    """Everything one benchmark run depends on (written to the JSON as ``config``).

    ``None`` fields take the defaults of DESIGN.md, or of the ``tiny`` CPU preset.
    """

    kind: str = "throughput"                  # "throughput" or "latency"
    runners: list[str] = field(default_factory=lambda: ["v2", "v1", "hf"])
    workload: str = "standard"                # "standard", "host-bound", "shared-prefix",
                                              # "repetitive", "shakespeare" (latency only)
    model: str | None = None                  # None: Qwen3-0.6B config (GPU) / embedded (CPU)
    load_format: str | None = None            # None: "dummy" for a bare config, else "auto"
    dtype: str = "auto"
    tiny: bool = False
    num_requests: int | None = None
    input_len: int | None = None
    output_len: int | None = None
    max_num_seqs: int | None = None           # default 256 (tiny: 4)
    max_num_batched_tokens: int | None = None
    enforce_eager: bool = False
    async_scheduling: bool | None = None
    cudagraph_mode: str | None = None         # default FULL (see LLM(cudagraph_mode=...))
    seed: int = 0
    warmup_requests: int | None = None        # default 32 (tiny: 2)
    warmup_tokens: int | None = None          # default 16 (tiny: 2)
    hf_max_requests: int | None = None        # default 64 on "standard", else all
    hf_batch_size: int | None = None          # default max_num_seqs
    hf_cache: str | None = None               # None: dynamic cache; "static"
    batch_sizes: list[int] | None = None      # latency: default 1, 8, 32 (tiny: 1, 2)
    latency_iters: int | None = None          # default 3 (tiny: 1)
    sweep_batch: list[int] | None = None      # throughput: extra decode-dominated sweep
    profile: str | None = None
    timeline: bool = False
    copy_bytes: int | None = None
    repeats: int | None = None                # timed runs per mrv2 runner (fastest counts):
                                              # default 2 on a GPU, 1 on the CPU / tiny
    prefix_caching: str = "on"                # mrv2 runners: "on", "off" or "both"
    prefix_len: int | None = None             # shared-prefix: default 1024 (tiny: 32)
    suffix_len: int | None = None             # shared-prefix: default 64 (tiny: 5)
    temperature: float | None = None          # None: 0.6 (repetitive: 0, greedy)
    speculative: str | None = None            # "ngram" / "draft_model" / "eagle" (or a comma list)
    num_speculative_tokens: int | None = None  # K, default 3
    sync_accepted_counts: bool = False        # also v2 with the accepted-counts sync
    draft_model: str | None = None            # default: the embedded model's shipped draft
    eagle_model: str | None = None            # default: the embedded model's shipped head
    prompt_lookup_max: int | None = None      # ngram: default the config's
    prompt_lookup_min: int | None = None

    def __post_init__(self):
        if self.kind not in ("throughput", "latency"):
            raise ValueError(f"kind must be 'throughput' or 'latency', got {self.kind!r}")
        if self.workload == "shakespeare" and self.kind != "latency":
            raise ValueError("workload 'shakespeare' is a latency workload (bench latency), "
                             f"not {self.kind}")
        if self.repeats is not None and self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}")
        if self.prefix_caching not in PREFIX_CACHING:
            raise ValueError(f"prefix_caching must be one of {sorted(PREFIX_CACHING)}, "
                             f"got {self.prefix_caching!r}")
        bad = [r for r in self.runners if r not in RUNNERS]
        if bad or not self.runners:
            raise ValueError(f"runners must be a non-empty subset of {RUNNERS}, got {self.runners}")
        if self.speculative is None:
            for key in ("num_speculative_tokens", "draft_model", "eagle_model",
                        "prompt_lookup_max", "prompt_lookup_min"):
                if getattr(self, key) is not None:
                    raise ValueError(f"{key} needs speculative (--speculative ngram|draft_model)")
            if self.sync_accepted_counts:
                raise ValueError("sync_accepted_counts needs speculative "
                                 "(--speculative ngram|draft_model)")
            return
        methods = self.speculative.split(",")
        if not all(m in spec.METHODS for m in methods) or len(set(methods)) != len(methods):
            raise ValueError(f"speculative must be one or a comma list of {spec.METHODS}, "
                             f"got {self.speculative!r}")
        if "v2" not in self.runners:
            raise ValueError(f"speculative decoding needs the v2 runner, got {self.runners}")
        if self.num_speculative_tokens is not None and self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, "
                             f"got {self.num_speculative_tokens}")


def shared_data_dir() -> pathlib.Path:
    """``$MRV2_SHARED_DATA``, else ``../shared/data`` beside the checkout."""
    return pathlib.Path(os.environ.get("MRV2_SHARED_DATA", REPO_ROOT.parent / "shared" / "data"))


def resolve_model(cfg: BenchConfig):
    """The model every runner builds, and its Hugging Face config.

    Returns:
        ``(ModelSpec, hf_config)``.
    """
    from transformers import AutoConfig

    from mrv2.models.loader import resolve_model_path

    model, load_format = cfg.model, cfg.load_format
    if cfg.tiny:
        model, load_format = None, "auto"
    elif model is None and platform.HAS_CUDA:
        model = shared_data_dir() / "qwen3-tokenizer"
        if not (model / "config.json").is_file():
            raise FileNotFoundError(f"{model}/config.json (Qwen3-0.6B) not found: set "
                                    "MRV2_SHARED_DATA or pass --model")
        load_format = load_format or "dummy"
    path = resolve_model_path(model)
    spec = llm_runs.ModelSpec(None if model is None else str(path), load_format or "auto",
                              cfg.dtype, cfg.seed)
    return spec, AutoConfig.from_pretrained(path)


def _default(value, normal, tiny_value, tiny: bool):
    return value if value is not None else (tiny_value if tiny else normal)


def spec_variants(cfg: BenchConfig, spec_model) -> list[tuple[str, dict | None]]:
    """The V2 variants of ``cfg`` (``mrv2.bench.spec.spec_variants``); the draft defaults
    to the embedded model's shipped draft, and is required for any other model."""
    methods = (cfg.speculative or "").split(",")
    draft, eagle = cfg.draft_model, cfg.eagle_model
    for method, given, flag in (("draft_model", draft, "--draft-model"),
                                ("eagle", eagle, "--eagle-model")):
        if method in methods and given is None and not is_embedded(spec_model):
            raise ValueError(f"--speculative {method} with --model needs {flag} PATH "
                             "(the shipped one fits only the embedded model)")
    draft = draft or str(spec.EMBEDDED_DRAFT_DIR)
    eagle = eagle or str(spec.EMBEDDED_EAGLE_DIR)
    return spec.spec_variants(cfg.speculative, cfg.num_speculative_tokens or 3,
                              sync=cfg.sync_accepted_counts, draft_model=draft,
                              eagle_model=eagle,
                              prompt_lookup_max=cfg.prompt_lookup_max,
                              prompt_lookup_min=cfg.prompt_lookup_min)


def _set_temperature(cfg: BenchConfig, workloads: list) -> None:
    if cfg.temperature is not None:
        for w in workloads:
            w.temperature = cfg.temperature


def is_embedded(spec_model) -> bool:
    """Whether the benchmark runs the embedded model (by default, or named by its folder)."""
    from mrv2.models.loader import DEFAULT_MODEL_DIR

    return (spec_model.model is None or (spec_model.load_format != "dummy" and
            pathlib.Path(spec_model.model).resolve() == DEFAULT_MODEL_DIR.resolve()))


def _tokenizer(spec_model):
    """The benchmark model's tokenizer (the embedded model's by default)."""
    from transformers import AutoTokenizer

    from mrv2.models.loader import resolve_model_path

    return AutoTokenizer.from_pretrained(resolve_model_path(spec_model.model))


def _embedded_loop(spec_model) -> list[int] | None:
    """The embedded model's own loop for ``repetitive`` (``None``: another model)."""
    return EMBEDDED_LOOP if is_embedded(spec_model) else None


def _workload_label(cfg: BenchConfig, spec_model, temperature: float) -> str:
    if cfg.workload == "shakespeare":
        return (f"shakespeare (a window of {SHAKESPEARE_FILE}'s validation split per request; "
                f"T={temperature:g})")
    if cfg.workload != "repetitive":
        return cfg.workload
    kind = ("the embedded model's own greedy loop, rotated per request"
            if _embedded_loop(spec_model) is not None else
            "a random 11-token n-gram per request, repeated")
    return f"repetitive ({kind}; T={temperature:g})"


def _guarded(name: str, fn, log) -> tuple[dict, dict | None]:
    """Run one runner; an exception becomes an error row. Frees memory afterwards."""
    try:
        res, info = fn()
    except Exception as e:  # noqa: BLE001  (one broken runner must not lose the others)
        res, info = error_row(name, e, log), None
    res["memory_after_free"] = free_device_memory()
    return res, info


def _header(cfg: BenchConfig, spec, log) -> dict:
    results = {"benchmark": cfg.kind, **environment(), "config": dataclasses.asdict(cfg),
               "model": dataclasses.asdict(spec), "runners": {}, "notes": []}
    log(f"[bench] {results['hardware']['name']}: measuring copy bandwidth")
    results["copy_bandwidth"] = copy_bandwidth(platform.DEVICE, cfg.copy_bytes or
                                               ((8 << 20) if cfg.tiny else None))
    return results


def _check_len(max_len: int, hf_config) -> None:
    limit = getattr(hf_config, "max_position_embeddings", None)
    if limit is not None and max_len > limit:
        raise ValueError(f"the workload needs max_model_len={max_len}, but the model allows "
                         f"{limit}: use --tiny, --input-len/--output-len, or a larger model")


def run_throughput(cfg: BenchConfig, log=print) -> dict:
    """Output tokens/s of every runner on one workload (see ``mrv2.bench``).

    Returns:
        The results dict (what ``python -m mrv2 bench throughput`` writes as JSON).
    """
    spec_model, hf_config = resolve_model(cfg)
    tiny, vocab = cfg.tiny, hf_config.vocab_size
    specs = spec_variants(cfg, spec_model)
    wl = make_workload(cfg.workload, vocab, cfg.seed, cfg.num_requests, cfg.input_len,
                       cfg.output_len, tiny, cfg.prefix_len, cfg.suffix_len,
                       loop=_embedded_loop(spec_model))
    sweep = [random_workload(f"sweep-b{b}", b, (cfg.input_len or (16 if tiny else 128),) * 2,
                             (cfg.output_len or (4 if tiny else 256),) * 2, vocab, cfg.seed)
             for b in cfg.sweep_batch or []]
    _set_temperature(cfg, [wl] + sweep)
    max_num_seqs = max([_default(cfg.max_num_seqs, 256, 4, tiny)] + (cfg.sweep_batch or []))
    sizes = llm_runs.EngineSizes(max_num_seqs, max(w.max_len for w in [wl] + sweep),
                                 cfg.max_num_batched_tokens, cfg.enforce_eager,
                                 cfg.async_scheduling, cfg.cudagraph_mode)
    _check_len(sizes.max_model_len, hf_config)
    hf_cap = _default(cfg.hf_max_requests, 64 if cfg.workload == "standard" else None, None, tiny)
    hf_wl = wl.subset(hf_cap) if hf_cap and hf_cap < wl.num_requests else wl
    subset = hf_wl if "hf" in cfg.runners and hf_wl is not wl else None
    results = _header(cfg, spec_model, log)
    results.update(workload=_workload_label(cfg, spec_model, wl.temperature),
                   workload_stats=wl.summary())
    variants = [v for r in cfg.runners for v in (
        [("hf", "hf", False, None)] if r == "hf" else
        llm_runs.runner_variants([r], list(PREFIX_CACHING[cfg.prefix_caching]), specs))]
    first_mrv2 = next((label for label, name, _, _ in variants if name != "hf"), None)
    # NOTE: kernels compile per context-length class (attention block sizes, splits), which
    # a small warm-up cannot all reach: on a GPU a first full run absorbs them.
    repeats = cfg.repeats or (2 if platform.HAS_CUDA and not tiny else 1)
    info = None
    for label, name, on, spec_cfg in variants:
        if name == "hf":
            fn = lambda: hf_runs.run_throughput(
                spec_model, hf_wl, batch_size=cfg.hf_batch_size or max_num_seqs,
                cache_implementation=cfg.hf_cache, sweep=sweep, log=log)
        else:
            fn = lambda label=label, name=name, on=on, spec_cfg=spec_cfg: llm_runs.run_throughput(
                spec_model, name, dataclasses.replace(sizes, enable_prefix_caching=on,
                                                      speculative_config=spec_cfg), wl,
                warmup_requests=_default(cfg.warmup_requests, 32, 2, tiny),
                warmup_tokens=_default(cfg.warmup_tokens, 16, 2, tiny), subset=subset,
                sweep=sweep, profile_dir=cfg.profile if label == first_mrv2 else None,
                timeline=cfg.timeline, repeats=repeats, log=log, label=label)
        results["runners"][label], runner_info = _guarded(label, fn, log)
        info = info or runner_info
    results["model_info"] = info
    pairs = spec.spec_pairs(list(results["runners"]), specs)
    results["ratios"] = throughput_ratios(results["runners"], pairs)
    results["roofline"] = throughput_roofline(info, results["copy_bandwidth"], wl,
                                              sizes.max_num_seqs, sweep)
    results["notes"] += _throughput_notes(repeats, wl, hf_wl, "hf" in cfg.runners)
    results["notes"] += spec.NOTES if cfg.speculative else []
    return results


def throughput_ratios(runners: dict, pairs: list[tuple[str, str]] = ()) -> dict:
    """``v2/v1``, ``v2/hf``, ``v1/hf`` output tokens/s ratios (HF: on the same requests),
    and ``a/b`` for every extra pair (speculative variants, ``mrv2.bench.spec.spec_pairs``)."""
    def tok(name, key=None):
        r = runners.get(name) or {}
        return (r.get(key) or {}).get("output_tok_s") if key else r.get("output_tok_s")

    ratios = {}
    if tok("v2") and tok("v1"):
        ratios["v2/v1"] = tok("v2") / tok("v1")
    for name in ("v2", "v1"):  # prefix caching on / off
        if tok(name) and tok(f"{name}-no-pc"):
            ratios[f"{name}/{name}-no-pc"] = tok(name) / tok(f"{name}-no-pc")
    for a, b in pairs:
        if tok(a) and tok(b):
            ratios[f"{a}/{b}"] = tok(a) / tok(b)
    for name in ("v2", "v1"):
        same = tok(name, "subset") or tok(name)  # the subset run holds HF's exact requests
        if tok("hf") and same:
            ratios[f"{name}/hf"] = same / tok("hf")
    return ratios


def throughput_roofline(info: dict | None, bw: dict, wl, max_num_seqs: int,
                        sweep: list) -> dict:
    """Decode roofline at the workload's mean batch and mean context (and per sweep point)."""
    if info is None:
        return {}
    kw = (info["weight_bytes"], info["kv_bytes_per_token"])
    batch = min(wl.num_requests, max_num_seqs)
    context = wl.summary()["input_len_mean"] + wl.summary()["output_len_mean"] / 2
    out = {"bandwidth_gbs": bw["bandwidth_gbs"], "decode": decode_roofline(
        *kw, batch, context, bw["bandwidth_gbs"]),
        "definition": "decode step at batch=min(num_requests, max_num_seqs), context="
                      "mean input + mean output / 2; bytes = weights + KV read; "
                      "time = bytes / measured copy bandwidth (read+write)",
        "workload": workload_roofline(*kw, wl.input_lens, wl.output_lens, max_num_seqs,
                                      bw["bandwidth_gbs"]),
        "workload_definition": "every decode step of the workload's schedule (at most "
                               "max_num_seqs at once, freed slots refilled in order): "
                               "weights + each request's context per step, over the "
                               "measured bandwidth; all output tokens / that time"}
    if sweep:
        out["sweep"] = [decode_roofline(*kw, w.num_requests, w.input_lens[0] +
                                        w.output_lens[0] / 2, bw["bandwidth_gbs"]) for w in sweep]
    return out


def _throughput_notes(repeats: int, wl, hf_wl, with_hf: bool) -> list[str]:
    notes = [("output tok/s = requested output tokens / wall time of one timed LLM.generate "
              "(torch.cuda.synchronize before and after), after one warm-up generate"
              + (f"; mrv2 runners: fastest of {repeats} timed runs (all under 'runs': the "
                 "first also absorbs one-time kernel compilations), hf: one run"
                 if repeats > 1 else "")),
             "ratios a/b = output tok/s of a / output tok/s of b (higher: a is faster)",
             ("prefix cache: emptied before every timed run, except on shared-prefix, where "
              "each run draws new distinct tokens after the shared prefix (so only the "
              "prefix, warm from the warm-up, can hit); <runner>-no-pc = the same runner "
              "without caching; cached_prompt_tokens / prompt_tokens per run")]
    if with_hf:
        notes += hf_runs.NOTES
        if hf_wl is not wl:
            notes.append(f"hf ran only the first {hf_wl.num_requests} of {wl.num_requests} "
                         "requests (--hf-max-requests); the v2/hf and v1/hf ratios use each "
                         "mrv2 runner's 'subset' run of the same requests")
    return notes


def run_latency(cfg: BenchConfig, log=print) -> dict:
    """TTFT and TPOT of every runner at batch sizes 1, 8, 32 (see ``mrv2.bench``).

    Returns:
        The results dict (what ``python -m mrv2 bench latency`` writes as JSON).
    """
    spec_model, hf_config = resolve_model(cfg)
    specs = spec_variants(cfg, spec_model)
    tiny = cfg.tiny
    sizes_b = cfg.batch_sizes or ([1, 2] if tiny else [1, 8, 32])
    # NOTE: tiny + speculation: a few more tokens, so the timed runs have speculating steps.
    in_len = cfg.input_len or (16 if tiny else 128)
    out_len = cfg.output_len or ((6 if cfg.speculative else 4) if tiny else 128)
    if cfg.workload == "shared-prefix":  # a shared prefix + distinct tokens (new every run)
        prefix = cfg.prefix_len or (32 if tiny else 1024)
        suffix = cfg.suffix_len or (5 if tiny else 64)
        in_len = prefix + suffix
        batches = [shared_prefix_workload(f"latency-shared-b{b}", b, prefix, suffix, out_len,
                                          hf_config.vocab_size, cfg.seed) for b in sizes_b]
    elif cfg.workload == "repetitive":  # a repeated loop (speculative decoding), greedy
        batches = [repetitive_workload(f"latency-repetitive-b{b}", b, in_len, out_len,
                                       hf_config.vocab_size, cfg.seed,
                                       _embedded_loop(spec_model)) for b in sizes_b]
    elif cfg.workload == "shakespeare":  # held-out text (speculative decoding), greedy
        tok = _tokenizer(spec_model)
        batches = [shakespeare_workload(f"latency-shakespeare-b{b}", b, in_len, out_len,
                                        shared_data_dir() / SHAKESPEARE_FILE, tok, cfg.seed)
                   for b in sizes_b]
    else:
        batches = [random_workload(f"latency-b{b}", b, (in_len, in_len), (out_len, out_len),
                                   hf_config.vocab_size, cfg.seed) for b in sizes_b]
    _set_temperature(cfg, batches)
    sizes = llm_runs.EngineSizes(max(sizes_b + [cfg.max_num_seqs or 0]), in_len + out_len,
                                 cfg.max_num_batched_tokens, cfg.enforce_eager,
                                 cfg.async_scheduling, cfg.cudagraph_mode)
    _check_len(sizes.max_model_len, hf_config)
    iters = _default(cfg.latency_iters, 3, 1, tiny)
    results = _header(cfg, spec_model, log)
    results.update(workload=_workload_label(cfg, spec_model, batches[0].temperature),
                   workload_stats=batches[0].summary())
    info = None
    mrv2_runners = [n for n in cfg.runners if n != "hf"]
    if mrv2_runners:  # built together, measured taking turns
        try:
            measured = llm_runs.run_latency(spec_model, mrv2_runners, sizes, batches,
                                            iters=iters, specs=specs, log=log,
                                            caching=PREFIX_CACHING[cfg.prefix_caching])
        except Exception as e:  # noqa: BLE001  (hf may still run)
            error = error_row(", ".join(mrv2_runners), e, log)
            measured = {n: (dict(error), None) for n in mrv2_runners}
        memory = free_device_memory()
        for name, (res, runner_info) in measured.items():
            results["runners"][name] = {**res, "memory_after_free": memory}
            info = info or runner_info
    if "hf" in cfg.runners:
        results["runners"]["hf"], runner_info = _guarded("hf", lambda: hf_runs.run_latency(
            spec_model, batches, iters=iters, cache_implementation=cfg.hf_cache, log=log), log)
        info = info or runner_info
    results["model_info"] = info
    results["ratios"] = latency_ratios(results["runners"],
                                       spec.spec_pairs(list(results["runners"]), specs))
    if info is not None:
        bw = results["copy_bandwidth"]["bandwidth_gbs"]
        results["roofline"] = {"bandwidth_gbs": bw, "per_batch": [decode_roofline(
            info["weight_bytes"], info["kv_bytes_per_token"], b, in_len + out_len / 2, bw)
            for b in sizes_b]}
    results["notes"] += [
        ("TTFT = wall time of a prefill-only generate (max_tokens=1) of the whole batch, "
        "all prompts submitted at once; TPOT = (e2e - TTFT) / (output_len - 1); medians"),
        ("the mrv2 runners are built together and take turns run by run (a drift of the "
         "host falls on both alike); hf runs after them"),
        "latency ratios a/b = TPOT (or TTFT) of a / of b (lower: a is faster)",
        ("prefix cache: emptied before every timed run, except on shared-prefix, where each "
         "run draws new distinct tokens after the shared prefix (so only the prefix, warm "
         "from the warm-up, can hit); <runner>-no-pc = the same runner without caching"),
        ("roofline per_batch step_ms is the best possible TPOT at that batch (context = "
        "input_len + output_len / 2) for one token per step (speculation can beat it)")]
    results["notes"] += spec.NOTES if cfg.speculative else []
    return results


def latency_ratios(runners: dict, pairs: list[tuple[str, str]] = ()) -> dict:
    """Per batch size: ``tpot`` and ``ttft`` ratios a/b for (v2, v1), (v2, hf), (v1, hf),
    and for every extra pair (speculative variants, ``mrv2.bench.spec.spec_pairs``)."""
    def rows(name):
        r = runners.get(name) or {}
        return {row["batch_size"]: row for row in r.get("batches", [])}

    out = {}
    for a, b in (("v2", "v1"), ("v2", "hf"), ("v1", "hf"), ("v2", "v2-no-pc"),
                 ("v1", "v1-no-pc"), *pairs):
        ra, rb = rows(a), rows(b)
        common = sorted(set(ra) & set(rb))
        if common:
            out[f"{a}/{b}"] = {key: {str(bs): ra[bs][f"{key}_ms"] / rb[bs][f"{key}_ms"]
                                     for bs in common
                                     if ra[bs][f"{key}_ms"] and rb[bs][f"{key}_ms"]}
                               for key in ("tpot", "ttft")}
    return out
