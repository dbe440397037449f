"""Time the decode layer's GEMMs with norms, adds and SiLU * up fused in (GPU).

A decode step's chain without attention: ``layers`` x (input norm, qkv, o_proj, add + norm,
gate_up, SiLU * up, down) on distinct Qwen3-0.6B-shaped bf16 weights (hidden 1024, qkv
4096, inter 3072), captured in one CUDA graph and replayed, at M = 1 and 2 rows. Three runners:

* ``cublas``: the norm kernels + ``F.linear`` + ``silu_and_mul`` (7 kernels a layer, plus
  cuBLAS's split-K reductions and memsets);
* ``unfused``: the same with ``skinny_linear`` (7 kernels a layer: the model today);
* ``fused``: ``mrv2.kernels.skinny_fused`` (4 kernels a layer);
* ``fused_pdl`` (``--pdl``): the same launched with programmatic dependent launch
  (``mrv2.kernels.pdl``, forced on whatever ``MRV2_PDL`` says, while ``fused`` and the
  others are forced off; Hopper only, so on the CPU smoke run it is the ``fused`` path
  again), with ``equal_to_fused`` (bitwise);
* ``stream`` / ``stream_pdl`` (``--stream``, 1-2 rows): the fused chain through
  ``mrv2.kernels.skinny_stream`` (each program's whole weight slice loaded before the PDL
  wait), without and with PDL, with ``max_abs_diff_vs_fused`` (``fused`` and ``fused_pdl``
  force it off: they are skinny_fused's own kernel); ``--stream-sweep`` walks
  each kernel kind's (BLOCK_N, num_warps) on that chain, the others at their default;
* ``persistent`` (``--persistent``, 1-2 rows): the first qkv, then one
  ``mrv2.kernels.persistent_layer.layer_tail`` launch a layer (o_proj, gate_up, down and the
  next qkv as stages of one grid, PDL on), also with ``equal_to_fused``.

``--rows 4,8,32,256`` (3-256 rows) compares the model's cuBLAS layers (``unfused``: norm kernels,
``F.linear``, ``silu_and_mul``) with ``mrv2.kernels.small_m_fused``'s tensor-core ones
(``fused``, ``fused_pdl``); ``--split-k`` adds them with each tile's K split over several
programs (``split``, ``split_pdl``: ``small_m_fused.SPLIT_K``'s rule), with
``max_abs_diff_vs_fused``.

Attention is left out (one fixed ``[M, 2048]`` input to o_proj), so the figures are the
GEMM part of the step. ``--sweep`` also times each fused kernel alone (L2 flushed) over
(block_n, block_k, num_warps). ``--launch-sweep`` walks small_m_fused's launch per op
(block_m, block_n, num_warps, block_k) on the ``fused_pdl`` chain at the rows given, the other
ops at their default: from 24 rows that chain loses to cuBLAS (995 against 871 us, job 18A),
and the default launch there (``small_m_gemm._launch``) was never swept in the chain.

    python scripts/bench_skinny_fused.py --sweep --out benchmarks/results/skinny_fused.json
    python scripts/bench_skinny_fused.py --pdl --out benchmarks/results/skinny_fused_pdl.json
    python scripts/bench_skinny_fused.py --smoke --out /tmp/f.json      # CPU, tiny, no timing
"""

from __future__ import annotations

import argparse
import datetime
import functools
import itertools
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# NOTE: mrv2 first: it switches Triton to its interpreter on a machine without CUDA.
from mrv2.platform import HAS_CUDA  # noqa: I001

import torch
import torch.nn.functional as F
import triton

from mrv2.kernels import (
    pdl,
    persistent_layer,
    skinny_fused,
    skinny_stream,
    small_m_fused,
    small_m_resident,
)
from mrv2.kernels.activation import silu_and_mul
from mrv2.kernels.layernorm import fused_add_rms_norm, rms_norm
from mrv2.kernels.skinny_fused import (
    skinny_linear_add,
    skinny_norm_gate_up_silu,
    skinny_norm_linear,
)
from mrv2.kernels.skinny_gemm import skinny_linear

HIDDEN, QKV, ATTN, INTER, EPS = 1024, 4096, 2048, 3072, 1e-6


def _time_us(fn, smoke: bool) -> float:
    fn()
    if smoke:
        return 0.0
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median") * 1e3


def _weights(layers: int, div: int, dev, dt) -> list[dict]:
    h, q, a, i = HIDDEN // div, QKV // div, ATTN // div, INTER // div
    return [{"ln1": 1 + 0.1 * torch.randn(h, device=dev, dtype=dt),
             "qkv": torch.randn(q, h, device=dev, dtype=dt) * 0.05,
             "o": torch.randn(h, a, device=dev, dtype=dt) * 0.05,
             "ln2": 1 + 0.1 * torch.randn(h, device=dev, dtype=dt),
             "gate_up": torch.randn(2 * i, h, device=dev, dtype=dt) * 0.05,
             "down": torch.randn(h, i, device=dev, dtype=dt) * 0.05} for _ in range(layers)]


def _unfused(gemm):
    """The model's unfused decode layers (qwen3.py's forward) with ``gemm`` as the linear."""
    def run(h, attn, ws):
        residual, x = h, None
        for w in ws:
            if x is None:
                residual, x = h, rms_norm(h, w["ln1"], EPS)
            else:
                x, residual = fused_add_rms_norm(x, residual, w["ln1"], EPS)
            gemm(x, w["qkv"])                              # its output feeds attention (left out)
            x, residual = fused_add_rms_norm(gemm(attn, w["o"]), residual, w["ln2"], EPS)
            gate, up = gemm(x, w["gate_up"]).chunk(2, -1)
            x = gemm(silu_and_mul(gate, up), w["down"])
        return x + residual                                # the residual stream after the chain
    return run


def _fused_with(ops):
    """The fused decode layers with ``ops = (norm_linear, linear_add, norm_gate_up_silu)``."""
    norm_linear, linear_add, norm_gate_up_silu = ops

    def run(h, attn, ws):
        h = h.clone()                                      # the chain adds into h in place
        for w in ws:
            norm_linear(h, w["ln1"], EPS, w["qkv"])
            linear_add(attn, w["o"], h)
            linear_add(norm_gate_up_silu(h, w["ln2"], EPS, w["gate_up"]), w["down"], h)
        return h
    return run


_fused = _fused_with(small_m_fused.SKINNY_OPS)


def _persistent(h, attn, ws):
    """The same chain as the model's persistent decode path runs it: the first qkv, then
    one ``layer_tail`` launch a layer (o_proj, gate_up, down, the next layer's qkv)."""
    h = h.clone()
    skinny_fused.skinny_norm_linear(h, ws[0]["ln1"], EPS, ws[0]["qkv"])
    for i, w in enumerate(ws):
        nxt = ws[i + 1] if i + 1 < len(ws) else None
        persistent_layer.layer_tail(attn, h, w["o"], w["ln2"], EPS, w["gate_up"], w["down"],
                                    nxt and nxt["ln1"], EPS, nxt and nxt["qkv"])
    return h


def _forcing(module, name: str, value, run):
    """``run`` with ``module.name`` set to ``value`` for the call (the kernels read their
    switches at each launch, so capture and eager runs see it)."""
    def wrapped(*args):
        before = getattr(module, name)
        setattr(module, name, value)
        try:
            return run(*args)
        finally:
            setattr(module, name, before)
    return wrapped


def _with_pdl(run, on: bool):
    """``run`` with PDL forced on or off (``pdl.PDL_ENABLED``)."""
    return _forcing(pdl, "PDL_ENABLED", on, run)


def _with_split(run, on: bool):
    """``run`` with small_m_fused's split-K (``SPLIT_K``, its rule) forced on or off."""
    return _forcing(small_m_fused, "SPLIT_K", on, run)


def _with_stream(run, on: bool):
    """``run`` with ``skinny_stream.ENABLED`` forced on or off: the ``fused`` runners
    measure skinny_fused's own kernel whatever the default."""
    return _forcing(skinny_stream, "ENABLED", on, run)


def _graph_us(run, args, smoke: bool) -> float:
    """Median us of ``run(*args)`` captured in one CUDA graph (0 in smoke)."""
    if smoke:
        return 0.0
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run(*args)
    return _time_us(graph.replay, smoke)


def stream_sweep(ms: list[int], smoke: bool, layers: int) -> list[dict]:
    """The stream chain (PDL on) per kernel kind over (BLOCK_N, num_warps), the other kinds
    at their default: ``{"M", "kind", "block_n", "num_warps", "us_per_step"}`` rows."""
    dev, dt, div = ("cpu", torch.float32, 32) if smoke else ("cuda", torch.bfloat16, 1)
    ws = _weights(layers, div, dev, dt)
    run = _with_pdl(_with_stream(_fused, True), True)
    rows = []
    for m in ms:
        h = torch.randn(m, HIDDEN // div, device=dev, dtype=dt)
        attn = torch.randn(m, ATTN // div, device=dev, dtype=dt)
        base = _graph_us(run, (h, attn, ws), smoke)
        rows.append({"M": m, "kind": "default", "block_n": 0, "num_warps": 0,
                     "us_per_step": base})
        for kind in ("norm", "add", "gate_up"):
            for bn, nw in itertools.product((2, 4, 8, 16, 32), (4, 8)):
                if bn > min(skinny_stream.max_block_n(k, kind == "gate_up", nw)
                            for k in ((HIDDEN,) if kind != "add" else (ATTN, INTER))):
                    continue  # the launch would cap it (registers spill beyond)
                skinny_stream.TUNED[f"{kind}/{m}"] = [bn, nw]
                try:
                    us = _graph_us(run, (h, attn, ws), smoke)
                finally:
                    del skinny_stream.TUNED[f"{kind}/{m}"]
                rows.append({"M": m, "kind": kind, "block_n": bn, "num_warps": nw,
                             "us_per_step": us})
                print(f"stream sweep M={m} {kind:>7} block_n={bn:2d} warps={nw}: "
                      f"{us:7.1f} us (default {base:7.1f})")
                if smoke:
                    break
    return rows


def chain(ms: list[int], smoke: bool, layers: int, with_pdl: bool = False,
          with_persistent: bool = False, with_stream: bool = False,
          with_split: bool = False) -> list[dict]:
    """``layers`` decode layers' GEMM part per runner, one CUDA graph each (eager in smoke)."""
    dev, dt, div = ("cpu", torch.float32, 32) if smoke else ("cuda", torch.bfloat16, 1)
    ws = _weights(layers, div, dev, dt)
    mb = sum(w.numel() * w.element_size() for lw in ws for w in lw.values()) / 1e6
    rows = []
    for m in ms:
        if m <= skinny_fused.MODEL_MAX_M:
            runners = {"cublas": _unfused(F.linear), "unfused": _unfused(skinny_linear),
                       "fused": _fused}
        else:  # 3-256 rows: the model's cuBLAS layers vs the tensor-core fused ones
            runners = {"unfused": _unfused(F.linear),
                       "fused": _fused_with(small_m_fused.SMALL_M_OPS)}
        fused = runners["fused"]
        runners = {label: _with_split(_with_stream(_with_pdl(run, False), False), False)
                   for label, run in runners.items()}
        if with_pdl:
            runners["fused_pdl"] = _with_split(_with_stream(_with_pdl(fused, True), False),
                                               False)
        if with_split and m > skinny_fused.MODEL_MAX_M:  # small_m_fused's K split in
            runners["split"] = _with_split(_with_pdl(fused, False), True)
            runners["split_pdl"] = _with_split(_with_pdl(fused, True), True)
        if with_stream and m <= skinny_stream.MAX_M:  # skinny_fused's ops, routed there
            runners["stream"] = _with_pdl(_with_stream(_fused, True), False)
            runners["stream_pdl"] = _with_pdl(_with_stream(_fused, True), True)
        if with_persistent and m <= persistent_layer.MAX_M:
            runners["persistent"] = _with_pdl(_persistent, True)
        h = torch.randn(m, HIDDEN // div, device=dev, dtype=dt)
        attn = torch.randn(m, ATTN // div, device=dev, dtype=dt)
        results = {}
        for label, run in runners.items():
            if smoke and label == "cublas":
                continue
            results[label] = run(h, attn, ws).float()
            us = _graph_us(run, (h, attn, ws), smoke)
            rows.append({"M": m, "runner": label, "us_per_step": us, "weight_mb": mb,
                         "max_abs_diff_vs_unfused":
                             (results[label] - results["unfused"]).abs().max().item()
                             if "unfused" in results else None})
            if label.startswith("split"):
                rows[-1]["max_abs_diff_vs_fused"] = \
                    (results[label] - results["fused"]).abs().max().item()
            if label in ("fused_pdl", "persistent"):
                rows[-1]["equal_to_fused"] = torch.equal(results[label], results["fused"])
            if label.startswith("stream"):
                rows[-1]["max_abs_diff_vs_fused"] = \
                    (results[label] - results["fused"]).abs().max().item()
        line = "  ".join(f"{r['runner']} {r['us_per_step']:7.1f} us" for r in rows[-len(results):])
        print(f"chain M={m} ({layers} layers, {mb:.0f} MB): {line}")
    return rows


#: small_m_fused's launch overrides ``launch_sweep`` tries per op (block_k None: the planner's).
LAUNCH_SWEEP = [{"block_m": bm, "block_n": bn, "num_warps": nw, "block_k": bk}
                for bm, bn, nw, bk in itertools.product((16, 32), (16, 32, 64), (2, 4, 8),
                                                        (None, 128))]


def _pdl_chain(ops):
    """The fused chain of ``ops`` with PDL on, split-K and the stream kernels off."""
    return _with_split(_with_stream(_with_pdl(_fused_with(ops), True), False), False)


def launch_sweep(ms: list[int], smoke: bool, layers: int) -> list[dict]:
    """The ``fused_pdl`` chain of small_m_fused's ops with one op's launch overridden
    (``LAUNCH_SWEEP``), the others at their default: ``{"M", "op", "config", "us_per_step",
    "max_abs_diff_vs_default"}`` rows; ``us_per_step`` None where the launch failed (e.g. its
    tiles exceed the shared memory)."""
    dev, dt, div = ("cpu", torch.float32, 32) if smoke else ("cuda", torch.bfloat16, 1)
    ws = _weights(layers, div, dev, dt)
    ops = small_m_fused.SMALL_M_OPS
    names = ("norm_linear", "linear_add", "norm_gate_up_silu")
    cfgs = LAUNCH_SWEEP[:1] if smoke else LAUNCH_SWEEP
    rows = []
    for m in ms:
        h = torch.randn(m, HIDDEN // div, device=dev, dtype=dt)
        attn = torch.randn(m, ATTN // div, device=dev, dtype=dt)
        base_run = _pdl_chain(ops)
        ref = base_run(h, attn, ws).float()
        base = _graph_us(base_run, (h, attn, ws), smoke)
        rows.append({"M": m, "op": "default", "config": {}, "us_per_step": base,
                     "max_abs_diff_vs_default": 0.0})
        for i, name in enumerate(names):
            for cfg in cfgs:
                cfg = {k: v for k, v in cfg.items() if v is not None}
                swapped = list(ops)
                swapped[i] = functools.partial(ops[i], config=cfg)
                run = _pdl_chain(tuple(swapped))
                try:
                    diff = (run(h, attn, ws).float() - ref).abs().max().item()  # compiles
                    us = _graph_us(run, (h, attn, ws), smoke)
                except Exception as e:  # noqa: BLE001  (a launch that does not fit: recorded)
                    us, diff = None, f"{type(e).__name__}: {str(e)[:80]}"
                rows.append({"M": m, "op": name, "config": cfg, "us_per_step": us,
                             "max_abs_diff_vs_default": diff})
                print(f"launch sweep M={m} {name:>17} {cfg}: "
                      f"{'failed' if us is None else f'{us:7.1f} us'} (default {base:7.1f})")
    return rows


#: The persistent tail's knobs the sweep walks (the first is the default).
PERSISTENT_CONFIGS = (
    {}, {"slots": 1}, {"sleep": 100}, {"sleep": 500}, {"per_sm": 1}, {"per_sm": 2},
    {"per_sm": 4}, {"launch": (8, 1024, 4)},
    {"launch": (4, 1024, 8), "per_sm": 4}, {"launch": (16, 1024, 8), "per_sm": 4},
    {"launch": (4, 512, 4)})


def persistent_sweep(smoke: bool, layers: int) -> list[dict]:
    """The 28-layer chain at M = 1 through ``layer_tail`` under each of
    ``PERSISTENT_CONFIGS`` (barrier slots / poll sleep, programs a SM, launch)."""
    dev, dt, div = ("cpu", torch.float32, 32) if smoke else ("cuda", torch.bfloat16, 1)
    ws = _weights(layers, div, dev, dt)
    h = torch.randn(1, HIDDEN // div, device=dev, dtype=dt)
    attn = torch.randn(1, ATTN // div, device=dev, dtype=dt)
    pl = persistent_layer
    saved = (dict(pl.BARRIER), pl.MAX_PROGRAMS_PER_SM, pl.LAUNCH)
    rows = []
    try:
        for cfg in PERSISTENT_CONFIGS:
            pl.BARRIER = {"slots": cfg.get("slots", saved[0]["slots"]),
                          "sleep": cfg.get("sleep", saved[0]["sleep"])}
            pl.MAX_PROGRAMS_PER_SM = cfg.get("per_sm", saved[1])
            pl.LAUNCH = cfg.get("launch", saved[2])
            pl._GRIDS.clear()
            run = _with_pdl(_persistent, True)
            out = run(h, attn, ws)
            us = _graph_us(run, (h, attn, ws), smoke)
            grid = next(iter(pl._GRIDS.values()), None)
            rows.append({"config": {k: list(v) if isinstance(v, tuple) else v
                                    for k, v in cfg.items()}, "grid": grid, "us_per_step": us,
                         "h_sum": out.float().sum().item()})
            print(f"persistent {cfg}: grid {grid} {us:7.1f} us")
    finally:
        pl.BARRIER, pl.MAX_PROGRAMS_PER_SM, pl.LAUNCH = saved
        pl._GRIDS.clear()
    return rows


def sweep(ms: list[int], smoke: bool) -> list[dict]:
    """Each fused kernel alone over its launch knobs; the default launch first."""
    dev, dt, div = ("cpu", torch.float32, 32) if smoke else ("cuda", torch.bfloat16, 1)
    w = _weights(1, div, dev, dt)[0]
    cfgs = ([{}] + ([{"block_n": 4, "block_k": 32}] if smoke else
                    [{"block_n": bn, "block_k": bk, "num_warps": nw} for bn, bk, nw in
                     itertools.product((2, 4, 8), (256, 512, 1024), (2, 4, 8))]))
    rows = []
    for m in ms:
        h = torch.randn(m, HIDDEN // div, device=dev, dtype=dt)
        attn = torch.randn(m, ATTN // div, device=dev, dtype=dt)
        act = torch.randn(m, INTER // div, device=dev, dtype=dt)
        kernels = {
            "norm_qkv": lambda kw, h=h: skinny_norm_linear(h, w["ln1"], EPS, w["qkv"], **kw),
            "o_add": lambda kw, h=h, a=attn: skinny_linear_add(a, w["o"], h, **kw),
            "norm_gate_up_silu": lambda kw, h=h: skinny_norm_gate_up_silu(
                h, w["ln2"], EPS, w["gate_up"], **kw),
            "down_add": lambda kw, h=h, a=act: skinny_linear_add(a, w["down"], h, **kw),
        }
        for name, fn in kernels.items():
            timed = [(_time_us(lambda kw=kw, fn=fn: fn(kw), smoke), kw) for kw in cfgs]
            best = min(timed, key=lambda t: t[0])
            rows.append({"kernel": name, "M": m, "default_us": timed[0][0], "best_us": best[0],
                         "best_config": best[1]})
            print(f"{name:>18} M={m}  default {timed[0][0]:7.2f} us   best {best[0]:7.2f} "
                  f"{best[1]}")
    return rows


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark; returns the JSON it wrote."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU, no timing")
    ap.add_argument("--sweep", action="store_true", help="also each kernel alone, every config")
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--rows", default="1,2", help="chain rows, comma-separated (3-256: "
                    "small_m_fused's tensor-core layers against cuBLAS's)")
    ap.add_argument("--pdl", action="store_true",
                    help="also the fused chain launched with programmatic dependent launch")
    ap.add_argument("--stream", action="store_true", help="also the chain through "
                    "mrv2.kernels.skinny_stream (1-2 rows), PDL off and on")
    ap.add_argument("--stream-sweep", action="store_true",
                    help="the stream chain per kernel kind over (block_n, num_warps)")
    ap.add_argument("--split-k", action="store_true", help="also small_m_fused's chain "
                    "(3-256 rows) with its K split (SPLIT_K's rule), PDL off and on")
    ap.add_argument("--persistent", action="store_true", help="also the chain as one "
                    "persistent launch a layer (mrv2.kernels.persistent_layer, PDL on)")
    ap.add_argument("--launch-sweep", action="store_true", help="small_m_fused's launch per "
                    "op on the fused_pdl chain at the rows given (17-64 rows)")
    ap.add_argument("--persistent-sweep", action="store_true",
                    help="the persistent chain at M = 1 under each PERSISTENT_CONFIGS entry")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "skinny_fused.json"))
    args = ap.parse_args(argv)
    if not HAS_CUDA and not args.smoke:
        raise SystemExit("bench_skinny_fused times the GPU; use --smoke on the CPU")
    ms = [int(r) for r in args.rows.split(",")]
    # NOTE: this script times small_m_fused's own Triton kernels; its entry points hand bf16
    # GPU calls to small_m_resident by default (scripts/bench_resident_chain.py times that).
    small_m_resident.ENABLED = False
    report = {"benchmark": "fused decode GEMM chain",
              "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "hardware": torch.cuda.get_device_name() if HAS_CUDA else "cpu",
              "versions": {"torch": torch.__version__, "triton": triton.__version__},
              "smoke": args.smoke, "layers": args.layers,
              "chain": chain(ms, args.smoke, args.layers, args.pdl, args.persistent,
                             args.stream or args.smoke, args.split_k or args.smoke),
              "stream_sweep": (stream_sweep([m for m in ms if m <= skinny_stream.MAX_M],
                                            args.smoke, args.layers)
                               if args.stream_sweep or args.smoke else []),
              "kernels": (sweep([m for m in ms if m <= skinny_fused.MODEL_MAX_M], args.smoke)
                          if args.sweep or args.smoke else []),
              "persistent_sweep": (persistent_sweep(args.smoke, args.layers)
                                   if args.persistent_sweep or args.smoke else []),
              "launch_sweep": (launch_sweep([m for m in ms if m > skinny_fused.MODEL_MAX_M]
                                            or [3], args.smoke, args.layers)
                               if args.launch_sweep or args.smoke else [])}
    pathlib.Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
