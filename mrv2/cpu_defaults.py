"""CPU defaults: how many intra-op threads, and how large a KV pool, when there is no GPU.

On the CPU the package runs tiny kernels through Triton's interpreter and small
matrix products in torch. Splitting a 256-wide product over threads costs more
than it saves, so the intra-op thread count follows the model's size (one thread
per ~25 M parameters, at most the cores). The KV pool is sized from a memory
budget, as vLLM's CPU backend does with ``VLLM_CPU_KVCACHE_SPACE`` (GiB), instead of
``max_num_seqs x max_model_len`` tokens, which for the embedded model is 1 GiB.

Overrides, first match wins:
- threads: ``MRV2_CPU_NUM_THREADS``, then ``OMP_NUM_THREADS`` (torch already obeys it);
  ``torch.set_num_threads`` after ``LLM()`` also wins.
- KV pool: ``LLM(kv_cache_memory_bytes=...)`` or ``num_gpu_blocks_override``, then
  ``VLLM_CPU_KVCACHE_SPACE`` (GiB, as vLLM), then the default below.
"""

from __future__ import annotations

import os

import torch

PARAMS_PER_THREAD = 25_000_000
#: Default CPU KV budget, at least one ``max_model_len`` sequence, at most ``MAX_CPU_KV_BYTES``.
DEFAULT_CPU_KV_BYTES = 128 << 20
MAX_CPU_KV_BYTES = 2 << 30


def _env_int(name: str) -> int | None:
    value = os.environ.get(name, "").strip()
    if not value:
        return None
    try:
        n = int(value)
    except ValueError:
        raise ValueError(f"{name} must be a positive integer, got {value!r}") from None
    if n < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return n


def choose_num_threads(num_params: int, num_cores: int | None = None) -> int:
    """Intra-op threads for a model of ``num_params`` parameters on the CPU.

    Args:
        num_params: the model's parameter count.
        num_cores: cores available (default: those this process may run on).

    Returns:
        A thread count in ``[1, num_cores]``.
    """
    if num_cores is None:
        num_cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
            os.cpu_count() or 1)
    return max(1, min(num_cores, num_params // PARAMS_PER_THREAD))


def apply_cpu_threads(model: torch.nn.Module) -> int | None:
    """Set torch's intra-op threads for ``model`` unless the user chose a count.

    Args:
        model: the loaded model.

    Returns:
        The count set, or ``None`` when an environment variable decides.
    """
    n = _env_int("MRV2_CPU_NUM_THREADS")
    if n is None and os.environ.get("OMP_NUM_THREADS"):
        return None
    if n is None:
        n = choose_num_threads(sum(p.numel() for p in model.parameters()))
    torch.set_num_threads(n)
    return n


def cpu_kv_budget_bytes(kv_cache_memory_bytes: int | None, bytes_per_token: int,
                        max_model_len: int) -> int:
    """Bytes of host memory for the KV pool.

    Args:
        kv_cache_memory_bytes: the ``LLM`` argument (``None``: not given).
        bytes_per_token: KV bytes of one token over all layers.
        max_model_len: the longest sequence (the default budget holds at least one).

    Returns:
        The budget in bytes.
    """
    if kv_cache_memory_bytes is not None:
        return kv_cache_memory_bytes
    space = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "").strip()
    if space and space != "0":  # NOTE: vLLM reads 0 as "the default"
        try:
            gib = float(space)
        except ValueError:
            raise ValueError(f"VLLM_CPU_KVCACHE_SPACE must be a number of GiB, got "
                             f"{space!r}") from None
        if gib <= 0:
            raise ValueError(f"VLLM_CPU_KVCACHE_SPACE must be > 0 GiB, got {space!r}")
        return int(gib * (1 << 30))
    return min(MAX_CPU_KV_BYTES, max(DEFAULT_CPU_KV_BYTES, bytes_per_token * max_model_len))
