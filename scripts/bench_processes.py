"""A/B a bench figure over fresh processes, taking turns: medians, ranges and ratios in one JSON.

Job 15's batch-1 TPOT was steady inside a process (three runs within 0.3%) but moved up to
15% from one process to the next (0.718-0.844 ms over 11 processes of the same code), more
than most changes it was meant to judge. So a claim about a few percent needs several
processes per variant, interleaved (a drift of the machine falls on every variant alike).
This runs ``rounds`` rounds; in each, every variant once, as ``scripts/bench_with.py
<variant args> -- <mrv2 command> --out <tmp>``; then it reads the figures back and writes::

    {"variants": {name: {"args": [...], "figures": {key: [one value a process]},
                         "median": {key: m}}},
     "ratios": {name: {key: median / median of the first variant}}, ...}

Figures: ``bench latency`` gives ``<runner>/b<batch>/tpot_ms`` and ``.../ttft_ms``; ``bench
throughput`` gives ``<runner>/output_tok_s``; ``bench decode`` gives
``decode/b<batch>/c<context>/gpu_ms`` and ``.../kernels``. Usage (GPU)::

    python scripts/bench_processes.py --rounds 4 --out benchmarks/results/X.json \\
        --variant default= \\
        --variant prefetch="--set mrv2.kernels.decode_attention:PREFETCH=true" \\
        -- bench latency --runner v2 --batch-sizes 1,2,8
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shlex
import statistics
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]


def parse_variant(spec: str) -> tuple[str, list[str]]:
    """``"name=ARGS"`` -> ``(name, shlex-split ARGS)`` (ARGS: bench_with's options, may be
    empty). ``ValueError`` naming the problem."""
    name, sep, args = spec.partition("=")
    if not sep or not name.strip():
        raise ValueError(f"--variant wants NAME=ARGS (ARGS may be empty), got {spec!r}")
    return name.strip(), shlex.split(args)


def figures(result: dict) -> dict[str, float]:
    """The comparable figures of one bench JSON (latency, throughput or ``bench decode``'s
    profile: GPU ms and kernels a step per batch and context)."""
    out = {}
    for pt in (result.get("profile") or {}).get("points", []):
        key = f"decode/b{pt['batch']}/c{pt['context']}"
        out[f"{key}/gpu_ms"] = pt["gpu_ms_per_step"]
        out[f"{key}/kernels"] = pt["kernels_per_step"]
    for runner, r in result.get("runners", {}).items():
        if "error" in r:
            continue
        for b in r.get("batches", []):
            out[f"{runner}/b{b['batch_size']}/tpot_ms"] = b["tpot_ms"]
            out[f"{runner}/b{b['batch_size']}/ttft_ms"] = b["ttft_ms"]
        if "output_tok_s" in r:
            out[f"{runner}/output_tok_s"] = r["output_tok_s"]
    return out


def summarize(variants: dict[str, dict]) -> dict:
    """Medians per variant and their ratios to the first variant's (in place, returned)."""
    for v in variants.values():
        v["median"] = {k: statistics.median(xs) for k, xs in v["figures"].items()}
    first = next(iter(variants.values()))["median"]
    ratios = {name: {k: m / first[k] for k, m in v["median"].items() if first.get(k)}
              for name, v in variants.items()}
    return {"variants": variants, "ratios": ratios}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--" not in argv:
        print("error: put the mrv2 command after --", file=sys.stderr)
        return 2
    i = argv.index("--")
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=ARGS",
                    help="bench_with options of one variant (repeatable; first = baseline)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv[:i])
    command = argv[i + 1:]
    if "--out" in command:
        print("error: the command's --out is set per process; give --out before --",
              file=sys.stderr)
        return 2
    try:
        parsed = [parse_variant(v) for v in (args.variant or ["default="])]
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if len({n for n, _ in parsed}) != len(parsed) or args.rounds < 1:
        print("error: variant names must differ and --rounds be >= 1", file=sys.stderr)
        return 2
    variants = {name: {"args": vargs, "figures": {}} for name, vargs in parsed}
    meta: dict = {}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name, vargs in parsed:
                out = pathlib.Path(tmp) / f"{name}_{r}.json"
                cmd = [sys.executable, str(ROOT / "scripts" / "bench_with.py"), *vargs, "--",
                       *command, "--out", str(out)]
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
                if proc.returncode != 0 or not out.exists():
                    print(proc.stdout[-2000:], proc.stderr[-2000:], sep="\n", file=sys.stderr)
                    print(f"error: variant {name!r} round {r} failed (exit {proc.returncode})",
                          file=sys.stderr)
                    return 1
                result = json.loads(out.read_text())
                if not meta:  # where it ran, from the first process's JSON (bench decode
                    src = {**result.get("meta", {}), **result}   # keeps it under "meta")
                    meta = {k: src.get(k) for k in ("date", "hardware", "versions",
                                                    "git_commit", "source_digest", "config")}
                got = figures(result)
                for k, x in got.items():
                    variants[name]["figures"].setdefault(k, []).append(x)
                shown = ", ".join(f"{k} {x:.4g}" for k, x in got.items() if "ttft" not in k)
                print(f"[round {r + 1}/{args.rounds}] {name}: {shown}", flush=True)
    report = {"benchmark": "bench over processes", "command": command,
              "rounds": args.rounds, **meta, **summarize(variants)}
    pathlib.Path(args.out).write_text(json.dumps(report, indent=1))
    for name, ratios in report["ratios"].items():
        med = report["variants"][name]["median"]
        print(f"{name:>12}: " + ", ".join(f"{k} {med[k]:.4g} ({x:.3f}x)"
                                          for k, x in ratios.items() if "ttft" not in k))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
