"""Benchmark the paged decode-attention kernel against the GPU's copy bandwidth.

A decode step reads every cached K/V byte of every running request once, so decode
attention is a memory-bound kernel: its figure of merit is the KV bytes read per second,
compared with what a plain device-to-device copy reaches on the same GPU. Writes JSON
(hardware, versions, every figure) for notebooks/01_qwen3_and_paged_kv.ipynb to plot.

    python scripts/bench_attention.py                 # GPU, Qwen3-0.6B shape
    python scripts/bench_attention.py --sweep         # also try other launch configs
    python scripts/bench_attention.py --smoke --out /tmp/a.json   # tiny, runs on the CPU
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import platform as py_platform
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# NOTE: mrv2 first: it switches Triton to its interpreter on a machine without CUDA.
from mrv2.platform import DEVICE, HAS_CUDA  # noqa: I001

import torch
import triton

from mrv2.bench.report import git_commit
from mrv2.forward_context import AttentionMetadata
from mrv2.kernels.attention import paged_attention, paged_attention_ref

GPU_CASES = [(256, 1024), (256, 2048), (128, 1024), (64, 1024), (32, 512), (8, 4096),
             (1, 1024), (1, 8192)]
SMOKE_CASES = [(2, 40), (1, 17)]
SWEEP = [{"block_n": bn, "num_warps": w, "num_stages": st}
         for bn in (16, 32, 64, 128) for w in (2, 4, 8) for st in (1, 2, 3, 4)]


def _time_us(fn, smoke: bool) -> float:
    """Median time of fn() in microseconds (CUDA: do_bench after warm-up)."""
    if HAS_CUDA:
        fn()
        torch.cuda.synchronize()
        return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3
    fn()  # the interpreter: one warm run, then one timed run
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e6


def copy_bandwidth_tbs(smoke: bool) -> float:
    """Device-to-device copy bandwidth (read + write bytes per second), in TB/s."""
    n = (1 << 20) if smoke else (1 << 30)  # bytes: 1 GiB on the GPU
    src = torch.empty(n, dtype=torch.uint8, device=DEVICE).fill_(1)
    dst = torch.empty_like(src)
    us = _time_us(lambda: dst.copy_(src), smoke)
    return 2 * n / (us * 1e-6) / 1e12


def decode_batch(num_reqs: int, ctx: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 block_size: int, dtype: torch.dtype, seed: int = 0, spread: float = 0.0):
    """Random decode batch: every request has ctx cached tokens (its new one included), or
    with ``spread`` in (0, 1) a context drawn uniformly from [(1 - spread) ctx, (1 + spread)
    ctx] (a mix, as a workload's batches are: the longest request's programs end last)."""
    if not 0.0 <= spread < 1.0:
        raise ValueError(f"spread must be in [0, 1), got {spread}")
    lens = torch.full((num_reqs,), ctx, dtype=torch.int32)
    if spread > 0:
        lo, hi = max(1, round(ctx * (1 - spread))), round(ctx * (1 + spread))
        lens = torch.randint(lo, hi + 1, (num_reqs,), dtype=torch.int32,
                             generator=torch.Generator().manual_seed(seed))
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    blocks_per_req = triton.cdiv(int(lens.max()), block_size)
    num_blocks = num_reqs * blocks_per_req
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=g,
                           device=DEVICE, dtype=dtype)
    # Pages handed out in a shuffled order, as a block pool would after some churn.
    perm = torch.randperm(num_blocks, generator=g, device=DEVICE)
    block_table = perm.view(num_reqs, blocks_per_req).to(torch.int32)
    q = torch.randn(num_reqs, num_heads, head_dim, generator=g, device=DEVICE, dtype=dtype)
    md = AttentionMetadata(
        query_start_loc=torch.arange(num_reqs + 1, dtype=torch.int32, device=DEVICE),
        seq_lens=lens.to(DEVICE),
        block_table=block_table,
        slot_mapping=torch.zeros(num_reqs, dtype=torch.int64, device=DEVICE),
        max_query_len=1, max_seq_len=int(lens.max()))
    return q, kv_cache, md


def bench_case(num_reqs: int, ctx: int, shape: tuple[int, int, int],
               args: argparse.Namespace, dtype: torch.dtype, smoke: bool) -> dict:
    """Time one decode batch; returns a row of the results table."""
    h, h_kv, d = shape
    q, kv_cache, md = decode_batch(num_reqs, ctx, h, h_kv, d, args.block_size, dtype)
    kv_bytes = num_reqs * ctx * h_kv * d * 2 * kv_cache.element_size()
    scale = d ** -0.5
    out = torch.empty_like(q)

    def run(**kw):
        return paged_attention(q, kv_cache, md, scale, out, **kw)

    def tbs(us: float) -> float:
        return kv_bytes / (us * 1e-6) / 1e12

    row = {"num_reqs": num_reqs, "ctx": ctx, "kv_bytes": kv_bytes}
    row["us"] = _time_us(run, smoke)
    row["tbs"] = tbs(row["us"])
    if HAS_CUDA:  # the split-free kernel too, to show what flash-decoding adds
        row["us_no_split"] = _time_us(lambda: run(num_splits=1), smoke)
        row["tbs_no_split"] = tbs(row["us_no_split"])
    if not args.no_ref and num_reqs * ctx <= 256 * 1024:
        ref = paged_attention_ref(q, kv_cache, md, scale)
        row["max_abs_err_vs_ref"] = (run().float() - ref.float()).abs().max().item()
        row["us_ref"] = _time_us(lambda: paged_attention_ref(q, kv_cache, md, scale), smoke)
        row["tbs_ref"] = tbs(row["us_ref"])
    if args.sweep and HAS_CUDA:
        best = None
        for cfg in SWEEP:
            try:
                t = _time_us(lambda cfg=cfg: run(num_splits=1, config=cfg), smoke)
            except Exception as e:  # noqa: BLE001  (e.g. out of shared memory)
                print(f"  config {cfg} failed: {type(e).__name__}")
                continue
            if best is None or t < best[0]:
                best = (t, cfg)
        if best is not None:
            row["sweep_best_no_split"] = {"us": best[0], **best[1]}
    return row


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (CPU interpreter)")
    ap.add_argument("--sweep", action="store_true", help="also time other launch configs")
    ap.add_argument("--no-ref", action="store_true", help="skip the torch baseline")
    ap.add_argument("--num-heads", type=int, default=16)
    ap.add_argument("--num-kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/attention_decode.json"))
    args = ap.parse_args(argv)

    smoke = args.smoke or not HAS_CUDA
    dtype = torch.bfloat16 if HAS_CUDA else torch.float32
    h, h_kv, d = args.num_heads, args.num_kv_heads, args.head_dim
    if smoke:
        h, h_kv, d = 4, 2, 16
    copy_tbs = copy_bandwidth_tbs(smoke)
    cases = SMOKE_CASES if smoke else GPU_CASES
    rows = [bench_case(num_reqs, ctx, (h, h_kv, d), args, dtype, smoke)
            for num_reqs, ctx in cases]
    for row in rows:
        row["frac_of_copy"] = row["tbs"] / copy_tbs

    result = {
        "benchmark": "paged decode attention",
        "hardware": (torch.cuda.get_device_name() if HAS_CUDA
                     else py_platform.processor() or "cpu"),
        "torch": torch.__version__, "triton": triton.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": git_commit(),  # the book's figure labels (mrv2.bench.book_plots)
        "smoke": smoke, "dtype": str(dtype).removeprefix("torch."),
        "shape": {"num_heads": h, "num_kv_heads": h_kv, "head_dim": d,
                  "block_size": args.block_size},
        "copy_tbs": copy_tbs, "cases": rows}
    out_path = pathlib.Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=2) + "\n")

    print(f"{result['hardware']}  torch {torch.__version__}  triton {triton.__version__}  "
          f"copy {copy_tbs:.2f} TB/s (read+write)")
    print(f"{'reqs':>5} {'ctx':>6} {'us':>9} {'TB/s':>6} {'%copy':>6} {'us 1-split':>10} "
          f"{'us ref':>9}")
    for r in rows:
        print(f"{r['num_reqs']:>5} {r['ctx']:>6} {r['us']:>9.1f} {r['tbs']:>6.2f} "
              f"{100 * r['frac_of_copy']:>5.0f}% {r.get('us_no_split', float('nan')):>10.1f} "
              f"{r.get('us_ref', float('nan')):>9.1f}")
        if "sweep_best_no_split" in r:
            print(f"{'':>12} best no-split config: {r['sweep_best_no_split']}")
    print(f"wrote {out_path}")
    return result


if __name__ == "__main__":
    main()
