"""Timing rules shared by every runner: synchronise, then read the clock.

A GPU runs behind the CPU, so a wall-clock figure is only true if the device is
idle when the clock starts and has finished when it stops:
``torch.cuda.synchronize()`` on both sides of the timed region, and nowhere inside
it (the harness adds no per-step or per-token sync of its own).
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from mrv2 import platform
from mrv2.bench.spec import merge as spec_merge
from mrv2.bench.workloads import Workload


def sync() -> None:
    """Wait for the GPU (a no-op on the CPU)."""
    if platform.HAS_CUDA:
        torch.cuda.synchronize()


def timed(fn: Callable[[], object]) -> tuple[object, float]:
    """Run ``fn`` between two device syncs; returns ``(its result, seconds)``."""
    sync()
    t0 = time.perf_counter()
    out = fn()
    sync()
    return out, time.perf_counter() - t0


@contextmanager
def count_triton_compiles() -> Iterator[list[str]]:
    """Collect the names of the Triton kernels compiled inside the block.

    A kernel variant met for the first time is compiled on the spot (~0.1-0.5 s on the
    GPU); inside a timed run that time is counted as the runner's. The figures record
    the count so a reader can check it is 0. Uses ``triton.knobs.runtime.jit_cache_hook``
    (called on each miss of Triton's in-memory kernel cache); under the interpreter, or
    on a Triton without the hook, nothing is compiled or counted and the list stays empty.

    Yields:
        The list the names are appended to.
    """
    names: list[str] = []
    try:
        from triton import knobs
        runtime = knobs.runtime
        previous = runtime.jit_cache_hook
    except (ImportError, AttributeError):
        yield names
        return

    def hook(**kwargs):
        names.append(getattr(kwargs.get("fn"), "name", "?"))
        return previous(**kwargs) if previous is not None else False

    runtime.jit_cache_hook = hook
    try:
        yield names
    finally:
        runtime.jit_cache_hook = previous


def free_device_memory() -> dict:
    """Collect garbage and return cached GPU blocks, so the next runner starts clean.

    Returns:
        ``{"allocated_gib": ..., "reserved_gib": ...}`` after freeing (zeros on the CPU).
    """
    gc.collect()
    if not platform.HAS_CUDA:
        return {"allocated_gib": 0.0, "reserved_gib": 0.0}
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return {"allocated_gib": torch.cuda.memory_allocated() / 2**30,
            "reserved_gib": torch.cuda.memory_reserved() / 2**30}


def throughput_figures(wall_s: float, output_tokens: int, steps: int) -> dict:
    """Output tokens/s and mean step time of one timed run."""
    return {"wall_s": wall_s, "output_tokens": int(output_tokens), "steps": int(steps),
            "output_tok_s": output_tokens / wall_s if wall_s > 0 else None,
            "mean_step_ms": 1e3 * wall_s / steps if steps else None}


#: ``generate(workload, max_tokens) -> {"wall_s", "output_tokens", "steps", ...}``; a
#: ``max_tokens`` of ``None`` means each request's own output length.
GenerateFn = Callable[[Workload, "int | None"], dict]


def latency_rows(generate: GenerateFn, batches: list[Workload], iters: int = 3) -> list[dict]:
    """TTFT and TPOT of one runner for each batch (see :func:`interleaved_latency_rows`)."""
    return interleaved_latency_rows({"runner": generate}, batches, iters)["runner"]


def interleaved_latency_rows(generates: dict[str, GenerateFn], batches: list[Workload],
                             iters: int = 3) -> dict[str, list[dict]]:
    """TTFT and TPOT of several runners for each batch, the runners taking turns.

    TTFT is the wall time of a prefill-only run (``max_tokens=1``): every request of
    the batch gets its first token by then. TPOT is ``(e2e - TTFT) / (output_len - 1)``
    with e2e the wall time of the full run. Medians over ``iters`` runs. Each timed run
    of one runner is followed by the same run of the next, so a drift of the machine
    during the measurement (clocks, other load) falls on all runners alike.

    NOTE: a prefill step runs eagerly: its time is mostly Python launching ~300 kernels,
    which makes TTFT sensitive to the host's state; measured one runner after the other
    in separate phases, the same runner's TTFT moved by up to 10 ms between batch sizes.

    Args:
        generates: runner name -> its ``GenerateFn``.
        batches: one fixed-length workload per batch size.
        iters: timed runs of each kind.

    Returns:
        Runner name -> one dict per batch: ``batch_size, input_len, output_len, ttft_ms,
        e2e_ms, tpot_ms, steps, mean_step_ms``, the raw runs, ``triton_compiles`` and
        ``spec_decode`` (the timed full runs' acceptance counts added up, or ``None``).
    """
    rows: dict[str, list[dict]] = {name: [] for name in generates}
    for wl in batches:
        out_len = wl.output_lens[0]
        # NOTE: an untimed run of each shape first: a kernel variant compiled inside a
        # timed run (e.g. the first prefill of this length) would inflate it.
        for generate in generates.values():
            generate(wl, 1)
            generate(wl, None)
        first = {name: [] for name in generates}
        full = {name: [] for name in generates}
        for _ in range(iters):
            for name, generate in generates.items():
                first[name].append(generate(wl, 1))
        for _ in range(iters):
            for name, generate in generates.items():
                full[name].append(generate(wl, None))
        for name in generates:
            ttft = [r["wall_s"] * 1e3 for r in first[name]]
            e2e = [r["wall_s"] * 1e3 for r in full[name]]
            ttft_ms, e2e_ms = statistics.median(ttft), statistics.median(e2e)
            steps = full[name][0]["steps"]
            rows[name].append({
                "batch_size": wl.num_requests, "input_len": wl.input_lens[0],
                "output_len": out_len, "ttft_ms": ttft_ms, "e2e_ms": e2e_ms,
                "tpot_ms": (e2e_ms - ttft_ms) / (out_len - 1) if out_len > 1 else None,
                "steps": steps, "mean_step_ms": e2e_ms / steps if steps else None,
                "ttft_ms_runs": ttft, "e2e_ms_runs": e2e,
                "triton_compiles": sum(r.get("triton_compiles", 0)
                                       for r in first[name] + full[name]),
                # acceptance of the timed full runs (mrv2.bench.spec; None: no speculation)
                "spec_decode": spec_merge([r.get("spec_decode") for r in full[name]])})
    return rows


def sweep_rows(generate: GenerateFn, batches: list[Workload],
               warm_up: Callable[[Workload], object] | None = None) -> list[dict]:
    """Output tokens/s of decode-dominated runs, one timed run per batch size.

    Args:
        generate: runs a workload, see ``GenerateFn``.
        batches: one fixed-length workload per batch size.
        warm_up: a short untimed run of a workload, done before timing it (new sizes
            may need new kernel variants compiled).
    """
    rows = []
    for wl in batches:
        if warm_up is not None:
            warm_up(wl)
        r = generate(wl, None)
        rows.append({"batch_size": wl.num_requests, "input_len": wl.input_lens[0],
                     "output_len": wl.output_lens[0], **r})
    return rows


def random_token_prompts(num: int, length: int, vocab: int, seed: int = 0) -> list[dict]:
    """``num`` token-id prompts of ``length`` random ids below ``vocab`` (seeded)."""
    import numpy as np

    rng = np.random.RandomState(seed)
    return [{"prompt_token_ids": rng.randint(0, vocab, size=length).tolist()} for _ in range(num)]


def timed_generate(llm, prompts, sp) -> float:
    """Seconds of one ``llm.generate`` between two device syncs."""
    return timed(lambda: llm.generate(prompts, sp, use_tqdm=False))[1]
