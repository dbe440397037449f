"""Sweep the decode-attention launch (splits, key block, warps, stages) over batch x context.

For each grid point of ``mrv2.kernels.attention_table`` (batch 1..256, context 128..4096,
the Qwen3-0.6B attention shape: 16 heads, 8 KV heads, head dim 128, pages of 16, bf16),
times every candidate launch of ``paged_attention`` replayed in a CUDA graph, keeps the
fastest, and reports the KV bytes read per second as a fraction of the copy bandwidth.
Writes every figure to ``benchmarks/results/`` and, with ``--write-table``, the table
``attention.py`` reads (``mrv2/assets/attention_decode_table.json``): commit both.

    python scripts/sweep_decode_attention.py --write-table          # GPU, ~3-5 minutes
    python scripts/sweep_decode_attention.py --quick --write-table  # fewer candidates
    python scripts/sweep_decode_attention.py --smoke --out /tmp/s.json   # CPU, tiny
    python scripts/sweep_decode_attention.py --fold --batches 64,256 --contexts 128,1024

``--fold`` times the committed table's launch against launches that fold 2-8 KV heads of a
request into one program (``attention_table.fold_rows``); a table written from it keeps the
winner's ``kv_fold``.

NOTE: at the smallest points (batch 1-4, short contexts) the KV cache fits in L2 and the
graph replays hit it, so their fraction of copy bandwidth can pass 100%; the choice
(the fastest launch) is still the one to take.
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "scripts"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

# NOTE: mrv2 first: it switches Triton to its interpreter on a machine without CUDA.
from mrv2.platform import HAS_CUDA  # noqa: I001

import torch
import triton

from bench_attention import copy_bandwidth_tbs, decode_batch
from mrv2.kernels.attention import _num_sms, paged_attention
from mrv2.kernels.attention_table import (
    GRID_BATCH,
    GRID_CONTEXT,
    LAUNCH_KEYS,
    TABLE_PATH,
    choose_decode_config,
    heuristic_decode_config,
    load_table,
    validate_table,
)

SPLITS = (1, 2, 4, 8, 16, 32)
BLOCK_N = (32, 64, 128)
WARPS_STAGES = ((2, 3), (2, 4), (4, 2), (4, 3), (8, 2))
QUICK = {"splits": (1, 2, 4, 8, 16), "block_n": (64, 128), "warps_stages": ((2, 3), (4, 2))}
#: ``--wide``: 16-key tiles and one-warp programs too. NOTE: job 13A (session 13) found one
#: warp with 16 keys and 2 stages fastest at 128-256 requests and 96-192 keys (30.6 us vs
#: 37.0 at 256 x 96): a small program (fewer registers, 242 -> fewer at 2 warps x 64 keys)
#: fits more copies on an SM, which hides the latency of each one's page-table -> key chain.
WIDE = {"block_n": (16, 32, 64, 128), "warps_stages": ((1, 2), (1, 3), (2, 3), (2, 4), (4, 2))}


#: ``--fold``: KV heads a program, with small key tiles (a fold of 8 at 64 keys spills or
#: overflows shared memory, ``scripts/occupancy_sm90.py``: 180-186 registers at 16 keys x 8
#: warps, 1 program an SM; a fold of 2 at 16 keys x 8 warps 101, 2 an SM; 2048 -> 256-1024
#: programs at batch 256). Split counts as ``--wide``'s.
FOLD = {"kv_fold": (2, 4, 8), "block_n": (16, 32), "warps_stages": ((4, 2), (8, 2), (8, 3))}


def fold_candidates(batch: int, ctx: int, table_cfg: dict) -> list[dict]:
    """``--fold``'s launches at one point: the table's own first (the baseline), then folds."""
    return [dict(table_cfg)] + [
        {"num_splits": s, "block_n": n, "num_warps": w, "num_stages": st, "kv_fold": f}
        for f in FOLD["kv_fold"] for s in wide_splits(batch) for n in FOLD["block_n"]
        for w, st in FOLD["warps_stages"] if s <= triton.cdiv(ctx, n)]


def wide_splits(batch: int) -> tuple[int, ...]:
    """``--wide``'s split counts: many requests fill the GPU without splitting."""
    return (1, 2) if batch >= 64 else (1, 2, 4, 8) if batch >= 16 else SPLITS


def _time_us(fn) -> float:
    """Median microseconds of fn() replayed in a CUDA graph (CPU: one timed call)."""
    if not HAS_CUDA:
        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6
    fn()
    torch.cuda.synchronize()
    try:
        return triton.testing.do_bench_cudagraph(fn, rep=10, return_mode="median") * 1e3
    except Exception:  # noqa: BLE001  (an older Triton: plain launches)
        return triton.testing.do_bench(fn, warmup=5, rep=20, return_mode="median") * 1e3


def candidates(ctx: int, quick: bool, smoke: bool, wide_batch: int | None = None) -> list[dict]:
    """Launches worth timing at one context (every split gets at least one key tile);
    ``wide_batch``: ``--wide``'s set for that batch size."""
    if smoke:
        return [{"num_splits": s, "block_n": 64, "num_warps": 4, "num_stages": 2} for s in (1, 2)]
    sp, bn, ws = ((QUICK["splits"], QUICK["block_n"], QUICK["warps_stages"]) if quick
                  else (SPLITS, BLOCK_N, WARPS_STAGES))
    if wide_batch is not None:
        sp, bn, ws = wide_splits(wide_batch), WIDE["block_n"], WIDE["warps_stages"]
    return [{"num_splits": s, "block_n": n, "num_warps": w, "num_stages": st}
            for s in sp for n in bn for w, st in ws if s <= triton.cdiv(ctx, n)]


def sweep_point(b: int, ctx: int, shape: tuple[int, int, int], dtype, copy_tbs: float,
                quick: bool, smoke: bool, wide: bool = False, fold: bool = False,
                spread: float = 0.0) -> dict:
    """Time the candidates of one (batch, context); returns the best and the heuristic.
    ``spread``: contexts mixed around ``ctx`` (``bench_attention.decode_batch``)."""
    h, h_kv, d = shape
    q, kv_cache, md = decode_batch(b, ctx, h, h_kv, d, 16, dtype, seed=b + ctx, spread=spread)
    kv_bytes = int(md.seq_lens.sum()) * h_kv * d * 2 * kv_cache.element_size()
    out = torch.empty_like(q)
    scale = d ** -0.5
    heur = heuristic_decode_config(b, md.max_seq_len, h_kv, _num_sms() if HAS_CUDA else 132)
    expected = paged_attention(q, kv_cache, md, scale, config=heur).float()
    timings = []
    if fold:
        table = load_table()
        table_cfg = (choose_decode_config(b, md.max_seq_len, h_kv, table) if table is not None
                     else {k: heur[k] for k in LAUNCH_KEYS})
        cands = fold_candidates(b, ctx, table_cfg)
        if smoke:  # the CPU: two of them (head counts permitting)
            cands = [cands[0]] + [c for c in cands[1:] if h_kv % c["kv_fold"] == 0][:1]
    else:
        cands = candidates(ctx, quick, smoke, b if wide else None)
    for cfg in cands:
        try:
            us = _time_us(lambda cfg=cfg: paged_attention(q, kv_cache, md, scale, out,
                                                          config=cfg))
        except Exception as e:  # noqa: BLE001  (e.g. out of shared memory)
            print(f"  b={b} ctx={ctx} {cfg} failed: {type(e).__name__}")
            continue
        timings.append({**cfg, "us": us})
    best = min(timings, key=lambda t: t["us"])
    cfg = {k: best[k] for k in (*LAUNCH_KEYS, "kv_fold") if k in best}
    err = (paged_attention(q, kv_cache, md, scale, config=cfg).float() - expected).abs().max()
    heur_us = next((t["us"] for t in timings if all(t.get(k) == heur[k] for k in heur)
                    and t.get("kv_fold", 1) == 1), None)
    if heur_us is None:
        heur_us = _time_us(lambda: paged_attention(q, kv_cache, md, scale, out, config=heur))
    tbs = kv_bytes / (best["us"] * 1e-6) / 1e12
    return {"batch": b, "context": ctx, "spread": spread, **cfg, "us": best["us"],
            "kv_bytes": kv_bytes, "tbs": tbs, "frac_of_copy": tbs / copy_tbs, "heuristic": heur,
            "heuristic_us": heur_us, "max_abs_diff_vs_heuristic": float(err),
            "timings": timings}


def main(argv: list[str] | None = None) -> dict:
    """Run the sweep; returns the results it wrote."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (runs on the CPU)")
    ap.add_argument("--quick", action="store_true", help="fewer candidate launches")
    ap.add_argument("--wide", action="store_true",
                    help="16-key tiles and one-warp launches too (splits by batch size)")
    ap.add_argument("--fold", action="store_true",
                    help="the table's launch against folds of 2-8 KV heads a program")
    ap.add_argument("--spread", type=float, default=0.0,
                    help="contexts mixed uniformly in [(1-S) ctx, (1+S) ctx] (0: all ctx)")
    ap.add_argument("--batches", default=None, help="comma list (default: the table's grid)")
    ap.add_argument("--contexts", default=None, help="comma list (default: the table's grid)")
    ap.add_argument("--update-table", action="store_true",
                    help="with --write-table: keep the committed table's entries at the grid "
                         "points not swept (instead of the heuristic)")
    ap.add_argument("--max-seconds", type=float, default=420.0,
                    help="stop sweeping after this long (missing points: the heuristic)")
    ap.add_argument("--write-table", action="store_true",
                    help=f"also write the chooser's table ({TABLE_PATH.relative_to(ROOT)})")
    ap.add_argument("--table-out", default=str(TABLE_PATH))
    ap.add_argument("--out", default=None, help="all figures (default benchmarks/results/"
                    "attention_decode_sweep_<date>.json)")
    args = ap.parse_args(argv)
    if not HAS_CUDA and not args.smoke:
        ap.error("the sweep needs a CUDA GPU; use --smoke on the CPU")
    shape = (4, 2, 16) if args.smoke else (16, 8, 128)
    dtype = torch.bfloat16 if HAS_CUDA else torch.float32
    batches = [int(x) for x in args.batches.split(",")] if args.batches else GRID_BATCH
    contexts = [int(x) for x in args.contexts.split(",")] if args.contexts else GRID_CONTEXT
    grid = ([(1, 40), (2, 130)] if args.smoke
            else [(b, c) for b in batches for c in contexts])
    copy_tbs = copy_bandwidth_tbs(args.smoke)
    t0 = time.perf_counter()
    points = []
    for b, c in grid:
        if time.perf_counter() - t0 > args.max_seconds:
            print(f"time budget spent: b={b} ctx={c} and later keep the heuristic")
            break
        p = sweep_point(b, c, shape, dtype, copy_tbs, args.quick, args.smoke, args.wide,
                        args.fold, args.spread)
        points.append(p)
        print(f"b={b:>4} ctx={c:>5} best splits={p['num_splits']:>2} block_n={p['block_n']:>3} "
              f"warps={p['num_warps']} stages={p['num_stages']} fold={p.get('kv_fold', 1)} "
              f"{p['us']:8.1f} us "
              f"{100 * p['frac_of_copy']:5.0f}% of copy (heuristic {p['heuristic_us']:.1f} us)",
              flush=True)
    date = datetime.datetime.now(datetime.timezone.utc)
    hw = torch.cuda.get_device_name() if HAS_CUDA else "cpu"
    result = {"benchmark": "decode attention launch sweep", "hardware": hw,
              "torch": torch.__version__, "triton": triton.__version__,
              "date": date.isoformat(timespec="seconds"), "smoke": args.smoke,
              "fold": args.fold, "spread": args.spread,
              "shape": {"num_heads": shape[0], "num_kv_heads": shape[1], "head_dim": shape[2],
                        "block_size": 16}, "copy_tbs": copy_tbs, "points": points}
    out = pathlib.Path(args.out or ROOT / "benchmarks" / "results" /
                       f"attention_decode_sweep_{date:%Y-%m-%d}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    if args.write_table:
        num_sms = _num_sms() if HAS_CUDA else 132
        swept = {(p["batch"], p["context"]): p for p in points}
        old = {}
        if args.update_table and pathlib.Path(args.table_out).exists():
            old_table = validate_table(json.loads(pathlib.Path(args.table_out).read_text()))
            old = {(e["batch"], e["context"]): e for e in old_table["entries"]}
        entries = []
        for b in GRID_BATCH:
            for c in GRID_CONTEXT:
                p = swept.get((b, c))
                if p is None and (b, c) in old:
                    entries.append(old[(b, c)])
                    continue
                cfg = ({k: p[k] for k in (*LAUNCH_KEYS, "kv_fold") if k in p}
                       if p else heuristic_decode_config(b, c, shape[1], num_sms))
                if cfg.get("kv_fold") == 1:
                    del cfg["kv_fold"]
                entries.append({"batch": b, "context": c, **cfg,
                                **({"us": round(p["us"], 2),
                                    "frac_of_copy": round(p["frac_of_copy"], 3)} if p else {})})
        source = (f"scripts/sweep_decode_attention.py, {hw}, {date:%Y-%m-%d}, "
                  f"{len(points)} points swept" + (" --wide" if args.wide else "")
                  + (" --fold" if args.fold else "")
                  + (f" --spread {args.spread}" if args.spread else ""))
        if old:
            source += f"; the other points from the previous table ({old_table['source']})"
        table = validate_table({"source": source,
                                "num_sms": num_sms, "num_kv_heads": shape[1],
                                "entries": entries})
        pathlib.Path(args.table_out).write_text(json.dumps(table, indent=1) + "\n")
        print(f"wrote {args.table_out}")
    return result


if __name__ == "__main__":
    main()
