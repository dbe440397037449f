"""Benchmarks: mrv2 V2 against the V1-style baseline and ``transformers``, on one GPU.

``python -m mrv2 bench throughput|latency`` runs every runner asked for (``v2``,
``v1``, ``hf``) in one process, one after another, on the same model and weights and
the same prompts, and writes one JSON (hardware, versions, commit, config, every
figure) to ``--out`` or the current directory. The protocol:

* **Prompts.** Random token ids, uniform in ``[0, vocab)``, from
  ``numpy.random.RandomState(seed)``; every request has ``temperature=0.6`` and
  ``ignore_eos=True``, so it produces exactly the tokens it asks for.
* **standard** (throughput): 256 requests, input and output lengths uniform in
  ``[100, 1024]``; **host-bound**: 1024 requests of 32 in / 128 out, where the
  runner's host overhead dominates and the V2/V1 ratio lives.
* **Throughput.** Build, one small warm-up ``generate``, then one timed
  ``generate`` of the whole workload with ``torch.cuda.synchronize()`` before the
  clock starts and before it stops; output tokens/s = output tokens / wall time.
  The harness adds no sync inside the step loop.
* **Latency.** For batch sizes 1, 8, 32 (128 in / 128 out), all prompts submitted at
  once: TTFT = wall time of a prefill-only run (``max_tokens=1``), TPOT =
  (e2e - TTFT) / (output_len - 1); medians of a few runs.
* **transformers.** ``AutoModelForCausalLM`` holding the mrv2 model's weights
  (copied by name), ``generate`` in left-padded batches sorted by length; a batch
  runs to its longest output and only requested tokens count (``hf_runs``).
* **Roofline.** A decode step reads the weights and the cached K/V of every request:
  its best time is those bytes over the measured copy bandwidth (``roofline``).
* **Memory.** Each runner is freed (``del``, ``gc.collect()``,
  ``torch.cuda.empty_cache()``) before the next is built; a runner that fails is an
  error row and the others still run.

The figures are plotted from the JSON by ``plot_throughput``, ``plot_latency``,
``plot_roofline`` (pure matplotlib), e.g. in notebooks/10_full_runner_qwen3_and_benchmarks.
"""

# Lazy, so that `python -m mrv2 bench --help` (which imports mrv2.bench.cli) needs no torch.
_LAZY = {
    "load_results": "plots", "plot_latency": "plots", "plot_roofline": "plots",
    "plot_step_split": "plots", "plot_throughput": "plots", "save_plots": "plots",
    "copy_bandwidth": "roofline", "decode_roofline": "roofline",
    "kv_bytes_per_token": "roofline", "weight_bytes": "roofline",
    "BenchConfig": "suite", "run_latency": "suite", "run_throughput": "suite",
    "Workload": "workloads", "make_workload": "workloads", "random_workload": "workloads",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"mrv2.bench.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'mrv2.bench' has no attribute {name!r}")


__all__ = ["BenchConfig", "Workload", "copy_bandwidth", "decode_roofline", "kv_bytes_per_token",
           "load_results", "make_workload", "plot_latency", "plot_roofline", "plot_step_split",
           "plot_throughput", "random_workload", "run_latency", "run_throughput", "save_plots",
           "weight_bytes"]
