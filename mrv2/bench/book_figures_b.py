"""The book's GPU figures of chapters 08 and 10, re-plotted from ``benchmarks/results/``.

A chapter re-executed on a CPU shows the H200's real behaviour: these functions pick the
newest committed JSON of a kind *by what is inside it* (the kind of benchmark, its workload
and runners, the date it records; never its file name), so a new result shows up the next
time the chapter runs, and label every figure with the hardware, date and commit read from
that JSON. Pure matplotlib and json: no GPU, no model.

* ``newest_result(kind, ...)``: ``"decode_steps"`` (``bench decode --compare-eager``: ms per
  step, eager vs CUDA graphs), ``"decode_profile"`` (``bench decode``: kernels and ms per
  step from the profiler), ``"throughput"`` / ``"latency"`` (``bench throughput|latency``).
* ``provenance(res)``: ``"NVIDIA H200 · 2026-12-01 · commit 0125184"``.
* ``plot_decode_step_times_b``, ``plot_kernels_per_step``: chapter 08's figures.
"""

from __future__ import annotations

import json
import os
import pathlib

from mrv2.bench.book_plots import _axis
from mrv2.bench.report import REPO_ROOT

KINDS = ("decode_steps", "decode_profile", "throughput", "latency")
#: The GPU the book's figures come from (DESIGN.md's targets are the H200's). Results of other
#: GPUs stay in ``benchmarks/results/`` as evidence (e.g. the H100 jobs of sessions 19-23, when
#: no H200 was lent) but are not plotted as the book's figures.
BOOK_GPU = "NVIDIA H200"


def results_dir() -> pathlib.Path:
    """``$MRV2_RESULTS_DIR``, else the repository's ``benchmarks/results/``."""
    return pathlib.Path(os.environ.get("MRV2_RESULTS_DIR") or REPO_ROOT / "benchmarks" / "results")


def _meta(res: dict) -> dict:
    return res.get("meta") or res


def _hardware_name(res: dict, default: str) -> str:
    hw = _meta(res).get("hardware") or {}
    return hw.get("name", default) if isinstance(hw, dict) else str(hw)


def provenance(res: dict) -> str:
    """``hardware · date · commit`` of a results dict (the commit at its top level wins:
    some files carry a hand-corrected one beside ``meta``)."""
    meta = _meta(res)
    name = _hardware_name(res, "?")
    commit = str(res.get("git_commit") or meta.get("git_commit") or "?")[:7]
    return f"{name} · {str(meta.get('date', '?'))[:10]} · commit {commit}"


def kinds_of(res: dict) -> set[str]:
    """Which of ``KINDS`` a results dict holds (``bench decode --compare-eager`` writes the
    profile and the eager / graphs step times into one JSON: both kinds)."""
    kinds = set()
    if isinstance(res.get("profile"), dict) and "points" in res["profile"]:
        kinds.add("decode_profile")
    if isinstance(res.get("eager"), dict) and isinstance(res.get("graphs"), dict):
        kinds.add("decode_steps")
    kind = res.get("benchmark") or (res.get("config") or {}).get("kind")
    if kind in ("throughput", "latency"):
        kinds.add(kind)
    return kinds


def _on_gpu(res: dict) -> bool:
    meta = _meta(res)
    hw = meta.get("hardware") or {}
    tiny = (res.get("config") or {}).get("tiny")
    return not tiny and (not isinstance(hw, dict) or hw.get("device", "cuda") == "cuda")


def _on_book_gpu(res: dict) -> bool:
    return _hardware_name(res, "").startswith(BOOK_GPU)


def matches(res: dict, kind: str, workload: str | None = None,
            runners: tuple[str, ...] = (), speculative: bool = False,
            gpu_only: bool = True) -> bool:
    """Whether ``res`` is a GPU result of ``kind`` with this workload and runners.

    Args:
        res: a results dict.
        kind: one of ``KINDS``.
        workload: the config's workload (throughput / latency), or None: any.
        runners: runners that must be present without an error.
        speculative: True: only runs with speculative decoding; False: only runs without.
            Only the plain CUDA-graph mode counts for throughput / latency (no
            ``--cudagraph-mode`` override).
        gpu_only: skip CPU (``--tiny``) runs and runs on another GPU than ``BOOK_GPU``.

    A result marked ``"experiment": true`` (a variant run kept as the evidence for a
    decision, e.g. a path measured and left off) never matches: the book plots the
    project's default path.
    """
    if res.get("experiment") or kind not in kinds_of(res) or (
            gpu_only and not (_on_gpu(res) and _on_book_gpu(res))):
        return False
    if kind in ("decode_steps", "decode_profile"):
        return True
    cfg = res.get("config") or {}
    wl = cfg.get("workload")
    wl = wl.get("name") if isinstance(wl, dict) else wl
    ok = {n for n, r in res.get("runners", {}).items() if "error" not in r}
    return ((workload is None or wl == workload) and set(runners) <= ok
            and bool(cfg.get("speculative")) == speculative
            and cfg.get("cudagraph_mode") in (None, "FULL"))


def newest_result(kind: str, workload: str | None = None, runners: tuple[str, ...] = (),
                  speculative: bool = False, folder=None,
                  gpu_only: bool = True) -> tuple[pathlib.Path | None, dict | None]:
    """The newest matching results JSON, by the date recorded inside it.

    Args:
        kind, workload, runners, speculative, gpu_only: see :func:`matches`.
        folder: where to look (default :func:`results_dir`).

    Returns:
        ``(path, results dict)``, or ``(None, None)`` when nothing matches.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    best = (None, None, ("", ""))
    for path in sorted(pathlib.Path(folder or results_dir()).glob("*.json")):
        try:
            res = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if not isinstance(res, dict) or not matches(res, kind, workload, runners, speculative,
                                                        gpu_only):
            continue
        key = (str(_meta(res).get("date", "")), path.name)
        if key > best[2]:
            best = (path, res, key)
    return best[0], best[1]


def plot_decode_step_times_b(res: dict, ax=None):
    """ms per decode step against batch size, eager vs CUDA graphs, labelled with its origin.

    Args:
        res: a ``decode_steps`` results dict (``newest_result("decode_steps")``).
        ax: a matplotlib axis (default: a new figure).

    Returns:
        The axis.
    """
    ax = _axis(ax, (6.5, 3.6))
    sizes = sorted(res["eager"], key=int)
    width = 0.4
    for i, (key, label, color) in enumerate((("eager", "eager", "tab:gray"),
                                             ("graphs", "CUDA graphs", "tab:green"))):
        vals = [res[key][b] for b in sizes]
        bars = ax.bar([j + (i - 0.5) * width for j in range(len(sizes))], vals, width,
                      label=label, color=color)
        ax.bar_label(bars, fmt="%.1f", fontsize=8)
    ax.set_xticks(range(len(sizes)), sizes)
    ax.set(xlabel="decode batch size (requests)", ylabel="ms per decode step")
    ax.set_title(f"{provenance(res)}: Qwen3-0.6B shape, {_meta(res).get('load_format', '?')} "
                 f"weights, context {res.get('context', '?')}", fontsize=9)
    ax.legend(fontsize=8)
    return ax


def kernel_counts(res: dict, batch: int = 1) -> dict:
    """Kernels per decode step of one batch size of a ``decode_profile`` result.

    Returns:
        ``{"batch", "context", "total" (kernels per step, the profiler's count), "per_layer"
        (launches per step that come in multiples of the layer count, divided by it),
        "kernels" ([(name, launches per step)], as recorded)}``.
    """
    prof = res["profile"]
    point = next((p for p in prof["points"] if p["batch"] == batch), None)
    if point is None:
        raise ValueError(f"no point of batch {batch} in this profile "
                         f"(batches {[p['batch'] for p in prof['points']]})")
    layers = prof["model_info"]["num_layers"]
    kernels = [(k["name"], k["launches_per_step"]) for k in point["kernels"]]
    per_layer = sum(int(n // layers) for _, n in kernels if n >= layers)
    return {"batch": batch, "context": point["context"], "total": point["kernels_per_step"],
            "per_layer": per_layer, "num_layers": layers, "kernels": kernels}


def _short(name: str) -> str:
    """A kernel's name without C++ templates and arguments (``at::native::...<...>(...)``)."""
    base = name.removeprefix("void ")
    depth, out = 0, []
    for ch in base:
        depth += ch == "<"
        if depth == 0 and ch == "(":
            break
        if depth == 0:
            out.append(ch)
        depth -= ch == ">"
    return "".join(out).replace("at::native::", "").strip()[:48]


def plot_kernels_per_step(res: dict, batch: int = 1, ax=None):
    """The profiler's kernels of one decode step on the GPU, launches per step by kernel.

    Args:
        res: a ``decode_profile`` results dict (``newest_result("decode_profile")``).
        batch: which batch size's point.
        ax: a matplotlib axis (default: a new figure).

    Returns:
        The axis.
    """
    counts = kernel_counts(res, batch)
    ax = _axis(ax, (8, 4))
    names = [_short(n) for n, _ in counts["kernels"]][::-1]
    vals = [n for _, n in counts["kernels"]][::-1]
    ax.barh(range(len(vals)), vals, color=["C1" if n.startswith("_") else "C0" for n in names])
    ax.set_yticks(range(len(vals)), names, fontsize=7)
    ax.set_xlabel("launches per decode step (orange: mrv2's Triton kernels)")
    ax.set_title(f"{provenance(res)}: {counts['total']:.0f} kernels per decode step at batch "
                 f"{batch} ({counts['per_layer']} per layer x {counts['num_layers']})", fontsize=9)
    return ax


def spec_tpot_ratios(res: dict) -> dict[str, dict[int, tuple[float, float | None]]]:
    """TPOT with speculation / without, per method and batch, of a spec latency result.

    Args:
        res: a ``bench latency --speculative ...`` results dict (runners ``v2`` and
            ``v2-<method>``; ``-sync`` variants left out).

    Returns:
        ``{method: {batch: (tpot ratio, mean accepted length or None)}}``.
    """
    runners = res.get("runners") or {}
    base = {row["batch_size"]: row["tpot_ms"] for row in runners.get("v2", {}).get("batches", [])}
    out: dict[str, dict[int, tuple[float, float | None]]] = {}
    for name, r in runners.items():
        if not name.startswith("v2-") or name.endswith("-sync"):
            continue
        for row in r.get("batches", []):
            b = row["batch_size"]
            if b in base and base[b] > 0:
                acc = (row.get("spec_decode") or {}).get("mean_accepted_length")
                out.setdefault(name[3:], {})[b] = (row["tpot_ms"] / base[b], acc)
    return out


def plot_spec_tpot(results: list[dict], ax=None):
    """Bars of TPOT with / without speculation, per method and batch, one group per result.

    Args:
        results: spec latency results dicts (e.g. the newest per K), each labelled with its
            K, hardware, date and commit.
        ax: a matplotlib axis (default: a new figure).

    Returns:
        The axis.
    """
    ax = _axis(ax, (7.5, 3.8))
    colors = {"ngram": "tab:blue", "draft_model": "tab:orange", "eagle": "tab:green"}
    short = {"ngram": "n-gram", "draft_model": "draft", "eagle": "EAGLE"}
    x, ticks, labels, top = 0.0, [], [], 1.0
    for res in results:
        k = (res.get("config") or {}).get("num_speculative_tokens", "?")
        for method, rows in spec_tpot_ratios(res).items():
            for b, (ratio, acc) in sorted(rows.items()):
                bar = ax.bar(x, ratio, 0.8, color=colors.get(method, "tab:gray"))
                ax.bar_label(bar, labels=[f"{ratio:.2f}" + (f"\nlen {acc:.1f}" if acc else "")],
                             fontsize=7)
                ticks.append(x)
                labels.append(f"{short.get(method, method)}\nK={k}\nb{b}")
                top = max(top, ratio)
                x += 1
        x += 0.6
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_ylim(0, top * 1.2)
    ax.set_xticks(ticks, labels, fontsize=7)
    ax.set_ylabel("TPOT with / without speculation")
    ax.set_title(" | ".join(sorted({provenance(r) for r in results})), fontsize=9)
    return ax
