"""Per-request timestamps of the online path, for finding where a first token waits.

Set ``MRV2_SERVE_TRACE=/path/trace.jsonl`` in the server's environment (``bench serve
--launch`` passes its own environment on): every finished request appends one JSON line
of ``time.perf_counter()`` stamps (CLOCK_MONOTONIC on Linux: one clock for the API and the
engine process):

=================  ==============================================================
``submit``         the API process's ``add_request`` began (the HTTP body parsed)
``sent``           the add command went down the pipe (thread mode: was queued)
``engine_add``     the engine took the add (between two steps)
``engine_first``   the engine's step that gave the first token returned
``first_item``     that step's message reached the API process (reader thread)
``reply``          the add's reply resumed ``add_request`` (the stream can start)
``first_out``      the first output was made, to go out to the HTTP layer at once
``end``            the last output left
=================  ==============================================================

``python -m mrv2.serve.trace FILE [--last N]`` prints, for the last ``N`` requests, each
stamp's percentiles after the first request's ``submit`` and the gaps between stamps.
Tracing off (the default) costs one ``is None`` test per request and per step item.
"""

from __future__ import annotations

import itertools
import json
import os
import threading
import time

ENV = "MRV2_SERVE_TRACE"
KEYS = ("submit", "sent", "engine_add", "engine_first", "first_item", "reply", "first_out",
        "end")


class RequestTrace:
    """Collects stamps per request id and appends a finished request's line to ``path``.

    Args:
        path: the JSON-lines file (appended to).
    """

    def __init__(self, path: str):
        self.path = path
        self.times: dict[str, dict] = {}
        self._lock = threading.Lock()

    @classmethod
    def from_env(cls) -> RequestTrace | None:
        path = os.environ.get(ENV)
        return cls(path) if path else None

    def mark(self, request_id: str, key: str, t: float | None = None) -> None:
        """Stamp ``key`` of ``request_id`` once (the first stamp of a key stays)."""
        self.times.setdefault(request_id, {}).setdefault(key, time.perf_counter()
                                                         if t is None else t)

    def finish(self, request_id: str) -> None:
        """Stamp ``end`` and write the request's line."""
        times = self.times.pop(request_id, None)
        if times is None:
            return
        times.setdefault("end", time.perf_counter())
        line = json.dumps({"request_id": request_id, **times}) + "\n"
        with self._lock, open(self.path, "a") as f:
            f.write(line)


def summarize(path: str, last: int | None = None) -> str:
    """A text table of a trace file's stamps (see the module docstring).

    Args:
        path: the JSON-lines file.
        last: only the last ``last`` requests (e.g. one rate of a ``bench serve`` sweep).

    Returns:
        The table.
    """
    import numpy as np

    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if last:
        rows = rows[-last:]
    if not rows:
        return "no requests"
    rows.sort(key=lambda r: r["submit"])
    t0 = rows[0]["submit"]
    keys = [k for k in KEYS if any(k in r for r in rows)]
    out = [f"{len(rows)} requests; ms after the first submit (p0/p10/p50/p90/p100)"]
    for k in keys:
        v = np.array([r[k] - t0 for r in rows if k in r]) * 1e3
        out.append(f"  {k:13s}" + " ".join(f"{x:9.1f}" for x in np.percentile(
            v, [0, 10, 50, 90, 100])))
    out.append("gaps, ms (p10/p50/p90)")
    for a, b in itertools.pairwise(keys):
        v = np.array([r[b] - r[a] for r in rows if a in r and b in r]) * 1e3
        if len(v):
            out.append(f"  {a:>12s} -> {b:13s}" + " ".join(
                f"{x:9.1f}" for x in np.percentile(v, [10, 50, 90])))
    steps = path + ".steps.jsonl"   # the engine's steps that compiled (engine_core._serve)
    if os.path.exists(steps):
        with open(steps) as f:
            slow = [json.loads(line) for line in f if line.strip()]
        slow = [s for s in slow if s["end"] >= t0 - 1.0]
        out.append(f"engine steps that compiled Triton kernels in this window: {len(slow)}")
        out += [f"  step {s['step']} ended {(s['end'] - t0) * 1e3:.0f} ms, took {s['ms']:.0f}"
                f" ms: {', '.join(s['compiled'])}" for s in slow]
    out.append("by submit order (every 16th): first_out - submit, ms")
    out.append("  " + " ".join(f"{(r.get('first_out', np.nan) - r['submit']) * 1e3:.0f}"
                               for r in rows[::16]))
    return "\n".join(out)


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m mrv2.serve.trace")
    p.add_argument("path")
    p.add_argument("--last", type=int, default=None, help="only the last N requests")
    a = p.parse_args(argv)
    print(summarize(a.path, a.last))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
