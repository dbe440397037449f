"""Top-k, top-p and min-p truncation in Triton, by threshold search instead of a sort.

Each filter keeps the tokens whose (temperature-scaled) logit ``s = x / T`` is at
least some threshold, and a token survives only if it passes all three, so what a
row needs is one number: the largest of the three thresholds. Nothing has to be
sorted to find it:

- top-k: the k-th largest ``s``: the smallest ``t`` with ``count(s > t) < k``.
- top-p: a token stays while the probability mass strictly above it is ``< top_p``:
  the smallest ``t`` with ``sum(exp(s - m), s > t) < top_p * Z`` (``m`` the row max,
  ``Z = sum(exp(s - m))``).
- min-p: ``p >= min_p * p_max``, a direct comparison once ``m`` and ``Z`` are known.

Both predicates are monotone in ``t``, so the threshold is found by search over the
*integer keys* of fp32 values (the bit pattern, with the low 31 bits flipped for
negatives, orders like the floats): it ends on an exact logit value after 32 bits,
``log2(NUM_PIVOTS)`` bits a round (16 pivots: 8 rounds).

The whole GPU works on every pass: a row is cut into ``CHUNK_V``-wide chunks and each
pass is a grid of (rows x chunks) programs, with a one-program-per-row kernel between
passes that reduces the per-chunk partials and narrows the row's bracket (the kernels
are in ``mrv2/kernels/top_k_top_p_chunked.py``):

1. ``_stats_kernel`` (rows x chunks): per chunk its max ``m_c``, smallest finite ``s``,
   ``sum(exp(s - m_c))`` and the maxima of its ``BLOCK_V``-wide blocks.
2. ``_init_kernel`` (rows): ``m``, ``Z = sum(z_c * exp(m_c - m))``, and the brackets
   (lo, key(m)]. lo starts at key(s_min) - 1 and is raised by bisection over the block
   maxima: if k of them (or ``top_p * Z`` of their mass) lie above ``t``, the row's
   predicate fails at ``t``. With both filters on, both searches start at the larger lo
   (only ``max(thresh_k, thresh_p)`` is used). For top-k <= the number of blocks, or a
   peaked top-p, that leaves a few dozen tokens inside the bracket. A search the maxima
   did not narrow gets round 0's pivots at log-probability gaps below ``m`` (64 down to
   1/4 nats) instead of uniform keys. Every round's pivots are stored beside the bracket.
3. ``_gather_kernel`` (rows x chunks) keeps the *candidates*, every key above lo, when
   each chunk has at most ``CAND_SLOTS`` of them; ``_finish_kernel`` (rows) then ends
   that row's searches by bisection over its candidates, in one program
   (``mrv2/kernels/top_k_top_p_cand.py``). A row that overflows goes on to step 4.
4. ``NUM_ROUNDS`` times: ``_count_kernel`` (rows x chunks) counts the tokens and sums
   ``exp(s - m)`` above each of the round's pivots, and finds the smallest / largest key inside each bracket; then
   ``_narrow_kernel`` (rows) keeps the pivot interval where each predicate flips, cut
   down to those keys (the answer is a key of the row, so a bracket holding one key has
   converged).
5. ``_write_kernel`` (rows x chunks): -inf over the removed logits, in place.

So at most NUM_ROUNDS + 3 reads of the logits and 2 * NUM_ROUNDS + 5 launches, fixed
grids and no host sync (CUDA-graph safe). A row whose brackets have converged (or that
is greedy, has every filter off, or uses min-p alone) exits its programs after reading
a few words, and a block of ``BLOCK_V`` logits with no key inside the bracket skips
the [BLOCK_V, NUM_PIVOTS] compares (it only adds what lies above the bracket): with a
tight bracket a round costs about one read of the logits. With top-k 20 / top-p 0.95
(T = 0.6, randn * 3 logits) every row ends on its candidates, and the filter reads the
logits three times: stats, gather, write.
The scratch is ``top_k_top_p_workspace``: pass one in, or let the dispatcher keep one
per (device, vocab, config), grown when a call has more rows (the sampler runs outside the
CUDA graphs, so the one-time growth is an ordinary allocation).
``mrv2/kernels/top_k_top_p_row.py`` holds the one-program-per-row version: the default
under TRITON_INTERPRET (fewer programs for the interpreter's Python loop), while the chunked
search is the default on the GPU. On the H200 at 256 x 151,936 (job 12E, 540a60f,
``scripts/bench_sampler.py --filter-only``, CUDA-graph replay) the chunked search took
0.38-1.9 ms in fp32 and 0.41-3.4 ms in bf16 (top-k 20 + top-p 0.95: 0.50 / 0.55 ms; top-p
alone is the slow end), the row kernel 4.7-5.5 / 8.2-8.8 ms and torch's sort 4.8 ms.
``Z`` sums per chunk, so top-p / min-p may differ from the row kernel by a token whose
mass sits within fp32 rounding of the edge.

Ties exactly at the threshold: every token tied with the threshold value is kept
(a sort keeps only those that happen to come first). The top token always stays.

See notebooks/05_gumbel_sampling.ipynb.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton

from mrv2.kernels.gumbel import GREEDY_TEMPERATURE
from mrv2.kernels.top_k_top_p_cand import _finish_kernel, _gather_kernel, cand_width
from mrv2.kernels.top_k_top_p_chunked import (
    _count_kernel,
    _init_kernel,
    _narrow_kernel,
    _stats_kernel,
    _write_kernel,
)
from mrv2.kernels.top_k_top_p_row import apply_top_k_top_p_min_p_row
from mrv2.platform import TRITON_INTERPRET


class TopKTopPWorkspace(NamedTuple):
    """Scratch of the chunked search, for up to ``bracket.shape[0]`` rows of one vocab."""

    bracket: torch.Tensor   # [R, 4 + 2P] int64: lo_k, hi_k, lo_p, hi_p, the pivots (keys)
    row_f: torch.Tensor     # [R, 2] float32: m, Z
    part: torch.Tensor      # [R, NC, W] float32: per chunk (see top_k_top_p_chunked.py)
    cand: torch.Tensor      # [R, NC, 1 + 2 * CAND_SLOTS] float32: candidates (top_k_top_p_cand)


#: Pivots per search round (the dispatcher's default; the reserved scratch is sized for it).
NUM_PIVOTS = 16
#: Candidate slots per chunk: the gather pass keeps up to this many keys above lo.
CAND_SLOTS = 32
#: Logits per step of the gather pass's slot assignment (a power of two).
GATHER_SUB_V = 1024


def _chunked_config(vocab_size: int, block_v: int | None, chunk_v: int | None,
                    num_pivots: int) -> tuple[int, int, int]:
    """(block_v, chunk_v, num_chunks) for a vocab, after checking the overrides."""
    if num_pivots < 2 or num_pivots & (num_pivots - 1):
        raise ValueError(f"num_pivots must be a power of two >= 2, got {num_pivots}")
    v2 = triton.next_power_of_2(max(vocab_size, 16))
    if block_v is None:
        block_v = min(4096 if TRITON_INTERPRET else 256, v2)
    if chunk_v is None:
        chunk_v = max(block_v, min(4096, v2))
    for name, val in (("block_v", block_v), ("chunk_v", chunk_v)):
        if val < 16 or val & (val - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {val}")
    if chunk_v % block_v:
        raise ValueError(f"chunk_v ({chunk_v}) must be a multiple of block_v ({block_v})")
    return block_v, chunk_v, triton.cdiv(vocab_size, chunk_v)


def _part_width(block_v: int, chunk_v: int, num_pivots: int) -> int:
    # A round's counts | masses | 4 bracket ends, or the stats pass's block maxima; then
    # Z's part, max, min.
    return max(2 * num_pivots + 4, chunk_v // block_v) + 3


def top_k_top_p_workspace(num_rows: int, vocab_size: int, device, *,
                          block_v: int | None = None, chunk_v: int | None = None,
                          num_pivots: int = NUM_PIVOTS) -> TopKTopPWorkspace:
    """Allocate the chunked search's scratch once (e.g. for ``max_num_reqs`` rows).

    Args:
        num_rows: the most rows a call will pass.
        vocab_size: the logits' last dim.
        device: where the logits live.
        block_v, chunk_v, num_pivots: the same overrides the calls will pass.

    Returns:
        A ``TopKTopPWorkspace`` for ``apply_top_k_top_p_min_p(..., workspace=)``.
    """
    block_v, chunk_v, num_chunks = _chunked_config(vocab_size, block_v, chunk_v, num_pivots)
    return TopKTopPWorkspace(
        torch.empty(num_rows, 4 + 2 * num_pivots, dtype=torch.int64, device=device),
        torch.empty(num_rows, 2, dtype=torch.float32, device=device),
        torch.empty(num_rows, num_chunks, _part_width(block_v, chunk_v, num_pivots),
                    dtype=torch.float32, device=device),
        torch.empty(num_rows, num_chunks, cand_width(CAND_SLOTS), dtype=torch.float32,
                    device=device))


_WORKSPACES: dict[tuple, TopKTopPWorkspace] = {}


def _cached_workspace(num_rows: int, vocab_size: int, device, block_v: int, chunk_v: int,
                      num_pivots: int) -> TopKTopPWorkspace:
    """The dispatcher's own scratch for one (device, vocab, config), grown to >= num_rows."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        # NOTE: "cuda" and "cuda:0" are unequal keys: the runner's device is often the first,
        # a tensor's always the second (job U: reserve and use made two workspaces).
        device = torch.device("cuda", torch.cuda.current_device())
    key = (device, vocab_size, block_v, chunk_v, num_pivots)
    ws = _WORKSPACES.get(key)
    if ws is None or ws.bracket.shape[0] < num_rows:
        rows = max(num_rows, 2 * ws.bracket.shape[0] if ws is not None else 0)
        ws = _WORKSPACES[key] = top_k_top_p_workspace(rows, vocab_size, device,
                                                      block_v=block_v, chunk_v=chunk_v,
                                                      num_pivots=num_pivots)
    return ws


def reserve_top_k_top_p_workspace(num_rows: int, vocab_size: int, device) -> None:
    """Grow the dispatcher's own scratch to ``num_rows`` now, at start-up.

    The runner calls this once with its most sampled rows, so no step allocates (the
    cache otherwise grows on the first call with more rows: memory that appears mid-run).
    A no-op off the GPU, where the row method needs no scratch.

    Args:
        num_rows: the most logits rows one call will pass (e.g. ``max_num_reqs * (1 + K)``).
        vocab_size: the logits' last dim.
        device: where the logits will live.
    """
    if TRITON_INTERPRET or torch.device(device).type != "cuda" or num_rows <= 0:
        return
    block_v, chunk_v, _ = _chunked_config(vocab_size, None, None, NUM_PIVOTS)
    _cached_workspace(num_rows, vocab_size, device, block_v, chunk_v, NUM_PIVOTS)


def apply_top_k_top_p_min_p(logits: torch.Tensor, idx_mapping: torch.Tensor,
                            temperature: torch.Tensor, top_k: torch.Tensor,
                            top_p: torch.Tensor, min_p: torch.Tensor, *,
                            block_v: int | None = None, num_pivots: int = NUM_PIVOTS,
                            num_warps: int | None = None, chunk_v: int | None = None,
                            workspace: TopKTopPWorkspace | None = None,
                            method: str | None = None) -> torch.Tensor:
    """Write -inf, in place, over the logits that top-k / top-p / min-p remove.

    Probabilities are those of ``logits / temperature``; greedy rows (temperature
    < 1e-5) and rows with every filter off are left untouched. No CPU sync.

    Args:
        logits: ``[B, V]`` float32 (or bfloat16 on the GPU), last dim contiguous; modified.
        idx_mapping: ``[B]`` int32 batch slot -> state-table row.
        temperature: ``[R]`` float32.
        top_k: ``[R]`` int32 (<= 0 or >= V: off).
        top_p: ``[R]`` float32 (>= 1: off; the top token always stays).
        min_p: ``[R]`` float32 (<= 0: off).
        block_v, num_pivots, num_warps: launch overrides.
        chunk_v: logits per program of the chunked search (a multiple of block_v).
        workspace: scratch from ``top_k_top_p_workspace`` (else the dispatcher's own, kept
            per device, vocab and config and grown to the rows).
        method: ``"chunked"`` (rows x chunks programs, 21 launches on fixed grids: the
            default on the GPU) or ``"row"`` (one program per row, one launch: the default
            under TRITON_INTERPRET).

    Returns:
        ``logits`` itself.
    """
    if method is None:
        method = "row" if TRITON_INTERPRET else "chunked"
    if method not in ("chunked", "row"):
        raise ValueError(f"method must be 'chunked' or 'row', got {method!r}")
    num_rows, vocab_size = logits.shape
    if num_rows == 0 or vocab_size == 0:
        return logits
    if logits.stride(1) != 1:
        raise ValueError("apply_top_k_top_p_min_p works in place and needs logits with a "
                         f"contiguous last dim, got strides {tuple(logits.stride())}")
    if method == "row":
        return apply_top_k_top_p_min_p_row(logits, idx_mapping, temperature, top_k, top_p,
                                           min_p, block_v=block_v, num_pivots=num_pivots,
                                           num_warps=num_warps)
    block_v, chunk_v, num_chunks = _chunked_config(vocab_size, block_v, chunk_v, num_pivots)
    width = _part_width(block_v, chunk_v, num_pivots)
    if workspace is None:
        workspace = _cached_workspace(num_rows, vocab_size, logits.device, block_v, chunk_v,
                                      num_pivots)
    bracket, row_f, part, cand = workspace
    if (bracket.shape[0] < num_rows or row_f.shape[0] < num_rows
            or bracket.shape[1] != 4 + 2 * num_pivots
            or part.shape[0] < num_rows or tuple(part.shape[1:]) != (num_chunks, width)
            or cand.shape[0] < num_rows
            or tuple(cand.shape[1:]) != (num_chunks, cand_width(CAND_SLOTS))):
        raise ValueError(f"workspace has part {tuple(part.shape)}, cand {tuple(cand.shape)} "
                         f"for {bracket.shape[0]} rows; this call needs >= {num_rows} rows "
                         f"of ({num_chunks}, {width}) and ({num_chunks}, "
                         f"{cand_width(CAND_SLOTS)})")
    # The key range spans at most 2**32 values; each round divides it by num_pivots.
    num_rounds = -(-32 // (num_pivots.bit_length() - 1))
    nc_pow2 = triton.next_power_of_2(num_chunks)
    knobs = (idx_mapping, temperature, top_k, top_p, min_p)
    grid = (num_rows, num_chunks)
    opts = {} if TRITON_INTERPRET else {"num_warps": num_warps or 8}
    one = {} if TRITON_INTERPRET else {"num_warps": 4}
    _stats_kernel[grid](logits, *knobs, part, vocab_size, num_chunks, logits.stride(0),
                        part.stride(1), CHUNK_V=chunk_v, BLOCK_V=block_v,
                        PART_STATS=width - 3, **opts)
    _init_kernel[(num_rows,)](*knobs, part, bracket, row_f, cand, vocab_size, num_chunks,
                              part.stride(1), cand.stride(1), NC_POW2=nc_pow2,
                              NB=chunk_v // block_v, PART_STATS=width - 3,
                              NUM_PIVOTS=num_pivots, SLOTS=CAND_SLOTS, **one)
    _gather_kernel[grid](logits, *knobs, bracket, cand, vocab_size, num_chunks,
                         logits.stride(0), cand.stride(1), CHUNK_V=chunk_v,
                         SUB_V=min(chunk_v, GATHER_SUB_V), NUM_PIVOTS=num_pivots, SLOTS=CAND_SLOTS,
                         **opts)
    _finish_kernel[(num_rows,)](*knobs, cand, bracket, row_f, vocab_size, num_chunks,
                                cand.stride(1), NC_POW2=nc_pow2, NUM_PIVOTS=num_pivots,
                                SLOTS=CAND_SLOTS,
                                SLOTS_POW2=triton.next_power_of_2(CAND_SLOTS), **one)
    # NOTE: a program per chunk even in the rounds most rows now skip: H200 job 12D timed
    # 1 / 2 / 4 chunks a program (graph replay): top-k 20 + top-p 0.95 fp32 565 / 544 / 513
    # us (bf16 589 / 535 / 505), but top-p 0.95 alone 1,239 / 1,471 / 1,442 (bf16 1,987 /
    # 2,152 / 2,154): the rows that take the rounds pay more than the others save.
    for _ in range(num_rounds):
        _count_kernel[grid](logits, *knobs, bracket, row_f, part, vocab_size, num_chunks,
                            logits.stride(0), part.stride(1), CHUNK_V=chunk_v,
                            BLOCK_V=block_v, NUM_PIVOTS=num_pivots, **opts)
        _narrow_kernel[(num_rows,)](*knobs, part, bracket, row_f, vocab_size, num_chunks,
                                    part.stride(1), NC_POW2=nc_pow2, NUM_PIVOTS=num_pivots,
                                    **one)
    _write_kernel[grid](logits, *knobs, bracket, row_f, vocab_size, logits.stride(0),
                        CHUNK_V=chunk_v, NUM_PIVOTS=num_pivots, **opts)
    return logits


def apply_top_k_top_p_min_p_ref(logits: torch.Tensor, idx_mapping: torch.Tensor,
                                temperature: torch.Tensor, top_k: torch.Tensor,
                                top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """The sort-based torch reference (``top_k_top_p_min_p_sorted``), through ``idx_mapping``.

    Same arguments as ``apply_top_k_top_p_min_p``; returns a new tensor.
    """
    req = idx_mapping.to(torch.int64)
    temp = temperature[req]                                                   # [B]
    greedy = temp < GREEDY_TEMPERATURE
    scaled = logits.to(torch.float32) / torch.where(greedy, 1.0, temp)[:, None]  # [B, V]
    # NOTE: top_p = 1 must be off; in the sorted reference the fp32 cumsum can reach 1.0
    # before the last token and drop it, so pass a top_p it can never reach.
    p = torch.where(top_p[req] >= 1.0, 2.0, top_p[req])
    masked = top_k_top_p_min_p_sorted(scaled, top_k[req], p, min_p[req])
    drop = (masked == float("-inf")) & ~greedy[:, None]
    return logits.masked_fill(drop, float("-inf"))


def top_k_top_p_min_p_sorted(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                            min_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) the tokens top-k / top-p / min-p remove, per row, by sorting.

    The plain executable specification, one knob value per row (no ``idx_mapping``).

    Args:
        logits: ``[B, V]`` float32, already divided by the temperature.
        top_k: ``[B]`` int (<= 0: off); top_p: ``[B]`` float (1: off); min_p: ``[B]`` (0: off).

    Returns:
        A new ``[B, V]`` tensor with the removed logits at -inf.
    """
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [B, V]
    probs = sorted_logits.softmax(dim=-1)  # [B, V]
    rank = torch.arange(vocab, device=logits.device)[None, :]  # [1, V]
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)[:, None]  # [B, 1]
    drop = rank >= k
    # top-p: keep a token while the mass strictly before it is < top_p (the top token always stays).
    mass_before = probs.cumsum(dim=-1) - probs  # [B, V]
    # NOTE: top_p == 1 must keep everything, even where the fp32 cumsum reaches 1 early.
    drop |= (mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0)
    drop |= probs < min_p[:, None] * probs[:, :1]
    drop[:, 0] = False
    masked = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, masked)
