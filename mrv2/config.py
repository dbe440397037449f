"""Configuration dataclasses: each rejects a bad value when it is built.

``CacheConfig`` sizes the paged KV cache, ``SchedulerConfig`` bounds a step
(requests and tokens), and ``RunnerConfig`` gathers what the runner needs.
"""

from __future__ import annotations

from dataclasses import dataclass


def _positive(name: str, value: int | None, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass(slots=True, frozen=True)
class CacheConfig:
    """The paged KV cache.

    Args:
        block_size: tokens per KV block (a power of two).
        num_gpu_blocks: blocks in the pool; ``None`` sizes the pool from free memory.
        gpu_memory_utilization: fraction of device memory mrv2 may use (GPU only).
    """

    block_size: int = 16
    num_gpu_blocks: int | None = None
    gpu_memory_utilization: float = 0.9

    def __post_init__(self):
        _positive("block_size", self.block_size)
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        _positive("num_gpu_blocks", self.num_gpu_blocks, allow_none=True)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1], "
                             f"got {self.gpu_memory_utilization}")


@dataclass(slots=True, frozen=True)
class SchedulerConfig:
    """What one step may hold.

    Args:
        max_num_seqs: requests in one step (and rows of the state table).
        max_num_batched_tokens: the token budget of one step (chunked prefill
            splits prompts that do not fit).
        max_model_len: the longest sequence (prompt + output) a request may reach.
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 4096

    def __post_init__(self):
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive("max_model_len", self.max_model_len)
