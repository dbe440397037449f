"""Command line: ``python -m mrv2 generate ...`` and ``python -m mrv2 bench ...``.

``generate`` runs prompts through ``LLM.generate`` (the V2 runner) and prints the
completions; with no ``--model`` it uses the embedded tiny Qwen3. ``bench``
runs the throughput / latency benchmarks of ``mrv2.bench`` and writes JSON.
Arguments live in ``mrv2/cli.py``.
"""

from __future__ import annotations

from mrv2.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
