"""CUDA graphs for decode and small prefill steps: capture sizes, padding, capture and replay.

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

Two kinds of graphs share one memory pool:

* **decode graphs**, keyed by a batch size ``s``: ``s`` requests of one token each
  (attention launched with ``max_query_len = 1``);
* **prefill graphs**, keyed by ``(num_reqs, num_tokens)``: any batch of at most that
  many requests and tokens (prefills, chunks, decodes mixed in), with the attention
  grid sized for ``max_query_len = num_tokens``. Its programs beyond a request's real
  query exit at once, so the bound costs little while the grid stays small, which is
  why these graphs stop at a few thousand tokens and a few tens of requests. A prefill
  step of a short prompt is otherwise ~300 eager launches from Python (~14 ms on an
  H200 host for 128 tokens, the GPU idle in between): most of its time to first token.

Larger batches run eagerly. On the CPU this module does nothing. See
notebooks/08_model_state_and_cuda_graphs.ipynb.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

#: A graph's key: a decode batch size, or ``(num_reqs, num_tokens)`` of a prefill graph.
GraphKey = int | tuple[int, int]

#: Request and token counts of the prefill graphs (capped by the engine's limits).
PREFILL_REQ_SIZES = (1, 4, 16, 32)
PREFILL_TOKEN_SIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)


def graph_shape(key: GraphKey) -> tuple[int, int, int]:
    """``(num_reqs_padded, num_tokens_padded, max_query_len)`` a graph was captured with."""
    if isinstance(key, tuple):
        return key[0], key[1], key[1]
    return key, key, 1


def prefill_capture_sizes(max_num_reqs: int, max_num_tokens: int) -> list[tuple[int, int]]:
    """``(num_reqs, num_tokens)`` pairs of the prefill graphs.

    Requests from ``PREFILL_REQ_SIZES`` and tokens from ``PREFILL_TOKEN_SIZES``, each list
    capped by the engine's limit (the limit itself added when it falls below the largest
    size), pairs with no more requests than tokens.

    Args:
        max_num_reqs: the most requests in one step.
        max_num_tokens: the token budget of one step.
    """
    if max_num_reqs <= 0 or max_num_tokens <= 0:
        raise ValueError(f"max_num_reqs and max_num_tokens must be positive, got {max_num_reqs}, "
                         f"{max_num_tokens}")

    def capped(sizes, limit):
        cap = min(limit, sizes[-1])
        return sorted({s for s in sizes if s <= cap} | {cap})

    return [(r, t) for t in capped(PREFILL_TOKEN_SIZES, max_num_tokens)
            for r in capped(PREFILL_REQ_SIZES, max_num_reqs) if r <= t]


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
    """Captured forward passes, one per key, sharing one memory pool.

    Args:
        sizes: decode batch sizes to capture (``capture_sizes``); empty disables graphs.
        prefill_sizes: ``(num_reqs, num_tokens)`` of the prefill graphs
            (``prefill_capture_sizes``); empty: prefills run eagerly.
    """

    def __init__(self, sizes: list[int], prefill_sizes: list[tuple[int, int]] = ()):
        self.sizes = sorted(sizes)
        self.prefill_sizes = sorted(prefill_sizes) if self.sizes else []
        # graph_for's search order (every step): the fewest tokens, then the fewest requests.
        self._prefill_by_size = sorted(self.prefill_sizes, key=lambda k: (k[1], k[0]))
        self.graphs: dict[GraphKey, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None

    @property
    def enabled(self) -> bool:
        return bool(self.sizes)

    def keys(self) -> list[GraphKey]:
        """Every key to capture, the most tokens first (the shared pool grows once)."""
        return sorted([*self.sizes, *self.prefill_sizes],
                      key=lambda k: graph_shape(k)[1::-1], reverse=True)

    def graph_for(self, num_reqs: int, num_tokens: int) -> GraphKey | None:
        """The captured graph a step replays: a decode graph for a uniform decode batch,
        else the smallest prefill graph that holds it; ``None``: run eagerly."""
        size = self.padded_size(num_reqs, num_tokens)
        if size is not None or not self.graphs:
            return size
        for key in self._prefill_by_size:
            if key[0] >= num_reqs and key[1] >= num_tokens:
                return key if key in self.graphs else None
        return None

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

    def capture(self, prepare: Callable[[GraphKey], object],
                forward: Callable[[object, GraphKey], torch.Tensor],
                num_warmup: int = 2, progress: bool = False) -> None:
        """Capture ``forward(prepare(key), key)`` for every key, largest first.

        Args:
            prepare: writes an all-padding batch of ``key``'s shape (``graph_shape``) into
                the static buffers and returns it. It runs *outside* the capture: its
                host->device copies must not be recorded, or every replay would repeat them.
            forward: the forward pass over that batch, returning its output tensor.
            num_warmup: eager calls before capture (compiles kernels, sets up caches).
            progress: show a progress bar.
        """
        from tqdm.auto import tqdm

        self.pool = torch.cuda.graph_pool_handle()
        for size in tqdm(self.keys(), desc="Capturing CUDA graphs", disable=not progress):
            batch = prepare(size)
            for _ in range(num_warmup):
                forward(batch, size)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                out = forward(batch, size)
            self.graphs[size] = (graph, out)
        torch.cuda.synchronize()

    def replay(self, size: GraphKey) -> torch.Tensor:
        """Replay the graph of ``size`` (a key); returns its (static) output tensor."""
        graph, out = self.graphs[size]
        graph.replay()
        return out
