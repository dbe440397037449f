"""The KV block pool: which fixed-size blocks of the paged KV cache each request owns.

The cache is ``num_blocks`` blocks of ``block_size`` token slots per layer. A
request holds ``ceil(num_tokens / block_size)`` blocks, taken from a free list as
it grows and all given back when it finishes or is preempted. The block ids go to
the runner's per-row block tables (``block_table.py``). See
notebooks/01_qwen3_and_paged_kv.ipynb.
"""

from __future__ import annotations

from collections import deque


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Hands out KV blocks to requests.

    Args:
        num_blocks: blocks in the pool.
        block_size: token slots per block.
    """

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_blocks: deque[int] = deque(range(num_blocks))
        self.req_blocks: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def blocks_needed(self, req_id: str, num_tokens: int) -> int:
        """Extra blocks ``req_id`` needs so that ``num_tokens`` tokens fit."""
        have = len(self.req_blocks.get(req_id, ()))
        return max(0, cdiv(num_tokens, self.block_size) - have)

    def allocate(self, req_id: str, num_tokens: int) -> list[int] | None:
        """Grow ``req_id`` to hold ``num_tokens`` tokens.

        Returns:
            The newly allocated block ids (possibly empty), or ``None`` when the
            pool has too few free blocks (nothing is allocated then).
        """
        need = self.blocks_needed(req_id, num_tokens)
        if need > len(self.free_blocks):
            return None
        new = [self.free_blocks.popleft() for _ in range(need)]
        self.req_blocks.setdefault(req_id, []).extend(new)
        return new

    def free(self, req_id: str) -> None:
        """Give back every block of ``req_id`` (no-op if it holds none)."""
        # NOTE: freed blocks go to the back so recently used ones are reused last,
        # which keeps stale KV out of freshly allocated blocks for longer (easier debugging).
        self.free_blocks.extend(self.req_blocks.pop(req_id, ()))

    def get_blocks(self, req_id: str) -> list[int]:
        return self.req_blocks.get(req_id, [])
