"""The decode-attention launch table: (batch, context, KV heads) -> splits, block, warps, stages.

A decode step's attention is memory-bound, and the launch that reads the KV cache fastest
depends on the shape: few requests need their sequences split over several programs
(flash-decoding) to fill the GPU, many do not. ``scripts/sweep_decode_attention.py``
times the kernel over a grid of batch sizes and contexts on a GPU and writes the best
launch of each grid point to ``mrv2/assets/attention_decode_table.json``; this module
reads that table and picks the entry of a launch's shape. Pure Python on host ints (no
tensor is read), so a choice costs nothing and is the same at CUDA graph capture and
replay. Until a sweep is committed, the table holds what the hand-written heuristic
(``heuristic_decode_config``) chooses at each grid point on an H200 (132 SMs).

A table is used only on a GPU with the SM count it was measured on; elsewhere the
heuristic decides. An entry may also carry ``kv_fold``: that many KV heads of a request in
one program (``fold_rows`` sizes its query rows), swept with ``--fold``.
"""

from __future__ import annotations

import bisect
import functools
import json
import pathlib

TABLE_PATH = pathlib.Path(__file__).resolve().parents[1] / "assets" / "attention_decode_table.json"
#: The grid a sweep measures (and the default table covers).
GRID_BATCH = (1, 2, 4, 8, 16, 32, 64, 128, 256)
GRID_CONTEXT = (128, 256, 512, 1024, 2048, 4096)
#: What a table entry (and a decode launch) sets; an entry may add ``kv_fold``.
LAUNCH_KEYS = ("num_splits", "block_n", "num_warps", "num_stages")
#: tl.dot's smallest M: a decode program's rows (query tokens x folded KV heads x GQA group).
MIN_ROWS = 16


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def heuristic_decode_config(num_reqs: int, max_seq_len: int, num_kv_heads: int,
                            num_sms: int, max_query_len: int = 1, block_q: int = 1) -> dict:
    """The hand-written decode launch (measured on an H200 with scripts/bench_attention.py).

    Args:
        num_reqs, max_seq_len, num_kv_heads: the launch's shape.
        num_sms: the GPU's multiprocessor count.
        max_query_len, block_q: query tokens per request and per program.

    Returns:
        ``{"num_splits", "block_n", "num_warps", "num_stages"}``.
    """
    programs = num_reqs * _cdiv(max_query_len, block_q) * num_kv_heads
    # H200: 2 warps and a 3-4 stage pipeline beat 4/2 by ~10% at 64-256 requests.
    cfg = {"num_splits": 1, "block_n": 64, "num_warps": 2,
           "num_stages": 4 if programs <= 512 else 3}
    if programs < num_sms:
        # Flash-decoding: too few programs to fill the GPU, so split each sequence,
        # but only into parts of >= 512 keys (shorter parts lose to the merge pass).
        want = _cdiv(8 * num_sms, programs)
        cfg["num_splits"] = max(1, min(want, max_seq_len // 512, 32))
        if cfg["num_splits"] > 1:  # the split launch was measured with 4 warps, 2 stages
            cfg.update(num_warps=4, num_stages=2)
    return cfg


def default_table(num_sms: int = 132, num_kv_heads: int = 8) -> dict:
    """The heuristic at every grid point, in the table's format (what is committed first)."""
    entries = [{"batch": b, "context": c,
                **heuristic_decode_config(b, c, num_kv_heads, num_sms)}
               for b in GRID_BATCH for c in GRID_CONTEXT]
    return {"source": "heuristic_decode_config (no sweep yet)", "num_sms": num_sms,
            "num_kv_heads": num_kv_heads, "entries": entries}


def validate_table(table: dict) -> dict:
    """Check a table's fields; returns it. Raises ValueError naming the bad field."""
    for field in ("num_sms", "num_kv_heads", "entries"):
        if field not in table:
            raise ValueError(f"attention table: missing field {field!r}")
    for i, e in enumerate(table["entries"]):
        for field in ("batch", "context", *LAUNCH_KEYS):
            if not isinstance(e.get(field), int) or e[field] < 1:
                raise ValueError(f"attention table: entries[{i}].{field} must be a positive "
                                 f"int, got {e.get(field)!r}")
        if e["block_n"] & (e["block_n"] - 1) or e["block_n"] < 16:
            raise ValueError(f"attention table: entries[{i}].block_n must be a power of two "
                             f">= 16, got {e['block_n']}")
        fold = e.get("kv_fold", 1)
        if not isinstance(fold, int) or fold < 1 or fold & (fold - 1):
            raise ValueError(f"attention table: entries[{i}].kv_fold must be a power of two "
                             f">= 1, got {fold!r}")
    return table


@functools.lru_cache(maxsize=4)
def load_table(path: str | None = None) -> dict | None:
    """The committed table (``None`` when the file is absent)."""
    p = pathlib.Path(path) if path else TABLE_PATH
    if not p.exists():
        return None
    return validate_table(json.loads(p.read_text()))


def choose_decode_config(num_reqs: int, max_seq_len: int, num_kv_heads: int,
                         table: dict) -> dict:
    """The table's launch for a decode batch (pure Python, host ints).

    The batch is taken in units of the table's KV heads (programs = requests x KV heads,
    so 64 requests of 4 KV heads use the entry of 32 requests of 8), then the grid point
    at or below it in batch and context (the smallest one below the grid). The split
    count is capped so every split gets at least one key tile.

    Args:
        num_reqs: requests in the launch (>= 1).
        max_seq_len: the longest request's context (>= 1).
        num_kv_heads: KV heads of the model.
        table: a table as ``load_table`` returns it.

    Returns:
        ``{"num_splits", "block_n", "num_warps", "num_stages"}``, and ``kv_fold`` when the
        entry has one (capped at the largest power of two dividing ``num_kv_heads``).
    """
    entries = {(e["batch"], e["context"]): e for e in table["entries"]}
    batches = sorted({b for b, _ in entries})
    contexts = sorted({c for _, c in entries})
    eff = max(1, num_reqs * num_kv_heads // table["num_kv_heads"])
    b = batches[max(0, bisect.bisect_right(batches, eff) - 1)]
    c = contexts[max(0, bisect.bisect_right(contexts, max(1, max_seq_len)) - 1)]
    e = entries.get((b, c))
    if e is None:  # a sparse table: the nearest entry in log distance
        import math
        b, c = min(entries, key=lambda k: abs(math.log2(k[0] / eff))
                   + abs(math.log2(k[1] / max(1, max_seq_len))))
        e = entries[(b, c)]
    cfg = {k: e[k] for k in LAUNCH_KEYS}
    cfg["num_splits"] = max(1, min(cfg["num_splits"], _cdiv(max_seq_len, cfg["block_n"])))
    if "kv_fold" in e:
        cfg["kv_fold"] = min(e["kv_fold"], num_kv_heads & -num_kv_heads)
    return cfg


def decode_block_q(max_query_len: int, group_pad: int, kv_fold: int = 1) -> int:
    """Query tokens a decode program takes (``max_query_len <= 16``): the step's query length
    rounded up to a power of two, and at least enough that ``block_q * kv_fold * group_pad``
    gives ``tl.dot`` its ``MIN_ROWS`` rows."""
    q_pow2 = 1 << max(0, max_query_len - 1).bit_length()          # next power of two
    return max(q_pow2, MIN_ROWS // (group_pad * kv_fold), 1)


def fold_rows(cfg: dict, max_query_len: int, group_pad: int, num_kv_heads: int,
              refit: bool = True) -> dict:
    """``cfg`` (a decode launch, ``max_query_len <= 16``) with ``block_q`` sized for its
    ``kv_fold``, in place (``decode_block_q``), so a fold of 8 KV heads with a GQA group of 2
    takes one token (16 rows, all real) where one KV head takes 8 (2 real).

    Why fold: a decode program per (request, KV head) reads one head's 256-byte slice of
    each cached token and repeats the request's metadata and page numbers per head; a
    program of ``kv_fold`` heads reads ``kv_fold`` slices side by side (one contiguous run
    per token with the cache's [page, token, head, dim] layout) and the metadata once. The
    query is block-diagonal over the folded heads (``attention.py``), so the scores stay
    exact per head; P @ V computes every folded head's columns for every row and stores
    only a row's own (``kv_fold`` times the MMA work of a memory-bound kernel). With
    ``refit`` False (a caller's own ``block_q``) it only checks the fold.

    Raises:
        ValueError: ``kv_fold`` is not a power of two dividing ``num_kv_heads``.
    """
    fold = cfg.get("kv_fold", 1)
    if fold < 1 or fold & (fold - 1) or num_kv_heads % fold:
        raise ValueError(f"kv_fold {fold} must be a power of two dividing num_kv_heads "
                         f"({num_kv_heads})")
    if refit and fold > 1 and max_query_len <= 16:
        cfg["block_q"] = decode_block_q(max_query_len, group_pad, fold)
    return cfg
