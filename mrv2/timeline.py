"""A per-step timeline of CPU phases and GPU spans, to *see* async scheduling.

Attach one to an engine (``llm.engine.timeline = Timeline()``) and every step
records:

* CPU spans (``time.perf_counter``): the engine's ``schedule``, the runner's
  ``prep`` / ``forward`` / ``sample`` launches, the engine's ``wait`` (blocking on
  an output event) and ``output`` (appending tokens, stop checks);
* GPU marks (CUDA events on the main stream) at the runner's phase boundaries;
  consecutive marks of one step give its GPU spans ``prep``, ``forward``,
  ``sample``.

A GPU event's time is when the GPU *reaches* it, so the gap between one step's
last mark and the next step's first is time the GPU sat idle waiting for the
CPU. ``finalize()`` (one device sync, after the run) turns events into
milliseconds on the CPU clock: the origin event is recorded right after a
synchronize, when the GPU is idle, so GPU time 0 is CPU time 0.

One timeline step is one ``Engine.step`` call; with async scheduling its ``wait``
and ``output`` spans process the launch of the call before. Without CUDA only the
CPU spans are recorded. See notebooks/07_async_streams.ipynb.
"""

from __future__ import annotations

import itertools
import time
from contextlib import contextmanager

import torch

#: Colours of the phases in ``plot`` (CPU and GPU lanes share them).
PHASE_COLORS = {"schedule": "tab:purple", "prep": "tab:blue", "forward": "tab:orange",
                "sample": "tab:green", "wait": "tab:red", "output": "tab:gray"}


class Timeline:
    """Records per-step CPU spans and GPU marks.

    Args:
        use_cuda: record GPU marks (default: when CUDA is available).
    """

    def __init__(self, use_cuda: bool | None = None):
        self.use_cuda = torch.cuda.is_available() if use_cuda is None else use_cuda
        self.step = 0
        self.cpu_spans: list[tuple[int, str, float, float]] = []   # (step, name, t0, t1) s
        self._marks: list[tuple[int, str, object]] = []             # (step, name, event)
        self.gpu_spans: list[tuple[int, str, float, float]] = []   # filled by finalize(), ms
        if self.use_cuda:
            torch.cuda.synchronize()
            self._origin = torch.cuda.Event(enable_timing=True)
            self._origin.record()
        self._t0 = time.perf_counter()

    @contextmanager
    def cpu(self, name: str):
        """Time the enclosed CPU work as phase ``name`` of the current step."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.cpu_spans.append((self.step, name, t0 - self._t0, time.perf_counter() - self._t0))

    def gpu_mark(self, name: str) -> None:
        """Record an event on the current stream: the GPU span ``name`` starts here
        (and the previous one of this step ends). ``name="end"`` closes the step."""
        if self.use_cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self._marks.append((self.step, name, ev))

    def next_step(self) -> None:
        self.step += 1

    def finalize(self) -> Timeline:
        """Wait for the GPU, then convert the marks into GPU spans (ms since the origin)."""
        if self.use_cuda and self._marks:
            torch.cuda.synchronize()
            times = [(s, n, self._origin.elapsed_time(ev)) for s, n, ev in self._marks]
            self.gpu_spans = [(s, n, t, t_next) for (s, n, t), (s2, _, t_next)
                              in itertools.pairwise(times) if s == s2 and n != "end"]
            self._marks = []
        return self

    # -- results ----------------------------------------------------------------------

    def to_dict(self) -> dict:
        """CPU and GPU spans in milliseconds since the origin (JSON-ready)."""
        return {"cpu": [{"step": s, "name": n, "start_ms": a * 1e3, "end_ms": b * 1e3}
                        for s, n, a, b in self.cpu_spans],
                "gpu": [{"step": s, "name": n, "start_ms": a, "end_ms": b}
                        for s, n, a, b in self.gpu_spans],
                "summary": self.summary()}

    def summary(self, skip_steps: int = 2) -> dict:
        """Mean ms per CPU phase and GPU span, and the GPU's idle fraction between steps.

        Args:
            skip_steps: steps at the start left out (warm-up).
        """
        out: dict = {"cpu_ms": _means((n, (b - a) * 1e3) for s, n, a, b in self.cpu_spans
                                      if s >= skip_steps),
                     "gpu_ms": _means((n, b - a) for s, n, a, b in self.gpu_spans
                                      if s >= skip_steps)}
        steps = _step_bounds(self.gpu_spans, skip_steps)
        if len(steps) >= 2:
            busy = sum(b - a for a, b in steps)
            total = steps[-1][1] - steps[0][0]
            out["gpu_idle_fraction"] = max(0.0, 1.0 - busy / total) if total > 0 else 0.0
            # NOTE: when the CPU is the bottleneck the GPU also waits *inside* the prep span
            # (the marks are reached as fast as the CPU launches the prep work): counting
            # that span as idle gives an upper bound.
            prep = sum(b - a for s, n, a, b in self.gpu_spans if s >= skip_steps and n == "prep")
            out["gpu_idle_fraction_incl_prep"] = min(1.0, out["gpu_idle_fraction"]
                                                     + prep / total) if total > 0 else 0.0
            out["gpu_ms_per_step"] = total / len(steps)
            out["num_steps"] = len(steps)
        return out

    def plot(self, ax=None, first_step: int = 0, num_steps: int = 6, title: str | None = None):
        """Draw CPU and GPU lanes for ``num_steps`` steps from ``first_step``."""
        return plot_timeline(self.to_dict(), ax, first_step, num_steps, title)


def _means(pairs) -> dict:
    sums: dict[str, list[float]] = {}
    for name, v in pairs:
        sums.setdefault(name, []).append(v)
    return {k: sum(v) / len(v) for k, v in sums.items()}


def _step_bounds(gpu_spans, skip_steps: int) -> list[tuple[float, float]]:
    """(first start, last end) of each step's GPU spans, in step order."""
    bounds: dict[int, list[float]] = {}
    for s, _, a, b in gpu_spans:
        if s >= skip_steps:
            lo_hi = bounds.setdefault(s, [a, b])
            lo_hi[0], lo_hi[1] = min(lo_hi[0], a), max(lo_hi[1], b)
    return [tuple(bounds[s]) for s in sorted(bounds)]


def plot_timeline(data: dict, ax=None, first_step: int = 0, num_steps: int = 6,
                  title: str | None = None):
    """Plot ``Timeline.to_dict()`` output (also as read back from JSON).

    Args:
        data: ``{"cpu": [...], "gpu": [...]}`` spans in ms.
        ax: a matplotlib axis (default: a new figure).
        first_step, num_steps: the window of steps to show.

    Returns:
        The axis.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if ax is None:
        _, ax = plt.subplots(figsize=(12, 2.6))
    last = first_step + num_steps
    spans = [(1, d) for d in data["cpu"]] + [(0, d) for d in data["gpu"]]
    shown = [(lane, d) for lane, d in spans if first_step <= d["step"] < last]
    if not shown:
        return ax
    t0 = min(d["start_ms"] for _, d in shown)
    for lane, d in shown:
        color = PHASE_COLORS.get(d["name"], "black")
        ax.broken_barh([(d["start_ms"] - t0, d["end_ms"] - d["start_ms"])], (lane - 0.35, 0.7),
                       facecolors=color, edgecolors="white", linewidth=0.5)
    for d in data["gpu"]:  # step numbers above the GPU lane
        if first_step <= d["step"] < last and d["name"] == "forward":
            ax.text(d["start_ms"] - t0, 0.45, f"step {d['step']}", fontsize=7, va="bottom")
    ax.set_yticks([0, 1], ["GPU", "CPU"])
    ax.set_xlabel("time (ms)")
    ax.set_ylim(-0.6, 1.6)
    ax.legend(handles=[Patch(color=c, label=n) for n, c in PHASE_COLORS.items()],
              loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=len(PHASE_COLORS),
              fontsize=8, frameon=False)
    if title:
        ax.set_title(title)
    return ax
