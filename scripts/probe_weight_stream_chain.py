"""The floor of a chain of weight-streaming kernels: what any one-kernel-per-GEMM decode can reach.

At batch 1 the decode step is 112 weight streams (28 layers x 4 products, 881 MB) plus small
kernels, and every implementation tried so far lands near the same time for the streams:
cuBLAS ~620-660 us, the fused skinny PDL chain 654, the tensor-core small_m 680-770, a
persistent kernel with grid barriers 745 (``persistent_layer.py``), against 208 us for the
bytes at 4.24 TB/s. This probe asks how much of that is the boundary itself. It times, in one
CUDA graph, ``--kernels`` launches of the simplest possible stream: program p loads its
``block`` contiguous bf16 weights (16-byte loads, the whole chunk in flight at once), then
multiplies their sum by one value the PREVIOUS kernel wrote (a true dependency), and stores
one float. With PDL (``--pdl``) the weights are loaded before ``griddepcontrol.wait``: the
ideal PDL GEMV, everything but one scalar prefetched. Each launch streams its own
``--mb`` MB buffer (the chain's bytes are far beyond the L2). Also an empty chain (one
program an SM, nothing loaded) for the bare launch-and-dependency cost.

``--prefetch`` (session 27) adds variants where each kernel, first thing, also asks the L2
for its share of the weights ``--ahead`` kernels later (``line``: one ``prefetch.global.L2``
a 128-byte line; ``bulk``: one ``cp.async.bulk.prefetch.L2`` a 4 KB chunk, sm_90), so that
the DRAM would never idle across a kernel boundary and the later kernel's loads would hit
the L2: can a weight stream paced by its own kernels, not by their launches, beat the ~55%
of the bandwidth the plain chain reaches (job 15A)? It cannot (H100, job 27PF, 112 kernels
x 7.9 MB, PDL on): 8,192 weights a program 428 us a chain plain, 458 / 492 with line
prefetches 1 / 2 kernels ahead, 610 / 635 with bulk ones; 4,096 a program 441 plain, 443 /
453 with lines, 557 / 567 bulk. The prefetched lines compete with the kernel's own loads
for the same DRAM time; so no L2 prefetch was wired into the model's GEMMs.

Prints, per variant: us per chain, us per kernel, TB/s of the weight bytes; ``--out`` writes
the JSON. ``--smoke`` runs tiny sizes through the interpreter and checks the values only.

Usage (GPU)::

    python scripts/probe_weight_stream_chain.py --out benchmarks/results/X.json
"""

from __future__ import annotations  # noqa: I001  (mrv2 before triton: see the NOTE below)

import argparse
import json
import time

# NOTE: mrv2 first: it switches Triton to its interpreter on a machine without CUDA.
from mrv2.platform import TRITON_INTERPRET

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from mrv2.kernels import pdl
from mrv2.kernels.pdl import GDC_CALLS


PREFETCH_MODES = {"none": 0, "line": 1, "bulk": 2}


@triton.jit
def _prefetch_lines(ptrs):
    # One ``prefetch.global.L2`` a 128-byte line: no register waits for it.
    return tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs],
                                     dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _prefetch_bulk(ptrs):
    # One bulk prefetch (the TMA engine) of 4 KB into the L2 a pointer (sm_90).
    return tl.inline_asm_elementwise(
        "cp.async.bulk.prefetch.L2.global [$1], 4096; mov.u32 $0, 0;", "=r,l", [ptrs],
        dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _stream_kernel(w_ptr, x_ptr, out_ptr, nxt_ptr, BLOCK: tl.constexpr, LOAD: tl.constexpr,
                   PDL: tl.constexpr, PREFETCH: tl.constexpr):
    # out[p] = x[0] * sum(w[p * BLOCK : (p + 1) * BLOCK]); w before the wait (PDL).
    # PREFETCH: first, program p's block of a LATER kernel's weights (nxt) into the L2.
    pid = tl.program_id(0)
    if PREFETCH == 1:
        _prefetch_lines(nxt_ptr + pid * BLOCK + tl.arange(0, BLOCK // 64) * 64)   # 128 B lines
    if PREFETCH == 2:
        _prefetch_bulk(nxt_ptr + pid * BLOCK + tl.arange(0, BLOCK // 2048) * 2048)  # 4 KB
    total = 0.0
    if LOAD:
        w = tl.load(w_ptr + pid * BLOCK + tl.arange(0, BLOCK))               # [BLOCK] bf16
        total = tl.sum(w.to(tl.float32), 0)
    if PDL and GDC_CALLS:
        gdc_wait()               # the previous kernel has completed: x is its output
        gdc_launch_dependents()
    tl.store(out_ptr + pid, total * tl.load(x_ptr).to(tl.float32))


def sm90_ptx(prefetch: str, block: int = 8192) -> str:
    """The stream kernel (PDL on) compiled for sm_90 with a ``prefetch`` mode: its PTX (no
    GPU: Triton's own binder, ``scripts/check_pdl_sm90.py``; in a process started with
    ``TRITON_INTERPRET=0``, since this module imports mrv2 first)."""
    import check_pdl_sm90

    w, o = torch.zeros(4 * block, dtype=torch.bfloat16), torch.zeros(4)
    return check_pdl_sm90._compile(_stream_kernel, (w, o, o, w), {
        "BLOCK": block, "LOAD": True, "PDL": True, "PREFETCH": PREFETCH_MODES[prefetch],
        "num_warps": 4}).asm["ptx"]


def stream_ref(w: torch.Tensor, x0: torch.Tensor, block: int) -> torch.Tensor:
    """Reference: ``x0 * w.view(-1, block).sum(-1)`` in fp32."""
    return w.float().view(-1, block).sum(-1) * x0.float()


def chain(ws, outs, block, load, use_pdl, num_warps, prefetch="none", ahead=1):
    """Launch the chain: kernel i reads ``outs[i - 1][0]`` (the first reads ``outs[-1]``);
    with ``prefetch``, kernel i also brings ``ws[(i + ahead) % n]`` into the L2."""
    for i, w in enumerate(ws):
        grid = (w.numel() // block,) if load else (outs[i].numel(),)
        nxt = ws[(i + ahead) % len(ws)]
        _stream_kernel[grid](w, outs[i - 1], outs[i], nxt, BLOCK=block, LOAD=load, PDL=use_pdl,
                             PREFETCH=PREFETCH_MODES[prefetch],
                             **({} if TRITON_INTERPRET else {"num_warps": num_warps}),
                             **pdl.launch_kwargs(use_pdl))


def time_variant(n_kernels, mb, block, load, use_pdl, num_warps, replays, device,
                 prefetch="none", ahead=1):
    """us per chain (median of ``replays`` graph replays) for one variant."""
    numel = int(mb * 1e6) // 2 // block * block           # bf16 weights, MB = 1e6 bytes
    ws = [torch.randn(numel, device=device).to(torch.bfloat16) for _ in range(n_kernels)]
    n_out = numel // block if load else torch.cuda.get_device_properties(device) \
        .multi_processor_count
    outs = [torch.ones(n_out, device=device) for _ in range(n_kernels)]
    run = lambda: chain(ws, outs, block, load, use_pdl, num_warps, prefetch, ahead)
    run()                                                       # compile, then capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        run()
    for _ in range(3):
        g.replay()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    us = sorted(times)[len(times) // 2]
    nbytes = n_kernels * numel * 2 if load else 0
    return {"kernels": n_kernels, "mb_per_kernel": numel * 2 / 1e6 if load else 0.0,
            "block": block if load else 0, "programs": n_out, "pdl": use_pdl,
            "num_warps": num_warps, "prefetch": prefetch, "ahead": ahead,
            "us_per_chain": us, "us_per_kernel": us / n_kernels,
            "tb_s": nbytes / (us * 1e-6) / 1e12 if load else None}


def smoke() -> None:
    """Interpreter: the chain's values against the reference (tiny sizes, no timing)."""
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(4 * 64, generator=g).to(torch.bfloat16) for _ in range(3)]
    outs = [torch.zeros(4) for _ in range(3)]
    outs[-1][0] = 2.0
    x0 = outs[-1][0].clone()
    chain(ws, outs, 64, True, False, 4)   # (the prefetch variants are inline PTX: GPU only)
    expect = stream_ref(ws[0], x0, 64)
    torch.testing.assert_close(outs[0], expect)
    torch.testing.assert_close(outs[1], stream_ref(ws[1], expect[0], 64))
    print("smoke ok")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kernels", type=int, default=112)
    ap.add_argument("--mb", type=float, default=7.9, help="weight MB a kernel (881 / 112)")
    ap.add_argument("--blocks", default="2048,4096,8192,16384",
                    help="bf16 weights a program, comma-separated")
    ap.add_argument("--warps", default="4", help="num_warps, comma-separated")
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--prefetch", default="none",
                    help="comma-separated of none,line,bulk: the L2 prefetch variants to add")
    ap.add_argument("--ahead", default="1", help="kernels ahead to prefetch, comma-separated")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.smoke:
        smoke()
        return 0
    if not torch.cuda.is_available():
        print("error: the probe needs a CUDA GPU (or --smoke)")
        return 2
    dev = torch.device("cuda")
    use_pdls = [False, True] if pdl.use_pdl(dev) else [False]
    rows = []
    t0 = time.time()
    for p in use_pdls:
        rows.append(time_variant(args.kernels, 0, 1, False, p, 4, args.replays, dev))
        for nw in map(int, args.warps.split(",")):
            for block in map(int, args.blocks.split(",")):
                rows.append(time_variant(args.kernels, args.mb, block, True, p, nw,
                                         args.replays, dev))
                for mode in [m for m in args.prefetch.split(",") if m != "none"]:
                    for ahead in map(int, args.ahead.split(",")):
                        rows.append(time_variant(args.kernels, args.mb, block, True, p, nw,
                                                 args.replays, dev, mode, ahead))
    for r in rows:
        tb = "" if r["tb_s"] is None else f"{r['tb_s']:.2f} TB/s"
        print(f"pdl={int(r['pdl'])} block={r['block']:6d} programs={r['programs']:5d} "
              f"warps={r['num_warps']} prefetch={r['prefetch']}+{r['ahead']} "
              f"{r['us_per_chain']:8.1f} us/chain "
              f"{r['us_per_kernel']:6.2f} us/kernel  {tb}")
    if args.out:
        meta = {"gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__,
                "triton": triton.__version__, "wall_s": time.time() - t0,
                "args": vars(args)}
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
        print("wrote", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
