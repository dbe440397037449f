"""Count the host work of one decode step, plain or speculating (CPU, embedded model).

On the GPU a small model's step is host-bound: every eager torch op and every Triton
launch costs ~5-10 us of host time, a CUDA graph replay one launch. This script counts,
per steady-state decode step and split into *outside* / *inside* CUDA graphs (the runner's
graph managers in ``emulate`` mode: the eager body runs where a graph would replay):

* aten ops (a ``TorchDispatchMode`` that counts every op dispatched),
* Triton launches (``JITFunction.run`` / the interpreter's ``InterpretedFunction.run``),
* wall time per step on this CPU (interpreter kernels included: only a rough proxy), and
  ``py ms``: that time minus the time inside aten ops and Triton launches, i.e. the Python
  of the step (scheduler excluded; the dispatch mode's own overhead included).

The ops *outside* graphs are the ones that cost host time on the GPU every step.

Usage::

    PYTHONPATH=. python scripts/count_step_ops.py [--batch-sizes 1,8] [--k 3]
        [--methods none,ngram,draft_model,eagle] [--steps 6]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import mrv2  # noqa: F401  (first: on a CPU it switches Triton to its interpreter)
from mrv2.bench.workloads import EMBEDDED_LOOP
from mrv2.cuda_graphs import CudaGraphManager, make_graph_manager
from mrv2.llm import LLM
from mrv2.sampling_params import SamplingParams

MODEL = "mrv2/assets/tiny-qwen3-shakespeare"
ASSETS = {"draft_model": "mrv2/assets/tiny-qwen3-shakespeare-draft",
          "eagle": "mrv2/assets/tiny-qwen3-shakespeare-eagle"}


class _Counts:
    """Global counters, split by whether a (emulated) CUDA graph body is running."""

    def __init__(self):
        self.in_graph = 0      # nesting depth of CudaGraphManager.run
        self.in_triton = 0     # nesting depth of a Triton launch (its torch calls not counted)
        self.ops = Counter()   # ("out" | "in") -> aten ops
        self.launches = Counter()
        self.names = Counter()  # aten op names outside graphs
        self.busy = 0.0         # seconds inside aten ops and Triton launches (outermost)

    def where(self) -> str:
        return "in" if self.in_graph else "out"


COUNTS = _Counts()


class _CountOps(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if COUNTS.in_triton:
            return func(*args, **(kwargs or {}))
        COUNTS.ops[COUNTS.where()] += 1
        if not COUNTS.in_graph:
            COUNTS.names[str(func.overloadpacket.__name__)] += 1
        t0 = time.perf_counter()
        try:
            return func(*args, **(kwargs or {}))
        finally:
            COUNTS.busy += time.perf_counter() - t0


def _patch_triton():
    """Count every Triton launch (compiled or interpreted)."""
    patched = []
    with contextlib.suppress(ImportError):
        from triton.runtime.interpreter import InterpretedFunction
        patched.append(InterpretedFunction)
    from triton.runtime.jit import JITFunction
    patched.append(JITFunction)
    for cls in patched:
        orig = cls.run

        def run(self, *args, _orig=orig, **kwargs):
            if COUNTS.in_triton == 0:
                COUNTS.launches[COUNTS.where()] += 1
            COUNTS.in_triton += 1
            t0 = time.perf_counter()
            try:
                return _orig(self, *args, **kwargs)
            finally:
                COUNTS.in_triton -= 1
                if COUNTS.in_triton == 0:
                    COUNTS.busy += time.perf_counter() - t0
        cls.run = run


def _patch_graphs():
    orig = CudaGraphManager.run

    def run(self, key, eager):
        COUNTS.in_graph += 1
        try:
            return orig(self, key, eager)
        finally:
            COUNTS.in_graph -= 1
    CudaGraphManager.run = run


def _llm(method: str, k: int, batch: int) -> LLM:
    spec = None
    if method != "none":
        spec = {"method": method, "num_speculative_tokens": k}
        if method in ASSETS:
            spec["model"] = ASSETS[method]
    llm = LLM(MODEL, dtype="float32", max_model_len=256, max_num_seqs=max(batch, 1),
              async_scheduling=True, speculative_config=spec)
    r = llm.runner
    r.cuda_graphs = make_graph_manager(
        r.max_num_reqs, r.max_num_tokens, use_graphs=True,
        num_speculative_tokens=0 if r.spec is None else r.spec.k, emulate=True)
    r.capture_cuda_graphs(progress=False)
    return llm


def measure(method: str, k: int, batch: int, steps: int) -> dict:
    """Median per-step counts over the decode steps of one small generate call."""
    llm = _llm(method, k, batch)
    runner = llm.runner
    orig = runner.execute_model
    per_step = []

    def execute_model(sched):
        decode = (not sched.new_reqs and sched.total_num_scheduled_tokens > 0
                  and max(sched.num_scheduled_tokens.values()) <= 1 + k)
        ops0, l0, names0 = COUNTS.ops.copy(), COUNTS.launches.copy(), COUNTS.names.copy()
        busy0, t0 = COUNTS.busy, time.perf_counter()
        with _CountOps():
            out = orig(sched)
        dt = time.perf_counter() - t0
        if decode:
            per_step.append({"ops_out": COUNTS.ops["out"] - ops0["out"],
                             "ops_in": COUNTS.ops["in"] - ops0["in"],
                             "launch_out": COUNTS.launches["out"] - l0["out"],
                             "launch_in": COUNTS.launches["in"] - l0["in"],
                             "ms": dt * 1e3, "py_ms": (dt - COUNTS.busy + busy0) * 1e3,
                             "names": COUNTS.names - names0})
        return out
    runner.execute_model = execute_model
    prompts = [{"prompt_token_ids": (EMBEDDED_LOOP[i % len(EMBEDDED_LOOP):]
                                     + EMBEDDED_LOOP[:i % len(EMBEDDED_LOOP)]) * 3}
               for i in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=4 * (steps + 2), ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)
    per_step = per_step[2:2 + steps] or per_step
    row = {key: statistics.median(s[key] for s in per_step)
           for key in ("ops_out", "ops_in", "launch_out", "launch_in", "ms",
                                      "py_ms")}
    row["names"] = per_step[len(per_step) // 2]["names"]
    return row


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--methods", default="none,ngram,draft_model,eagle")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--top", type=int, default=0, help="print the N most frequent aten ops "
                   "outside graphs per row")
    args = p.parse_args(argv)
    _patch_triton()
    _patch_graphs()
    torch.set_num_threads(1)
    print(f"{'method':12s} {'B':>3s} {'aten out':>9s} {'aten in':>8s} {'triton out':>10s} "
          f"{'triton in':>9s} {'ms/step(CPU)':>12s} {'py ms':>6s}")
    for method in args.methods.split(","):
        for b in (int(x) for x in args.batch_sizes.split(",")):
            r = measure(method, args.k, b, args.steps)
            print(f"{method:12s} {b:3d} {r['ops_out']:9.0f} {r['ops_in']:8.0f} "
                  f"{r['launch_out']:10.0f} {r['launch_in']:9.0f} {r['ms']:12.1f} {r['py_ms']:6.2f}")
            if args.top:
                print("   ", ", ".join(f"{n}:{c}" for n, c in r["names"].most_common(args.top)))


if __name__ == "__main__":
    main()
