"""CUDA graphs for decode, speculating decode and small prefill steps: sizes, padding, replay.

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

Three kinds of graphs share one memory pool:

* **decode graphs**, keyed by a batch size ``s``: ``s`` requests of one token each
  (attention launched with ``max_query_len = 1``);
* **prefill graphs**, keyed by ``(num_reqs, num_tokens)``: any batch of at most that
  many requests and tokens (prefills, chunks, decodes mixed in), with the attention
  grid sized for ``max_query_len = num_tokens``. Its programs beyond a request's real
  query exit at once, so the bound costs little while the grid stays small, which is
  why these graphs stop at a few thousand tokens and a few tens of requests. A prefill
  step of a short prompt is otherwise ~300 eager launches from Python (~14 ms on an
  H200 host for 128 tokens, the GPU idle in between): most of its time to first token.

* **speculating decode graphs**, keyed by ``(num_reqs, num_reqs * (1 + K), 1 + K)``:
  decodes of ``1 + K`` query tokens each (the last sampled token and K drafts, causal
  among themselves), attention launched with ``max_query_len = 1 + K``. They serve any
  batch of at most that many requests whose queries are no longer than ``1 + K`` (a
  request without drafts that step has one token); the padding is the decode graphs'.

Larger batches run eagerly. On the CPU this module does nothing, unless ``emulate``: then
``graph_for`` picks keys as if every graph were captured and ``run`` calls the eager
function on the very padded shapes and bounds a graph would replay (the CPU tests' proxy
for graph correctness). ``num_replays`` / ``num_eager`` count steps per kind of key
(``"decode"``, ``"spec"``, ``"prefill"``). A proposer with its own forward passes (the draft
model) uses a manager of its own: ``capture(prepare, forward)`` once, then
``run(key, eager)`` per step. See notebooks/08_model_state_and_cuda_graphs.ipynb and
09_speculative_decoding.ipynb.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import torch

#: A graph's key: a decode batch size, ``(num_reqs, num_tokens)`` of a prefill graph, or
#: ``(num_reqs, num_tokens, max_query_len)`` of a speculating decode graph.
GraphKey = int | tuple[int, int] | tuple[int, int, int]

#: Request and token counts of the prefill graphs (capped by the engine's limits).
PREFILL_REQ_SIZES = (1, 4, 16, 32)
PREFILL_TOKEN_SIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)


def graph_shape(key: GraphKey) -> tuple[int, int, int]:
    """``(num_reqs_padded, num_tokens_padded, max_query_len)`` a graph was captured with."""
    if isinstance(key, tuple):
        return (key[0], key[1], key[1]) if len(key) == 2 else key
    return key, key, 1


def graph_kind(key: GraphKey) -> str:
    """``"decode"``, ``"prefill"`` or ``"spec"``: the kind of graph a key names."""
    if not isinstance(key, tuple):
        return "decode"
    return "prefill" if len(key) == 2 else "spec"


def spec_capture_sizes(sizes: list[int], num_speculative_tokens: int,
                       max_num_tokens: int) -> list[tuple[int, int, int]]:
    """Keys of the speculating decode graphs: ``(s, s * (1 + K), 1 + K)`` per decode size.

    Args:
        sizes: the decode batch sizes (``capture_sizes``).
        num_speculative_tokens: K (0: no speculation, no keys).
        max_num_tokens: the token budget of one step (larger keys are dropped).
    """
    if num_speculative_tokens < 0:
        raise ValueError(f"num_speculative_tokens must be >= 0, got {num_speculative_tokens}")
    if num_speculative_tokens == 0:
        return []
    q = 1 + num_speculative_tokens
    return [(s, s * q, q) for s in sorted(sizes) if s * q <= max_num_tokens]


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
        spec_sizes: keys of the speculating decode graphs (``spec_capture_sizes``).
        emulate: capture nothing; answer as if every key were captured and run the eager
            function on the padded shapes instead of a replay (CPU tests of the padding).
    """

    def __init__(self, sizes: list[int], prefill_sizes: list[tuple[int, int]] = (),
                 spec_sizes: list[tuple[int, int, int]] = (), emulate: bool = False):
        self.sizes = sorted(sizes)
        self.prefill_sizes = sorted(prefill_sizes) if self.sizes else []
        self.spec_sizes = sorted(spec_sizes) if self.sizes else []
        self.emulate = emulate
        # graph_for's search order (every step): the fewest tokens, then the fewest requests.
        self._prefill_by_size = sorted(self.prefill_sizes, key=lambda k: (k[1], k[0]))
        self.graphs: dict[GraphKey, tuple[torch.cuda.CUDAGraph, object]] = {}
        self.pool = None
        self.num_replays: Counter[str] = Counter()  # graph_kind -> steps that replayed
        self.num_eager: Counter[str] = Counter()    # step kind -> steps that ran eagerly

    @property
    def enabled(self) -> bool:
        return bool(self.sizes)

    def _ready(self) -> bool:
        return self.emulate or bool(self.graphs)

    def _has(self, key: GraphKey) -> bool:
        return self.emulate or key in self.graphs

    def keys(self) -> list[GraphKey]:
        """Every key to capture, the most tokens first (the shared pool grows once)."""
        return sorted([*self.sizes, *self.prefill_sizes, *self.spec_sizes],
                      key=lambda k: graph_shape(k)[1::-1], reverse=True)

    def graph_for(self, num_reqs: int, num_tokens: int,
                  max_query_len: int | None = None) -> GraphKey | None:
        """The captured graph a step replays: a decode graph for a uniform decode batch, a
        speculating decode graph for decodes of at most ``1 + K`` tokens (``max_query_len``
        given), else the smallest prefill graph that holds it; ``None``: run eagerly."""
        key = self._lookup(num_reqs, num_tokens, max_query_len)
        if key is None:
            q = num_tokens if max_query_len is None else max_query_len
            spec_q = self.spec_sizes[0][2] if self.spec_sizes else 0
            self.num_eager["decode" if num_tokens == num_reqs
                           else "spec" if q <= spec_q else "prefill"] += 1
        return key

    def _lookup(self, num_reqs, num_tokens, max_query_len) -> GraphKey | None:
        size = self.padded_size(num_reqs, num_tokens)
        if size is not None or not self._ready():
            return size
        if max_query_len is not None:
            for key in self.spec_sizes:  # the fewest requests first
                if key[0] >= num_reqs and key[1] >= num_tokens and key[2] >= max_query_len:
                    return key if self._has(key) else None
        for key in self._prefill_by_size:
            if key[0] >= num_reqs and key[1] >= num_tokens:
                return key if self._has(key) else None
        return None

    def padded_size(self, num_reqs: int, num_tokens: int) -> int | None:
        """The captured size for a step, or ``None`` when it must run eagerly.

        Args:
            num_reqs, num_tokens: the step's real requests and tokens.
        """
        if not self._ready() or num_tokens != num_reqs or num_reqs > self.sizes[-1]:
            return None  # not a uniform decode batch, or too large
        for size in self.sizes:
            if size >= num_reqs:
                return size
        return None

    def capture(self, prepare: Callable[[GraphKey], object],
                forward: Callable[[object, GraphKey], object],
                num_warmup: int = 2, progress: bool = False) -> None:
        """Capture ``forward(prepare(key), key)`` for every key, largest first.

        Args:
            prepare: writes an all-padding batch of ``key``'s shape (``graph_shape``) into
                the static buffers and returns it. It runs *outside* the capture: its
                host->device copies must not be recorded, or every replay would repeat them.
            forward: the forward pass over that batch, returning its output tensor(s).
            num_warmup: eager calls before capture (compiles kernels, sets up caches).
            progress: show a progress bar.
        """
        if self.emulate:
            return  # nothing to record: run() calls the eager function
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

    def replay(self, size: GraphKey):
        """Replay the graph of ``size`` (a key); returns its (static) output."""
        graph, out = self.graphs[size]
        graph.replay()
        self.num_replays[graph_kind(size)] += 1
        return out

    def run(self, key: GraphKey, eager: Callable[[], object]):
        """Replay ``key``'s graph, or, when it was not captured, call ``eager()``: the same
        computation on the same padded shapes (counted as a replay under ``emulate``).

        NOTE: a replay's output lives in the shared pool: read it before the next replay.
        """
        if key in self.graphs:
            return self.replay(key)
        (self.num_replays if self.emulate else self.num_eager)[graph_kind(key)] += 1
        return eager()


def make_graph_manager(max_num_reqs: int, max_num_tokens: int, use_graphs: bool,
                       prefill_graphs: bool = True, num_speculative_tokens: int = 0,
                       emulate: bool = False) -> CudaGraphManager:
    """The V2 runner's manager: decode, prefill and speculating decode keys within limits.

    Args:
        max_num_reqs, max_num_tokens: the engine's step limits.
        use_graphs: capture at all (a CUDA device, graphs not disabled); else no keys.
        prefill_graphs: also the prefill / mixed graphs.
        num_speculative_tokens: K of speculative decoding (0: none).
        emulate: see ``CudaGraphManager``.
    """
    if not use_graphs:
        return CudaGraphManager([])
    sizes = capture_sizes(max_num_reqs)
    return CudaGraphManager(
        sizes, prefill_capture_sizes(max_num_reqs, max_num_tokens) if prefill_graphs else [],
        spec_capture_sizes(sizes, num_speculative_tokens, max_num_tokens), emulate=emulate)
