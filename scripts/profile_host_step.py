"""V2's host time per step at a large batch, on the CPU, with the device work stubbed out.

On the GPU a short step leaves the host as the bound (issue 21, item 6): what counts is
the Python of ``schedule`` / staged writes / input prep / output processing. On the CPU
the Triton interpreter and the model would swamp it, so this script runs the real engine,
scheduler, runner and ``LLM.generate`` with:

* every Triton launch a no-op (``InterpretedFunction.run``: the launcher's own Python, grid
  and output allocations still run; the interpreter's per-launch work does not);
* the model's forward and ``compute_logits`` replaced by preallocated outputs (on the GPU
  the forward is a CUDA graph replay: one launch);
* the Gumbel sampler's output zeroed (token 0 every step: ``ignore_eos``, so every request
  runs to ``max_tokens``).

It times ``LLM.generate`` on ``--requests`` prompts of ``--input-len`` tokens, each making
``--output-len`` tokens, at ``max_num_seqs=--batch``, and reports this thread's CPU ms per engine step (``time.thread_time``: robust on a
shared machine) and the mean CPU ms per timeline phase (``schedule``, ``prep``, ``forward``, ``sample``,
``wait``, ``output``; ``other`` is the rest: the ``LLM`` loop and request bookkeeping).
Each phase is also given as the median over engine calls (the typical decode step, without
the admission and finishing steps). With ``--cprofile N`` it also prints the top N functions by cumulative time.

Usage::

    PYTHONPATH=. python scripts/profile_host_step.py [--batch 256] [--requests 1024]
        [--input-len 32] [--output-len 128] [--repeats 3] [--runner v2] [--cprofile 40]
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import pstats
import statistics
import time

import numpy as np
import torch

import mrv2  # noqa: F401  (first: on a CPU it switches Triton to its interpreter)
from mrv2.llm import LLM
from mrv2.sampling_params import SamplingParams
from mrv2.timeline import Timeline

MODEL = "mrv2/assets/tiny-qwen3-shakespeare"


@contextlib.contextmanager
def stubbed_device(llm: LLM):
    """Triton launches, the forward, the logits and the samples made (nearly) free."""
    from triton.runtime.interpreter import InterpretedFunction

    import mrv2.sample.sampler as sampler_mod

    runner = llm.llm_engine.engine.runner
    ms = getattr(runner, "model_state", None)
    saved = [(InterpretedFunction, "run", InterpretedFunction.run),
             (sampler_mod, "gumbel_sample", sampler_mod.gumbel_sample)]
    InterpretedFunction.run = lambda self, *a, **k: None
    orig_gumbel = sampler_mod.gumbel_sample
    sampler_mod.gumbel_sample = lambda *a, **k: orig_gumbel(*a, **k).zero_()
    if ms is not None:
        hidden_size = llm.hf_config.hidden_size
        hidden = torch.zeros(runner.max_num_tokens, hidden_size)
        logits = torch.zeros(runner.max_num_tokens, llm.hf_config.vocab_size)
        saved += [(ms, "run", ms.run), (ms, "compute_logits", ms.compute_logits)]
        ms.run = lambda batch, graph_size=None: hidden[:batch.num_tokens_padded]
        ms.compute_logits = lambda h: logits[:h.shape[0]]
    try:
        yield
    finally:
        for obj, name, value in saved:
            if obj is ms:
                delattr(obj, name)  # the instance attribute: back to the class's method
            else:
                setattr(obj, name, value)


class CpuTimeline(Timeline):
    """A CPU-only ``Timeline`` whose spans are this thread's CPU time (``time.thread_time``):
    on a shared machine, time the thread waited for a core is left out."""

    def __init__(self):
        super().__init__(use_cuda=False)
        self._t0 = time.thread_time()

    @contextlib.contextmanager
    def cpu(self, name: str):
        t0 = time.thread_time()
        try:
            yield
        finally:
            self.cpu_spans.append((self.step, name, t0 - self._t0, time.thread_time() - self._t0))


def run_once(llm: LLM, prompts, sp, cprofile: int = 0) -> dict:
    """One timed ``generate``: CPU ms per step and mean CPU ms per timeline phase."""
    engine = llm.llm_engine.engine
    tl = CpuTimeline()
    engine.timeline = tl
    steps0 = engine.num_steps
    prof = cProfile.Profile() if cprofile else None
    t0 = time.thread_time()
    if prof is not None:
        prof.enable()
    llm.generate(prompts, sp, use_tqdm=False)
    if prof is not None:
        prof.disable()
    wall = time.thread_time() - t0
    engine.timeline = None
    steps = engine.num_steps - steps0
    calls = tl.step
    totals: dict[str, float] = {}
    for _, name, a, b in tl.cpu_spans:
        totals[name] = totals.get(name, 0.0) + (b - a) * 1e3
    phases = {k: v / calls for k, v in totals.items()}
    phases["other"] = wall * 1e3 / calls - sum(phases.values())
    # The typical step (admission / finishing steps are the outliers): per phase, the
    # median over calls of its ms in that call.
    per_call: dict[str, dict[int, float]] = {}
    for step, name, a, b in tl.cpu_spans:
        d = per_call.setdefault(name, {})
        d[step] = d.get(step, 0.0) + (b - a) * 1e3
    median_phases = {k: statistics.median(list(v.values()) + [0.0] * (calls - len(v)))
                     for k, v in per_call.items()}
    if prof is not None:
        pstats.Stats(prof).sort_stats("cumulative").print_stats(cprofile)
    return {"cpu_ms_per_step": wall * 1e3 / calls, "steps": steps, "calls": calls,
            "phases": phases, "median_phases": median_phases}


def main(argv=None) -> dict:
    """Run the measurement; returns ``{"runs": [...], "cpu_ms_per_step": median}``."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=256, help="max_num_seqs")
    p.add_argument("--requests", type=int, default=1024)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--runner", default="v2", choices=["v1", "v2"])
    p.add_argument("--sync", action="store_true",
                   help="V2 without async scheduling (the GPU default is async for V2)")
    p.add_argument("--cprofile", type=int, default=0, help="print the top N functions")
    args = p.parse_args(argv)

    max_len = args.input_len + args.output_len
    llm = LLM(model=MODEL, runner=args.runner, skip_tokenizer_init=True,
              max_num_seqs=args.batch, max_model_len=max_len, block_size=args.block_size,
              async_scheduling=not args.sync if args.runner == "v2" else False,
              num_gpu_blocks_override=args.batch * (max_len // args.block_size + 2))
    rng = np.random.RandomState(0)
    prompts = [{"prompt_token_ids": rng.randint(1, 2000, args.input_len).tolist()}
               for _ in range(args.requests)]
    sp = SamplingParams(temperature=0.6, max_tokens=args.output_len, ignore_eos=True)
    with stubbed_device(llm):
        run_once(llm, prompts[:min(16, args.requests)], sp)  # warm-up
        runs = [run_once(llm, prompts, sp) for _ in range(args.repeats)]
        if args.cprofile:
            run_once(llm, prompts, sp, cprofile=args.cprofile)
    med = statistics.median(r["cpu_ms_per_step"] for r in runs)
    names = list(runs[0]["phases"])
    print(f"runner {args.runner}, batch {args.batch}, {args.requests} x {args.input_len} in / "
          f"{args.output_len} out, {runs[0]['calls']} engine calls ({runs[0]['steps']} steps)")
    print(f"CPU ms/step: median {med:.3f} of {[round(r['cpu_ms_per_step'], 3) for r in runs]}")
    print("  phase     mean ms/step  median ms/call")
    for n in names:
        vals = [r["phases"].get(n, 0.0) for r in runs]
        meds = [r["median_phases"][n] for r in runs if n in r["median_phases"]]
        typical = f"{statistics.median(meds):15.3f}" if meds else f"{'-':>15s}"
        print(f"  {n:9s} {statistics.median(vals):12.3f} {typical}")
    return {"runs": runs, "cpu_ms_per_step": med}


if __name__ == "__main__":
    torch.set_num_threads(1)  # the host's Python is what is measured, not torch's threads
    main()
