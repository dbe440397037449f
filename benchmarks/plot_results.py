"""Plot benchmark results JSON files written by ``python -m mrv2 bench ...`` (no GPU needed).

    python benchmarks/plot_results.py benchmarks/results/bench_throughput_standard_2026-11-29.json
    python benchmarks/plot_results.py results/*.json --out-dir /tmp/plots

Each JSON gives one PNG (beside it, or in ``--out-dir``) with every panel that applies:
throughput bars with the decode roofline, the roofline plot (batch sweep or ms/step),
the per-step split; for latency files TTFT and TPOT against batch size.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from mrv2.bench.plots import save_plots


def main(argv: list[str] | None = None) -> list[pathlib.Path]:
    """Write one PNG per results file; returns their paths."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+", help="results JSON files")
    ap.add_argument("--out-dir", default=None, help="where the PNGs go (default: beside each JSON)")
    args = ap.parse_args(argv)
    written = []
    for src in map(pathlib.Path, args.results):
        out = (pathlib.Path(args.out_dir) if args.out_dir else src.parent) / (src.stem + ".png")
        written.append(save_plots(src, out))
        print(f"wrote {written[-1]}")
    return written


if __name__ == "__main__":
    main()
