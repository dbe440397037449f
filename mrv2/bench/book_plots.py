"""The book's GPU figures, re-plotted from the JSON committed under ``benchmarks/results/``.

A chapter run on a laptop shows what the kernels did on the GPU they were measured on:
``newest_result`` picks the newest committed result of one kind (by the date and commit
written in each file, not by its name), ``result_label`` reads the hardware, date and commit
from it, and the ``plot_*`` functions draw it (pure matplotlib: no GPU, no model). A new
result committed later shows up when the chapter is re-executed. Used by
notebooks/01_qwen3_and_paged_kv.ipynb and 05_gumbel_sampling.ipynb.
"""

from __future__ import annotations

import functools
import json
import pathlib
import subprocess
from collections.abc import Callable

#: The checkout this package lives in (``benchmarks/results`` is under it).
REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"


def _is_attention_decode(res: dict) -> bool:
    return res.get("benchmark") == "paged decode attention" and bool(res.get("cases"))


def _is_sampler(res: dict) -> bool:
    rows = res.get("results")
    return isinstance(rows, list) and bool(rows) and all(
        isinstance(r, dict) and "triton_us" in r and "torch_us" in r for r in rows)


def _is_skinny_gemm(res: dict) -> bool:
    return bool(res.get("chain")) and isinstance(res.get("alone"), list)


#: Result kinds: what a JSON must hold to be one (``scripts/bench_attention.py``,
#: ``scripts/bench_sampler.py``, ``scripts/bench_skinny_gemm.py``).
KINDS: dict[str, Callable[[dict], bool]] = {
    "attention_decode": _is_attention_decode,
    "sampler": _is_sampler,
    "skinny_gemm": _is_skinny_gemm,
}


def result_meta(res: dict) -> dict[str, str | None]:
    """Hardware, date and commit of a results dict, wherever its script put them.

    Args:
        res: a results dict (top-level ``hardware``/``date``/``git_commit``, or the same
            under ``meta`` as ``python -m mrv2 bench`` writes; ``hardware`` a name or a
            dict with ``name``).

    Returns:
        ``{"hardware", "date", "commit"}``; a value the file does not record is None.
    """
    meta = res.get("meta", {}) if isinstance(res.get("meta"), dict) else {}
    hw = res.get("hardware", meta.get("hardware"))
    if isinstance(hw, dict):
        hw = hw.get("name")
    commit = res.get("git_commit", meta.get("git_commit"))
    if commit in (None, "", "unknown"):
        commit = None
    return {"hardware": hw, "date": res.get("date", meta.get("date")), "commit": commit}


def result_label(res: dict) -> str:
    """``"NVIDIA H200, 2026-12-01, commit 0125184"``, from the file (never hard-coded)."""
    m = result_meta(res)
    commit = f"commit {m['commit'][:7]}" if m["commit"] else "commit not recorded"
    return f"{m['hardware'] or 'unknown hardware'}, {(m['date'] or 'undated')[:10]}, {commit}"


@functools.lru_cache(maxsize=64)
def _commit_rank(commit: str | None, root: str) -> int:
    """How many commits ``commit`` has behind it (a later commit has more); -1 if unknown."""
    if not commit:
        return -1
    try:
        out = subprocess.run(["git", "rev-list", "--count", commit], cwd=root,
                             capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return -1
    return int(out.stdout) if out.returncode == 0 and out.stdout.strip().isdigit() else -1


def newest_result(kind: str, results_dir: str | pathlib.Path | None = None
                  ) -> tuple[pathlib.Path, dict] | None:
    """The newest committed, non-smoke result of one kind.

    Newest means: the latest day in its ``date``; on one day, the run of the later commit
    (``git rev-list --count`` of its ``git_commit``: a job that measures the tree before
    and after a change runs the "before" last), then the later time.

    Args:
        kind: a key of :data:`KINDS` (``"attention_decode"``, ``"sampler"``).
        results_dir: where the JSON files are (default: ``benchmarks/results/`` of this
            checkout).

    Returns:
        ``(path, results dict)``, or None when no file of that kind is there.

    Raises:
        ValueError: ``kind`` is not a known kind.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {sorted(KINDS)}, got {kind!r}")
    folder = pathlib.Path(results_dir) if results_dir is not None else RESULTS_DIR
    found = []
    for path in sorted(folder.glob("*.json")):
        try:
            res = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(res, dict) or res.get("smoke") or not KINDS[kind](res):
            continue
        m = result_meta(res)
        date = str(m["date"] or "")
        found.append(((date[:10], _commit_rank(m["commit"], str(REPO_ROOT)), date[:19]),
                      path, res))
    if not found:
        return None
    _, path, res = max(found, key=lambda f: f[0])
    return path, res


def _axis(ax, figsize):
    if ax is None:
        import matplotlib.pyplot as plt

        _, ax = plt.subplots(figsize=figsize)
    return ax


def plot_attention_decode(res: dict, ax=None):
    """KV bytes read per second by decode attention per batch shape, against a plain copy.

    Args:
        res: a results dict of ``scripts/bench_attention.py`` (``cases``, ``copy_tbs``).
        ax: a matplotlib axis (default: a new figure).

    Returns:
        The axis.
    """
    ax = _axis(ax, (8, 3.5))
    cases = res["cases"]
    x = range(len(cases))
    ax.bar(x, [c["tbs"] for c in cases], label="paged_attention")
    if all("tbs_no_split" in c for c in cases):
        ax.plot(x, [c["tbs_no_split"] for c in cases], "k_", ms=18, mew=2,
                label="without split-KV")
    copy = res["copy_tbs"]
    ax.axhline(copy, color="red", ls="--", label=f"device copy {copy:.2f} TB/s")
    ax.set_xticks(list(x), [f"{c['num_reqs']} x {c['ctx']}" for c in cases], rotation=30)
    ax.set_ylim(0, 1.4 * max(copy, *(c["tbs"] for c in cases)))
    shape = res.get("shape", {})
    ax.set(xlabel="requests x context tokens", ylabel="KV read (TB/s)",
           title=f"decode attention, {res.get('dtype', '')} "
                 f"{shape.get('num_heads', '?')}/{shape.get('num_kv_heads', '?')} heads\n"
                 f"{result_label(res)}")
    ax.legend(fontsize=8, ncol=3, loc="upper left")
    return ax


def _sampler_case(r: dict) -> str:
    dtype = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(r["dtype"], r["dtype"])
    knobs = "no top-k/top-p" if r["top_k"] <= 0 and r["top_p"] >= 1.0 else (
        f"top-k {r['top_k']}, top-p {r['top_p']}")
    return f"{dtype}, T={r['temperature']}\n{knobs}"


def plot_sampler(res: dict, ax=None):
    """Microseconds per sampling step: mrv2's Triton path against softmax + multinomial.

    Args:
        res: a results dict of ``scripts/bench_sampler.py`` (``results`` rows with
            ``triton_us``, ``torch_us``, ``num_rows``, ``vocab``, ``dtype``, ...).
        ax: a matplotlib axis (default: a new figure).

    Returns:
        The axis (log-scaled time).
    """
    ax = _axis(ax, (9, 3.6))
    rows = res["results"]
    x = list(range(len(rows)))
    ax.bar([i - 0.2 for i in x], [r["triton_us"] for r in rows], width=0.4,
           label="mrv2: mask + Gumbel-max (Triton)")
    ax.bar([i + 0.2 for i in x], [r["torch_us"] for r in rows], width=0.4,
           label="torch: softmax + multinomial (+ sort for top-k/top-p)")
    for i, r in zip(x, rows):
        ax.text(i, max(r["triton_us"], r["torch_us"]) * 1.15, f"{r['torch_us'] / r['triton_us']:.2f}x",
                ha="center", fontsize=8)
    ax.set_yscale("log")
    ax.set_ylim(min(min(r["triton_us"], r["torch_us"]) for r in rows) / 3,
                max(max(r["triton_us"], r["torch_us"]) for r in rows) * 4)
    ax.set_xticks(x, [_sampler_case(r) for r in rows], fontsize=8)
    ax.set(ylabel="us per step (log)",
           title=f"sampling {rows[0]['num_rows']} rows x {rows[0]['vocab']:,} tokens "
                 f"(above the bars: torch time / Triton time)\n{result_label(res)}")
    ax.legend(fontsize=8, loc="upper left")
    return ax


def plot_skinny_chain(res: dict, ax=None):
    """A decode step's 28 x 4 matrix products in one CUDA graph: cuBLAS vs the weight stream.

    Args:
        res: a results dict of ``scripts/bench_skinny_gemm.py`` (``chain`` rows with ``M``,
            ``runner`` (``cublas`` / ``skinny``), ``us_per_step``, ``weight_mb``).
        ax: a matplotlib axis (default: a new figure).

    Returns:
        The axis; the bytes-alone time at the copy bandwidth of 4.2 TB/s is a dashed line.
    """
    ax = _axis(ax, (7, 3.4))
    rows = res["chain"]
    ms = sorted({r["M"] for r in rows})
    us = {(r["runner"], r["M"]): r["us_per_step"] for r in rows}
    for off, (runner, label) in zip((-0.2, 0.2), (("cublas", "cuBLAS (F.linear)"),
                                                  ("skinny", "mrv2 skinny_gemm (Triton)"))):
        ax.bar([i + off for i in range(len(ms))], [us[(runner, m)] for m in ms], 0.4, label=label)
    for i, m in enumerate(ms):
        ax.text(i, max(us[("cublas", m)], us[("skinny", m)]) * 1.03,
                f"{us[('skinny', m)] / us[('cublas', m)]:.2f}x", ha="center", fontsize=8)
    ax.axhline(rows[0]["weight_mb"] / 4.2e6 * 1e6, color="black", ls="--", lw=1,
               label="the weights' bytes at 4.2 TB/s")
    ax.set_ylim(0, max(us.values()) * 1.15)                    # room for the ratios
    ax.set_xticks(range(len(ms)), [f"M = {m}" for m in ms])
    ax.set(ylabel="us per chain", title=f"28 layers x (qkv, o, gate_up, down), "
           f"{rows[0]['weight_mb']:.0f} MB of bf16 weights, one CUDA graph\n{result_label(res)}")
    ax.legend(fontsize=8, loc="upper left")
    return ax
