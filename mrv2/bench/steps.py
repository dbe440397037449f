"""Step-level benchmarks: what async scheduling and CUDA graphs each buy.

* ``decode``: ``bench/decode_profile.py`` (kernels, GPU and wall ms of one decode
  step vs its roofline); with ``--compare-eager`` also the decode step time with and
  without CUDA graphs at several batch sizes (``decode_step_times``). Each batch runs twice, ``max_tokens=1`` (prefill only) and
  ``1 + steps``; the difference divided by ``steps`` is the time of one decode
  step, wall clock, as a user sees it (launch overhead included).
* ``timeline``: the same workload with async scheduling off and on, recorded by
  ``mrv2.timeline.Timeline``; reports the GPU's idle fraction between steps and
  saves the spans (and a plot) so a reader sees step N+1's CPU work overlap step
  N's GPU work.

Run through ``python -m mrv2 bench decode|timeline``; results go to
``benchmarks/results/`` as JSON (+ PNG).
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

from mrv2 import LLM, SamplingParams
from mrv2.bench.timing import count_triton_compiles, free_device_memory
from mrv2.bench.timing import random_token_prompts as _prompts
from mrv2.bench.timing import timed_generate as _timed_generate


def decode_step_times(llm_kwargs: dict, batch_sizes=(1, 64, 256), context: int = 128,
                      steps: int = 64, graphs=(True, False), repeats: int = 3) -> dict:
    """Decode step time (ms) per batch size, with and without CUDA graphs.

    Args:
        llm_kwargs: ``LLM`` arguments (model, load_format, ...); ``max_num_seqs`` and
            ``enforce_eager`` are set here.
        batch_sizes: decode batch sizes to time.
        context: prompt length of every request.
        steps: decode steps timed per run.
        graphs: which settings to run (True: CUDA graphs, False: eager).
        repeats: runs per point; the median is kept.

    Returns:
        ``{"graphs": {B: ms}, "eager": {B: ms}}`` plus the settings and
        ``triton_compiles`` (per mode, inside the timed runs: should be 0).
    """
    out: dict = {"context": context, "steps": steps, "repeats": repeats, "triton_compiles": {}}
    for use_graphs in graphs:
        # NOTE: prefix caching off, as in ``profile_decode``. With it on, the timed runs hit
        # the blocks the warm-up left and prefill a different shape than the warm-up did:
        # at 64 and 128 requests that eager prefill compiled a new attention variant inside
        # the first timed pair (job 18C: "CUDA graphs" 18.1 / 21.6 ms a step, the median of
        # a pair with and without a ~2 s compile; 1.65 / 2.43 ms with caching off).
        llm = LLM(**{**llm_kwargs, "max_num_seqs": max(batch_sizes),
                     "enforce_eager": not use_graphs, "enable_prefix_caching": False})
        vocab = llm.hf_config.vocab_size
        times, compiles = {}, 0
        for b in batch_sizes:
            prompts = _prompts(b, context, vocab, seed=b)
            first = SamplingParams(temperature=0.6, max_tokens=1, ignore_eos=True, seed=0)
            full = SamplingParams(temperature=0.6, max_tokens=1 + steps, ignore_eos=True, seed=0)
            _timed_generate(llm, prompts, full)  # warm-up
            with count_triton_compiles() as names:
                per = [(_timed_generate(llm, prompts, full) - _timed_generate(llm, prompts, first))
                       / steps * 1e3 for _ in range(repeats)]
            times[b] = float(np.median(per))
            compiles += len(names)
        mode = "graphs" if use_graphs else "eager"
        out[mode], out["triton_compiles"][mode] = times, compiles
        if compiles:
            warnings.warn(f"bench decode --compare-eager: {compiles} Triton compiles inside the "
                          f"timed {mode} runs: their step times include compile time")
        del llm  # NOTE: the last reference: only then can its memory go back
        free_device_memory()
    if "graphs" in out and "eager" in out:
        out["speedup"] = {b: out["eager"][b] / out["graphs"][b] for b in batch_sizes}
    return out


def async_timelines(llm_kwargs: dict, num_requests: int = 256, input_len: int = 32,
                    output_len: int = 128, window: tuple[int, int] = (40, 56)) -> dict:
    """The GPU idle fraction between steps with async scheduling off and on.

    Args:
        llm_kwargs: ``LLM`` arguments; ``async_scheduling`` is set here.
        num_requests, input_len, output_len: the workload (host-bound by default).
        window: steps whose spans are kept in the result, for plotting.

    Returns:
        ``{"sync": {...}, "async": {...}}``: each the timeline summary
        (``gpu_idle_fraction``, ``gpu_ms_per_step``, mean ms per phase), wall time,
        output tok/s and the spans of the window.
    """
    from mrv2.timeline import Timeline

    out: dict = {"num_requests": num_requests, "input_len": input_len,
                 "output_len": output_len, "window": list(window)}
    for name, flag in (("sync", False), ("async", True)):
        llm = LLM(**{**llm_kwargs, "async_scheduling": flag})
        prompts = _prompts(num_requests, input_len, llm.hf_config.vocab_size)
        sp = SamplingParams(temperature=0.6, max_tokens=output_len, ignore_eos=True)
        _timed_generate(llm, prompts[:16], sp)  # warm-up
        tl = Timeline()
        llm.engine.timeline = tl
        wall = _timed_generate(llm, prompts, sp)
        llm.engine.timeline = None
        data = tl.finalize().to_dict()
        lo, hi = window
        out[name] = {"summary": data["summary"], "wall_s": wall,
                     "output_tok_per_s": num_requests * output_len / wall,
                     "cpu": [d for d in data["cpu"] if lo <= d["step"] < hi],
                     "gpu": [d for d in data["gpu"] if lo <= d["step"] < hi]}
        del llm  # NOTE: the last reference: only then can its memory go back
        free_device_memory()
    return out


def plot_async_timelines(result: dict, path=None):
    """Two timelines, sync above async, from ``async_timelines``' result (or its JSON)."""
    import matplotlib.pyplot as plt

    from mrv2.timeline import plot_timeline

    fig, axes = plt.subplots(2, 1, figsize=(12, 5.2))
    lo, hi = result["window"]
    num = min(6, hi - lo)
    for ax, name in zip(axes, ("sync", "async")):
        r = result[name]
        idle = r["summary"].get("gpu_idle_fraction", float("nan"))
        plot_timeline(r, ax, first_step=lo, num_steps=num,
                      title=f"{name}: GPU idle {idle:.0%} between steps, "
                            f"{r['output_tok_per_s']:,.0f} output tok/s")
    axes[0].get_legend().remove()
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig


def plot_decode_step_times(result: dict, path=None):
    """Decode step time vs batch size, graphs vs eager (bars)."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    sizes = sorted(int(b) for b in result["eager" if "eager" in result else "graphs"])
    x = np.arange(len(sizes))
    for i, key in enumerate(k for k in ("eager", "graphs") if k in result):
        vals = [result[key][str(b)] if str(b) in result[key] else result[key][b] for b in sizes]
        ax.bar(x + (i - 0.5) * 0.4, vals, 0.4, label="CUDA graphs" if key == "graphs" else key)
    ax.set_xticks(x, [str(b) for b in sizes])
    ax.set_xlabel("decode batch size")
    ax.set_ylabel("ms per decode step")
    ax.legend()
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig


def _default_llm_kwargs(model: str | None, max_model_len: int) -> dict:
    """Qwen3-0.6B's shape with dummy bf16 weights on a GPU; the embedded model on the CPU."""
    from mrv2.bench.suite import shared_data_dir

    if model is None and torch.cuda.is_available():
        return {"model": str(shared_data_dir() / "qwen3-tokenizer"), "load_format": "dummy",
                "skip_tokenizer_init": True, "max_model_len": max_model_len}
    return {"model": model, "skip_tokenizer_init": True, "max_model_len": max_model_len}


def run(kind: str, model: str | None = None, batch_sizes=(1, 64, 256), out: str | None = None,
        plot: bool = True, tiny: bool = False, contexts=(128, 1024), decode_steps: int = 32,
        compare_eager: bool = False, max_model_len: int | None = None) -> dict:
    """``python -m mrv2 bench decode|timeline``: measure, print, write JSON (+ PNG).

    Args:
        kind: ``"decode"`` (one step's kernels, GPU and wall ms vs its roofline, per batch
            and context: ``bench/decode_profile.py``) or ``"timeline"`` (async off vs on).
        model: model folder (default: Qwen3-0.6B shape, dummy weights, on a GPU).
        batch_sizes: decode batch sizes (``decode``).
        contexts, decode_steps: ``decode``: prompt lengths, and steps measured per point.
        compare_eager: ``decode``: also the wall step time with and without CUDA graphs.
        out: JSON path (default ``benchmarks/results/<kind>_steps.json``).
        plot: also save a PNG next to the JSON.
        tiny: a seconds-long CPU version (embedded model, tiny sizes) for CI.
        max_model_len: the LLM's (default 2048, tiny 512); CUDA graphs take attention's
            launch for this length.
    """
    import json
    import pathlib

    from mrv2.bench.report import environment, write_json

    if max_model_len is not None and max_model_len < 1:
        raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
    kw = _default_llm_kwargs(model, max_model_len or (512 if tiny else 2048))
    if not torch.cuda.is_available():
        kw["dtype"] = "float32"
    if kind == "decode":
        from mrv2.bench.decode_profile import profile_decode, profile_table

        sizes = (1, 2) if tiny else tuple(batch_sizes)
        result = {"profile": profile_decode(
            kw, sizes, (8,) if tiny else tuple(contexts), steps=2 if tiny else decode_steps,
            warmup=1 if tiny else 4, repeats=1 if tiny else 2)}
        print(profile_table(result["profile"]))
        if compare_eager:
            graphs = (False,) if not torch.cuda.is_available() else (True, False)
            result.update(decode_step_times(kw, sizes, context=8 if tiny else 128,
                                            steps=2 if tiny else 48, graphs=graphs,
                                            repeats=1 if tiny else 2))
            for key in ("graphs", "eager"):
                if key in result:
                    print(f"{key:>7}: " + "  ".join(f"B={b}: {ms:.2f} ms"
                                                    for b, ms in result[key].items()))
    elif kind == "timeline":
        args = {"num_requests": 4, "input_len": 8, "output_len": 6, "window": (0, 6)} if tiny else {}
        result = async_timelines(kw, **args)
        for name in ("sync", "async"):
            s = result[name]["summary"]
            print(f"{name:>5}: {result[name]['output_tok_per_s']:,.0f} output tok/s, GPU idle "
                  f"{s.get('gpu_idle_fraction', float('nan')):.1%} between steps "
                  f"({s.get('gpu_idle_fraction_incl_prep', float('nan')):.1%} with prep waits), "
                  f"{s.get('gpu_ms_per_step', float('nan')):.2f} ms/step")
    else:
        raise ValueError(f"kind must be 'decode' or 'timeline', got {kind!r}")
    result["meta"] = {**environment(), "model": kw["model"] or "embedded",
                      "load_format": kw.get("load_format", "auto")}
    path = write_json(result, out or pathlib.Path.cwd() / f"{kind}_steps.json")
    print(f"[bench] wrote {path}")
    if plot:
        import matplotlib
        matplotlib.use("Agg")
        data = json.loads(pathlib.Path(path).read_text())
        if kind == "decode":
            from mrv2.bench.decode_profile import plot_profile

            plot_profile(data["profile"], path.with_suffix(".png"))
            if "eager" in data:
                plot_decode_step_times(data, path.with_name(path.stem + "_eager.png"))
        else:
            plot_async_timelines(data, path.with_suffix(".png"))
    return result
