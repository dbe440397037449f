"""Run ``python -m mrv2 ...`` with module knobs set by hand: in-model experiments, one job.

Many launch choices are module constants (``skinny_fused._TUNED``,
``decode_attention.ONE_REQUEST_LAUNCH``, ``persistent_layer.BARRIER``, ...). An experiment
that tries another value in the model should not need an environment switch per knob, nor
an edit of the tree between two benches of one job. This sets them, then runs the CLI::

    python scripts/bench_with.py \\
        --set 'mrv2.kernels.decode_attention:ONE_REQUEST_LAUNCH={"num_splits": 8, "block_n": 32}' \\
        --decode-launch '{"lo": 3, "hi": 32, "num_splits": 2, "block_n": 64}' \\
        -- bench latency --runner v2 --batch-sizes 1,4,8,16,32 --out X.json

``--set MODULE:ATTR=JSON`` (repeatable) assigns the JSON value; ``--decode-launch JSON``
overrides the fused decode attention's launch (``decode_attention.pick_config``) for
``lo``-``hi`` requests: ``block_n``, ``num_splits`` (capped at the key tiles, as the table's
are), and optionally ``num_warps`` / ``num_stages``; ``--paged-launch JSON`` does the same for
``paged_attention``'s decode launches (``lo``-``hi`` requests; ``block_n``, ``num_splits``,
``num_warps``, ``num_stages``, ``kv_fold``: the batch-256 step's attention). Session 14's
jobs 14C and 14D ran through this (their JSON notes say which knobs).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys

import mrv2  # noqa: F401  (first: on a CPU it switches Triton to its interpreter)
from mrv2.kernels.attention_table import LAUNCH_KEYS


def parse_set(spec: str) -> tuple[str, str, object]:
    """``"pkg.mod:ATTR=JSON"`` -> ``(module, attr, value)``; ``ValueError`` naming the problem."""
    target, sep, raw = spec.partition("=")
    mod, colon, attr = target.partition(":")
    if not sep or not colon or not mod or not attr:
        raise ValueError(f"--set wants MODULE:ATTR=JSON, got {spec!r}")
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(f"--set {target}: the value is not JSON ({e})") from None
    return mod, attr, value


def apply_set(spec: str) -> None:
    """Assign one ``--set``; the attribute must exist (a typo would measure nothing)."""
    mod, attr, value = parse_set(spec)
    module = importlib.import_module(mod)
    if not hasattr(module, attr):
        raise ValueError(f"--set: {mod} has no attribute {attr!r}")
    setattr(module, attr, value)


def override_decode_launch(spec: dict) -> None:
    """Patch ``decode_attention.pick_config`` for ``spec["lo"]``-``spec["hi"]`` requests."""
    import triton

    from mrv2.kernels import attention, decode_attention
    missing = {"lo", "hi", "num_splits", "block_n"} - set(spec)
    if missing:
        raise ValueError(f"--decode-launch needs {sorted(missing)}")
    orig = decode_attention.pick_config

    def pick(num_reqs, num_kv_heads, group_pad, max_query_len, max_seq_len, block_d=128):
        cfg = orig(num_reqs, num_kv_heads, group_pad, max_query_len, max_seq_len, block_d)
        if spec["lo"] <= num_reqs <= spec["hi"]:
            tiles = triton.cdiv(max(max_seq_len, 1), spec["block_n"])
            attention.override_launch(cfg, {
                "block_n": spec["block_n"], "num_splits": min(spec["num_splits"], tiles),
                **{k: spec[k] for k in ("num_warps", "num_stages") if k in spec}})
        return cfg
    decode_attention.pick_config = pick


PAGED_KEYS = (*LAUNCH_KEYS, "kv_fold")


def override_paged_launch(spec: dict) -> None:
    """Patch ``attention._pick_config`` for decode launches (``max_query_len`` 1) of
    ``spec["lo"]``-``spec["hi"]`` requests: any of ``PAGED_KEYS`` (paged attention's large
    decode batches; the fused kernel's <= 32 go through ``--decode-launch``). A ``kv_fold``
    also sizes the program's query rows (``attention_table.fold_rows``)."""
    from mrv2.kernels import attention, attention_table
    if not {"lo", "hi"} <= set(spec) or not set(spec) & set(PAGED_KEYS) \
            or set(spec) - {"lo", "hi", *PAGED_KEYS}:
        raise ValueError(f"--paged-launch needs lo, hi and some of {list(PAGED_KEYS)}, "
                         f"got {sorted(spec)}")
    orig = attention._pick_config

    def pick(num_reqs, num_kv_heads, group_pad, max_query_len, max_seq_len, block_d=128):
        cfg = orig(num_reqs, num_kv_heads, group_pad, max_query_len, max_seq_len, block_d)
        if max_query_len == 1 and spec["lo"] <= num_reqs <= spec["hi"]:
            attention.override_launch(cfg, {k: spec[k] for k in PAGED_KEYS if k in spec})
            if "kv_fold" in spec:
                attention_table.fold_rows(cfg, max_query_len, group_pad, num_kv_heads)
        return cfg
    attention._pick_config = pick


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--" not in argv:
        print("error: put the mrv2 command after --", file=sys.stderr)
        return 2
    i = argv.index("--")
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--set", action="append", default=[], metavar="MODULE:ATTR=JSON")
    ap.add_argument("--decode-launch", type=json.loads, default=None, metavar="JSON")
    ap.add_argument("--paged-launch", type=json.loads, default=None, metavar="JSON")
    args = ap.parse_args(argv[:i])
    try:
        for spec in args.set:
            apply_set(spec)
        if args.decode_launch is not None:
            override_decode_launch(args.decode_launch)
        if args.paged_launch is not None:
            override_paged_launch(args.paged_launch)
    except (ValueError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"[bench_with] set {args.set}, decode launch {args.decode_launch}, paged launch "
          f"{args.paged_launch}", flush=True)
    from mrv2.cli import main as cli_main
    return cli_main(argv[i + 1:])


if __name__ == "__main__":
    raise SystemExit(main())
