"""Split-K bookkeeping for the small-M fused GEMMs: how many K ranges, their launch, buffers.

At 3-32 decode rows a Qwen3-0.6B layer's products launch 64 (o_proj, down: N = 1024 at
block_n 16) to 192 column tiles on 132 SMs: a wave that leaves SMs idle while the weights
must stream from HBM. ``mrv2.kernels.small_m_fused`` can cut each tile's K into ranges, one
program each, which park fp32 partials; the tile's last program to arrive sums them in split
order (the same sum whatever the arrival order) and runs the epilogue. This module holds
the host side of that: the rule (``split_k_for``), the re-planned launch (``split_launch``)
and the partials / counters buffers (``split_buffers``). Shapes only: graph- and sync-safe.
"""

from __future__ import annotations

import torch

from mrv2.kernels.small_m_gemm import _SMEM_BYTES, NUM_SMS, _smem_bytes

#: The largest grid ``split_k_for`` grows a launch to: two programs an SM on the H200.
SPLIT_TARGET_PROGRAMS = 2 * NUM_SMS
#: The most splits of one tile (the last program's partial sums grow with it).
MAX_SPLIT_K = 8
# Per device: (fp32 partials, int32 tile counters, every earlier pair). Earlier pairs are
# kept alive: a captured CUDA graph still points at the buffers it was captured with.
_BUFFERS: dict = {}


def split_k_for(tiles: int, K: int) -> int:
    """How many K ranges a launch of ``tiles`` output tiles splits into: the most of 1, 2, 4,
    8 that keep the grid within ``SPLIT_TARGET_PROGRAMS`` programs, each range a multiple
    of 64 (at Qwen3-0.6B: o_proj and down 64 tiles -> 4 splits, qkv 128 -> 2). Shapes only:
    graph-safe."""
    split = 1
    while (split < MAX_SPLIT_K and tiles * split * 2 <= SPLIT_TARGET_PROGRAMS
           and K % (2 * split * 64) == 0):
        split *= 2
    return split


def split_launch(cfg: dict, programs: int, k_per: int, elem_bytes: int = 2,
                 w_tiles: int = 1) -> dict:
    """``cfg`` (``small_m_gemm._launch``'s) re-planned for a split launch of ``programs``
    programs, each over ``k_per`` of K: a K step of at most half the range (two steps to
    pipeline) dividing it, stages no more than the steps, then both shrunk until the tiles in
    flight of the programs one SM must hold fit its shared memory. ``w_tiles``: 2 for
    gate_up (two weight tiles a stage)."""
    per_sm = -(-programs // NUM_SMS)
    budget = _SMEM_BYTES // per_sm
    bm, bn = cfg["block_m"], cfg["block_n"]
    bk = cfg["block_k"]
    while bk > 16 and (k_per % bk or (bk > 64 and 2 * bk > k_per)):
        bk //= 2
    stages = max(2, min(cfg["num_stages"], k_per // bk))

    def smem():
        return _smem_bytes(bm, bn * w_tiles, bk, stages, elem_bytes)
    while stages > 2 and smem() > budget:
        stages -= 1
    while bk > 64 and smem() > budget:
        bk //= 2
    return {**cfg, "block_k": bk, "num_stages": stages}


def split_buffers(device: torch.device, numel: int, tiles: int):
    """The split-K partials (>= ``numel`` fp32) and tile counters (>= ``tiles``, all zero
    between launches: each tile's last program resets its own), or ``None`` when they must
    grow during a CUDA graph capture (the caller then launches without the split)."""
    parts, counts, kept = _BUFFERS.get(device, (None, None, []))
    if parts is not None and parts.numel() >= numel and counts.numel() >= tiles:
        return parts, counts
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    if parts is not None:
        kept.append((parts, counts))
    parts = torch.empty(max(numel, 2 * (parts.numel() if parts is not None else 0)),
                        dtype=torch.float32, device=device)
    counts = torch.zeros(max(tiles, 1024), dtype=torch.int32, device=device)
    _BUFFERS[device] = (parts, counts, kept)
    return parts, counts
