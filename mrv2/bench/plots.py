"""Figures from a benchmark results JSON (pure matplotlib: no GPU, no mrv2 model).

Every function takes a results dict or a path to the JSON, and an optional axis, so a
notebook can draw the H200 figures committed under ``benchmarks/results/`` on any
laptop; ``save_plots`` writes the PNG of ``python -m mrv2 bench ... --plot``.
"""

from __future__ import annotations

import json
import os
import pathlib

COLORS = {"v2": "tab:green", "v1": "tab:blue", "hf": "tab:orange",
          # speculative variants of v2 (mrv2.bench.spec)
          "v2-ngram": "tab:purple", "v2-ngram-sync": "tab:pink",
          "v2-draft_model": "tab:red", "v2-draft_model-sync": "tab:brown"}
ROOF_STYLE = {"color": "black", "linestyle": "--", "linewidth": 1.2}
#: Step phases of ``mrv2.timeline``, in the order a step runs them, with its colours.
PHASES = {"schedule": "tab:purple", "prep": "tab:blue", "forward": "tab:orange",
          "sample": "tab:green", "wait": "tab:red", "output": "tab:gray"}


def load_results(src: str | os.PathLike | dict) -> dict:
    """A results dict, from a dict (returned as is) or a JSON path."""
    if isinstance(src, dict):
        return src
    return json.loads(pathlib.Path(src).read_text())


def _axis(ax, figsize=(6, 4)):
    if ax is None:
        import matplotlib.pyplot as plt

        _, ax = plt.subplots(figsize=figsize)
    return ax


def _ok(results: dict):
    """(name, figures) of the runners that did not fail."""
    return [(n, r) for n, r in results.get("runners", {}).items() if "error" not in r]


def _title(results: dict, what: str) -> str:
    hw = results.get("hardware", {}).get("name", "?")
    return f"{what} ({hw})"


def plot_throughput(results, ax=None):
    """Bar chart of output tokens/s per runner, with the decode roofline as a line.

    Args:
        results: a throughput results dict or JSON path.
        ax: a matplotlib axis (default: a new figure).

    Returns:
        The axis.
    """
    res, ax = load_results(results), _axis(ax)
    rows = _ok(res)
    names = [f"{n}\n({r.get('num_requests', '?')} req)" for n, r in rows]
    vals = [r["output_tok_s"] for _, r in rows]
    bars = ax.bar(names, vals, color=[COLORS.get(n, "gray") for n, _ in rows])
    ax.bar_label(bars, fmt="%.0f", fontsize=8)
    roof = res.get("roofline", {}).get("decode")
    if roof:
        ax.axhline(roof["tok_s"], **ROOF_STYLE,
                   label=f"decode roofline (batch {roof['batch']}, ctx {roof['context']:.0f})")
        ax.legend(fontsize=8, loc="upper right")
        if vals and roof["tok_s"] > 5 * max(vals):  # NOTE: far above the bars: log scale
            ax.set_yscale("log")
    ax.set_ylabel("output tokens / s")
    ax.set_title(_title(res, f"throughput, {res.get('workload', '')}"), fontsize=9)
    return ax


def plot_latency(results, axes=None):
    """TTFT and TPOT against batch size per runner (TPOT with the roofline step time).

    Args:
        results: a latency results dict or JSON path.
        axes: two matplotlib axes (default: a new figure with two panels).

    Returns:
        The two axes.
    """
    res = load_results(results)
    if axes is None:
        import matplotlib.pyplot as plt

        _, axes = plt.subplots(1, 2, figsize=(10, 4))
    for name, r in _ok(res):
        for ax, key in zip(axes, ("ttft_ms", "tpot_ms")):
            rows = [row for row in r["batches"] if row.get(key) is not None]
            ax.plot([row["batch_size"] for row in rows], [row[key] for row in rows], "o-",
                    label=name, color=COLORS.get(name, "gray"))
    roof = res.get("roofline", {}).get("per_batch")
    if roof:
        axes[1].plot([r["batch"] for r in roof], [r["step_ms"] for r in roof], **ROOF_STYLE,
                     label="roofline step")
    for ax, label in zip(axes, ("TTFT (ms)", "TPOT (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size")
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
        ax.set_title(_title(res, label.split()[0]), fontsize=9)
    return axes


def _achieved_vs_batch(res: dict) -> dict:
    """{runner: (batch sizes, tokens/s)} from a sweep or from latency rows."""
    out = {}
    for name, r in _ok(res):
        if r.get("sweep"):
            out[name] = ([s["batch_size"] for s in r["sweep"]],
                         [s["output_tok_s"] for s in r["sweep"]])
        elif r.get("batches"):
            rows = [b for b in r["batches"] if (b.get("tpot_ms") or 0) > 0]
            out[name] = ([b["batch_size"] for b in rows],
                         [1e3 * b["batch_size"] / b["tpot_ms"] for b in rows])
    return out


def plot_roofline(results, ax=None):
    """Achieved decode tokens/s against batch size, under the memory roofline curve.

    Uses the throughput sweep (``--sweep-batch``) or, for latency results,
    ``batch / TPOT``. Without either, draws achieved ms/step against the roofline
    step time of the workload's decode step, per runner.

    Returns:
        The axis.
    """
    res, ax = load_results(results), _axis(ax)
    roof = res.get("roofline", {})
    curve = roof.get("sweep") or roof.get("per_batch")
    achieved = _achieved_vs_batch(res)
    if curve and achieved:
        for name, (bs, tok) in achieved.items():
            ax.plot(bs, tok, "o-", label=name, color=COLORS.get(name, "gray"))
        ax.plot([c["batch"] for c in curve], [c["tok_s"] for c in curve], **ROOF_STYLE,
                label=f"roofline ({roof['bandwidth_gbs']:.0f} GB/s copy)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch size")
        ax.set_ylabel("decode tokens / s")
    else:
        rows = [(n, r["mean_step_ms"]) for n, r in _ok(res) if r.get("mean_step_ms")]
        if roof.get("decode"):
            rows.append(("roofline", roof["decode"]["step_ms"]))
        bars = ax.bar([n for n, _ in rows], [v for _, v in rows],
                      color=[COLORS.get(n, "lightgray") for n, _ in rows])
        ax.bar_label(bars, fmt="%.2f", fontsize=8)
        ax.set_ylabel("ms / step (roofline: decode step)")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    ax.set_title(_title(res, "roofline"), fontsize=9)
    return ax


def plot_step_split(results, ax=None):
    """Stacked mean CPU ms per phase of one step, per runner (from ``--timeline``).

    Returns:
        The axis, or ``None`` when no runner recorded a timeline.
    """
    res = load_results(results)
    rows = [(n, r["timeline"]) for n, r in _ok(res) if r.get("timeline")]
    if not rows:
        return None
    ax = _axis(ax)
    seen = {p for _, t in rows for p in t.get("cpu_ms", {})}
    phases = [p for p in PHASES if p in seen] + sorted(seen - set(PHASES))
    bottom = [0.0] * len(rows)
    for i, phase in enumerate(phases):
        vals = [t.get("cpu_ms", {}).get(phase, 0.0) for _, t in rows]
        ax.bar([n for n, _ in rows], vals, bottom=bottom, label=phase,
               color=PHASES.get(phase, f"C{i}"))
        bottom = [b + v for b, v in zip(bottom, vals)]
    for i, (_, t) in enumerate(rows):
        if t.get("gpu_ms_per_step"):
            ax.plot([i - 0.4, i + 0.4], [t["gpu_ms_per_step"]] * 2, "k-", linewidth=2)
    ax.set_ylabel("CPU ms per step (black: GPU ms per step)")
    ax.legend(fontsize=7)
    ax.set_title(_title(res, "per-step split"), fontsize=9)
    return ax


def save_plots(results, path: str | os.PathLike) -> pathlib.Path:
    """Write the benchmark's figure (all panels that apply) as one PNG.

    Returns:
        The PNG path.
    """
    from matplotlib.figure import Figure

    res = load_results(results)
    latency = res.get("benchmark") == "latency"
    has_split = any(r.get("timeline") for _, r in _ok(res))
    panels = 3 if latency or has_split else 2
    fig = Figure(figsize=(5 * panels, 4), layout="constrained")
    axes = fig.subplots(1, panels)
    if latency:
        plot_latency(res, axes[:2])
        plot_roofline(res, axes[2])
    else:
        plot_throughput(res, axes[0])
        plot_roofline(res, axes[1])
        if has_split:
            plot_step_split(res, axes[2])
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return path
