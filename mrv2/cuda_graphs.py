"""CUDA graphs for decode steps: capture sizes, padding, capture and replay.

A decode step of a small model is hundreds of tiny kernel launches: at batch 1
the CPU needs longer to *launch* them than the GPU needs to *run* them. A CUDA
graph records the launches once and replays them with one call. A graph replays
the exact kernels, arguments and addresses it recorded, so:

* every input lives in a static buffer (``InputBuffers``, ``BlockTables``) that the
  prep kernels rewrite each step — same addresses, new contents;
* the shapes are fixed per graph: a batch of ``num_reqs`` decodes is padded up to
  the next captured size (padding slots: ``seq_len`` 0, zeroed block-table rows,
  slot -1, so they compute nothing and write nothing);
* host-side numbers baked into launches (grids, ``max_seq_len``) use bounds.

Only uniform decode batches (one token per request) are captured; prefills, mixed
batches and batches larger than the largest size run eagerly. On the CPU this
module does nothing. See notebooks/08_model_state_and_cuda_graphs.ipynb.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def capture_sizes(max_num_reqs: int, max_size: int = 512) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, then multiples of 8 to 256, then steps of 16.

    Args:
        max_num_reqs: the most requests in one step (always captured when <= ``max_size``).
        max_size: the largest size to capture.

    Returns:
        Sorted sizes, none above ``min(max_num_reqs, max_size)``.
    """
    if max_num_reqs <= 0 or max_size <= 0:
        raise ValueError(f"max_num_reqs and max_size must be positive, got {max_num_reqs}, "
                         f"{max_size}")
    cap = min(max_num_reqs, max_size)
    sizes = [1, 2, 4] + list(range(8, 257, 8)) + list(range(272, cap + 1, 16))
    sizes = sorted({s for s in sizes if s <= cap} | {cap})
    return sizes


class CudaGraphManager:
    """Captured forward passes, one per batch size, sharing one memory pool.

    Args:
        sizes: batch sizes to capture (``capture_sizes``); empty disables graphs.
    """

    def __init__(self, sizes: list[int]):
        self.sizes = sorted(sizes)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None

    @property
    def enabled(self) -> bool:
        return bool(self.sizes)

    def padded_size(self, num_reqs: int, num_tokens: int) -> int | None:
        """The captured size for a step, or ``None`` when it must run eagerly.

        Args:
            num_reqs, num_tokens: the step's real requests and tokens.
        """
        if not self.graphs or num_tokens != num_reqs or num_reqs > self.sizes[-1]:
            return None  # not a uniform decode batch, or too large
        for size in self.sizes:
            if size >= num_reqs:
                return size
        return None

    def capture(self, prepare: Callable[[int], object], forward: Callable[[object, int], torch.Tensor],
                num_warmup: int = 2, progress: bool = False) -> None:
        """Capture ``forward(prepare(size), size)`` for every size, largest first.

        Args:
            prepare: writes an all-padding batch of ``size`` into the static buffers and
                returns it. It runs *outside* the capture: its host->device copies must
                not be recorded, or every replay would repeat them.
            forward: the forward pass over that batch, returning its output tensor.
            num_warmup: eager calls before capture (compiles kernels, sets up caches).
            progress: show a progress bar.
        """
        from tqdm.auto import tqdm

        self.pool = torch.cuda.graph_pool_handle()
        for size in tqdm(sorted(self.sizes, reverse=True), desc="Capturing CUDA graphs",
                         disable=not progress):
            batch = prepare(size)
            for _ in range(num_warmup):
                forward(batch, size)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                out = forward(batch, size)
            self.graphs[size] = (graph, out)
        torch.cuda.synchronize()

    def replay(self, size: int) -> torch.Tensor:
        """Replay the graph of ``size``; returns its (static) output tensor."""
        graph, out = self.graphs[size]
        graph.replay()
        return out
