"""``bench decode``: what one decode step costs on the GPU, kernel by kernel, vs its roofline.

For each context and batch size, the same prompts run twice through ``LLM.generate``:
``1 + warmup`` output tokens, then ``1 + warmup + steps``. Everything but the last
``steps`` decode steps is the same in both runs (prefix caching is off, so the prefill
repeats), so the difference of any count divided by ``steps`` is the cost of one decode
step in the steady state: wall ms (timed without the profiler), and from the torch
profiler the kernels launched, their GPU ms (the union of their time ranges: kernels that
overlap under PDL count once), and a per-kernel table. CUDA graphs are on
(the V2 default), so the step is whatever the replayed graph and the few kernels around
it do. The roofline of the step (weights + the requests' cached K/V read once at the
measured copy bandwidth, ``bench/roofline.py``) gives the fraction reached.

A context may also be a range ``(lo, hi)`` (``--contexts 100-1024`` on the command line):
the batch's prompt lengths then spread evenly from ``lo`` to ``hi``, in a seeded random
order, as a server's mix of requests does (the standard workload draws 100-1,024 tokens).
Against a uniform point of the same mean it isolates what mixing costs: one request's
programs run ``hi / lo`` times longer than another's, and a launch ends with its longest.

On the CPU the profiler sees no GPU kernels: the figures come from the top-level torch
ops of the interpreter's run and say nothing about a GPU (the tiny preset only checks
that the benchmark runs).
"""

from __future__ import annotations

import statistics
from collections import defaultdict

import torch

from mrv2 import LLM, SamplingParams, platform
from mrv2.bench.roofline import copy_bandwidth, decode_roofline, model_info
from mrv2.bench.timing import free_device_memory
from mrv2.bench.timing import random_token_prompts as _prompts
from mrv2.bench.timing import timed_generate as _timed_generate


def busy_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals: the time at least one ran.

    Kernels launched with programmatic dependent launch (``mrv2/kernels/pdl.py``) start
    while their predecessor still runs and sit in ``griddepcontrol.wait``, so the sum of
    kernel durations counts the overlap twice; the union is the time the GPU was busy.
    """
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def _kernel_totals(llm: LLM, prompts, sp) -> tuple[dict[str, list[float]], float]:
    """``{name: [launches, total us]}`` of the device kernels (CPU: top-level ops) of a run,
    and the union of their time ranges in us (``busy_us``)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if platform.HAS_CUDA else [])
    with profile(activities=acts) as prof:
        llm.generate(prompts, sp, use_tqdm=False)
        if platform.HAS_CUDA:
            torch.cuda.synchronize()
    totals: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    spans = []
    for evt in prof.events():
        on_device = evt.device_type != torch.autograd.DeviceType.CPU
        if on_device if platform.HAS_CUDA else (evt.cpu_parent is None
                                                and evt.name.startswith("aten::")):
            t = totals[evt.name]
            t[0] += 1
            t[1] += evt.time_range.elapsed_us()
            spans.append((evt.time_range.start, evt.time_range.end))
    return dict(totals), busy_us(spans)


Context = int | tuple[int, int]


def context_lengths(context: Context, batch: int, seed: int = 0) -> list[int]:
    """Prompt lengths of a point's ``batch`` requests.

    Args:
        context: one length for every request, or ``(lo, hi)``: lengths spread evenly from
            ``lo`` to ``hi`` (both included when ``batch > 1``), shuffled with ``seed``.
        batch: requests.
        seed: the shuffle's seed.

    Returns:
        ``batch`` positive lengths.
    """
    if isinstance(context, int):
        if context < 1:
            raise ValueError(f"context must be >= 1, got {context}")
        return [context] * batch
    lo, hi = context
    if not 1 <= lo <= hi:
        raise ValueError(f"a context range needs 1 <= lo <= hi, got {lo}-{hi}")
    import numpy as np

    lengths = np.rint(np.linspace(lo, hi, batch)).astype(int) if batch > 1 else np.array([lo])
    return [int(n) for n in np.random.RandomState(seed).permutation(lengths)]


def context_label(context: Context) -> str:
    """``"128"`` or ``"100-1024"``: how a point's context is written in tables and JSON."""
    return str(context) if isinstance(context, int) else f"{context[0]}-{context[1]}"


def _mixed_prompts(lengths: list[int], vocab: int, seed: int) -> list[dict]:
    """Token-id prompts of the given lengths (each ``random_token_prompts``' kind)."""
    if len(set(lengths)) == 1:
        return _prompts(len(lengths), lengths[0], vocab, seed=seed)
    return [_prompts(1, n, vocab, seed=seed * 1009 + i)[0] for i, n in enumerate(lengths)]


def decode_warmup(batch: int, context: int, budget: int, warmup: int) -> int:
    """Decode steps both runs share before the measured ones: ``warmup``, or more when the
    prompts are prefilled in chunks.

    NOTE: ``batch x context`` prompt tokens above the step's token budget are prefilled
    over several steps, and until the last chunk the short run's first requests finish
    while the long run's keep decoding: the two runs then differ in more than the measured
    decode steps (job 13A, 256 x 768 keys, budget 8,192: fractional launch counts, GPU ms
    above wall ms). Both runs decode past the last chunk first; while prefilling, each step
    also decodes up to ``batch`` tokens of the requests already in.
    """
    if batch * context <= budget:
        return warmup
    chunks = -(-batch * context // max(budget - batch, 1))
    return max(warmup, chunks + 1)


def step_kernels(short: dict, long: dict, steps: int) -> list[dict]:
    """Per-kernel cost of one step: ``(long - short) / steps``, most expensive first.

    Args:
        short, long: ``_kernel_totals`` of the two runs.
        steps: decode steps ``long`` has beyond ``short``.

    Returns:
        ``[{"name", "launches_per_step", "ms_per_step"}]`` (kernels the long run added).
    """
    rows = []
    for name, (n, us) in long.items():
        n0, us0 = short.get(name, (0, 0.0))
        if n > n0:
            rows.append({"name": name, "launches_per_step": (n - n0) / steps,
                         "ms_per_step": max(us - us0, 0.0) / steps / 1e3})
    return sorted(rows, key=lambda r: -r["ms_per_step"])


def profile_decode(llm_kwargs: dict, batch_sizes=(1, 8, 32, 64, 128, 256),
                   contexts=(128, 1024), steps: int = 32, warmup: int = 4,
                   temperature: float = 0.6, repeats: int = 2, top: int = 15) -> dict:
    """Kernels, GPU ms and wall ms of one decode step per (context, batch), vs the roofline.

    Args:
        llm_kwargs: ``LLM`` arguments; ``max_num_seqs`` and prefix caching are set here.
        batch_sizes, contexts: the grid (context = prompt tokens of every request, or a
            ``(lo, hi)`` range the batch's prompt lengths spread over: ``context_lengths``).
        steps: decode steps measured (the difference of the two runs).
        warmup: decode steps both runs share before the measured ones (more where the
            prompts are prefilled in chunks: ``decode_warmup``; each point records its own).
        temperature: of every request (0: greedy, no Gumbel noise).
        repeats: wall-clock pairs per point (the median counts).
        top: rows of the per-kernel table kept per point.

    Returns:
        ``{"settings", "bandwidth_gbs", "model_info", "points": [...]}``, each point with
        ``kernels_per_step``, ``gpu_ms_per_step`` (the time some kernel ran: overlapping
        PDL kernels count once), ``kernel_sum_ms_per_step`` (the kernels' durations added,
        the per-kernel table's total), ``wall_ms_per_step``, ``roofline``,
        ``roofline_fraction_gpu`` / ``_wall`` and ``kernels`` (the table).
    """
    llm = LLM(**{**llm_kwargs, "max_num_seqs": max(batch_sizes),
                 "enable_prefix_caching": False})
    info = model_info(llm.model, llm.hf_config, llm.dtype)
    bw = copy_bandwidth(platform.DEVICE, None if platform.HAS_CUDA else 8 << 20)
    vocab = llm.hf_config.vocab_size
    budget, max_len = (llm.scheduler_config.max_num_batched_tokens,
                       llm.scheduler_config.max_model_len)
    lens = {(i, b): context_lengths(ctx, b, seed=b) for i, ctx in enumerate(contexts)
            for b in batch_sizes}
    # NOTE: a mixed batch's chunks fill the budget as a uniform one of its mean length would
    wus = {k: decode_warmup(k[1], -(-sum(n) // k[1]), budget, warmup) for k, n in lens.items()}
    for (i, b), wu in wus.items():  # every point fits, checked before any of them runs
        need = max(lens[(i, b)]) + 1 + wu + steps
        if need > max_len:
            raise ValueError(f"bench decode: batch {b} x context {context_label(contexts[i])} "
                             f"needs {need} tokens a request (warm-up steps past a chunked "
                             f"prefill, {steps} measured), above max_model_len={max_len}")
    points = []
    for i, ctx in enumerate(contexts):
        for b in batch_sizes:
            wu, lengths = wus[(i, b)], lens[(i, b)]
            first = ctx if isinstance(ctx, int) else ctx[0] * 31 + ctx[1]
            prompts = _mixed_prompts(lengths, vocab, seed=b * 7919 + first)
            sp = [SamplingParams(temperature=temperature, max_tokens=1 + wu + n,
                                 ignore_eos=True, seed=0) for n in (0, steps)]
            _timed_generate(llm, prompts, sp[1])  # warm-up: compiles, graph captures
            wall = statistics.median(
                (_timed_generate(llm, prompts, sp[1]) - _timed_generate(llm, prompts, sp[0]))
                / steps * 1e3 for _ in range(repeats))
            (short, busy0), (long, busy1) = (_kernel_totals(llm, prompts, s) for s in sp)
            table = step_kernels(short, long, steps)
            gpu_ms = max(busy1 - busy0, 0.0) / steps / 1e3
            # the measured steps read contexts ctx + 1 + wu ... ctx + wu + steps
            # (the roofline is linear in the context: a mixed batch's is at its mean)
            mean_ctx = sum(lengths) / len(lengths)
            roof = decode_roofline(info["weight_bytes"], info["kv_bytes_per_token"], b,
                                   mean_ctx + wu + (steps + 1) / 2, bw["bandwidth_gbs"])
            points.append({
                "batch": b, "context": ctx if isinstance(ctx, int) else context_label(ctx),
                "mean_context": mean_ctx, "warmup_steps": wu,
                "kernels_per_step": sum(r["launches_per_step"] for r in table),
                "gpu_ms_per_step": gpu_ms, "wall_ms_per_step": wall, "roofline": roof,
                "kernel_sum_ms_per_step": sum(r["ms_per_step"] for r in table),
                "roofline_fraction_gpu": roof["step_ms"] / gpu_ms if gpu_ms > 0 else None,
                "roofline_fraction_wall": roof["step_ms"] / wall if wall > 0 else None,
                "kernels": table[:top]})
    del llm  # NOTE: the last reference: only then can its memory go back
    free_device_memory()
    return {"settings": {"steps": steps, "warmup": warmup, "temperature": temperature,
                         "max_model_len": max_len, "max_num_batched_tokens": budget,
                         "repeats": repeats, "cuda_graphs": not llm_kwargs.get("enforce_eager"),
                         "meaningful": platform.HAS_CUDA},
            "bandwidth_gbs": bw["bandwidth_gbs"], "model_info": info, "points": points}


def profile_table(result: dict, kernels: int = 15) -> str:
    """One line per point, then each point's top kernels."""
    head = (f"{'batch':>5} {'ctx':>5} {'kernels':>8} {'GPU ms':>8} {'wall ms':>8} "
            f"{'roof ms':>8} {'roof/GPU':>8} {'roof/wall':>9}")
    lines = [head]
    for p in result["points"]:
        fg, fw = p["roofline_fraction_gpu"], p["roofline_fraction_wall"]
        lines.append(f"{p['batch']:>5} {p['context']!s:>5} {p['kernels_per_step']:>8.1f} "
                     f"{p['gpu_ms_per_step']:>8.3f} {p['wall_ms_per_step']:>8.3f} "
                     f"{p['roofline']['step_ms']:>8.3f} "
                     f"{fg if fg is None else format(fg, '8.0%'):>8} "
                     f"{fw if fw is None else format(fw, '9.0%'):>9}")
    for p in result["points"]:
        lines.append(f"-- batch {p['batch']}, context {p['context']}: top kernels "
                     "(launches/step, ms/step)")
        for r in p["kernels"][:kernels]:
            lines.append(f"   {r['launches_per_step']:6.1f} {r['ms_per_step']:8.4f}  "
                         f"{r['name'][:90]}")
    return "\n".join(lines)


def plot_profile(result: dict, path=None):
    """Wall, GPU kernel and roofline ms per step, one group of bars per (context, batch)."""
    import matplotlib.pyplot as plt
    import numpy as np

    pts = result["points"]
    x = np.arange(len(pts))
    fig, ax = plt.subplots(figsize=(max(6, 0.7 * len(pts) + 2), 3.8))
    for i, (key, label) in enumerate((("wall_ms_per_step", "wall"),
                                      ("gpu_ms_per_step", "GPU kernels"),
                                      (None, "roofline"))):
        vals = [p["roofline"]["step_ms"] if key is None else p[key] for p in pts]
        ax.bar(x + (i - 1) * 0.27, vals, 0.27, label=label)
    ax.set_xticks(x, [f"B={p['batch']}\nctx {p['context']}" for p in pts], fontsize=7)
    ax.set_ylabel("ms per decode step")
    title = "decode step vs its roofline (CUDA graphs)"
    ax.set_title(title if result["settings"]["meaningful"] else title + ": CPU, meaningless")
    ax.legend()
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig
