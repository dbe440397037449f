"""The KV block pool: which fixed-size blocks of the paged KV cache each request owns,
and which full blocks are kept as a prefix cache.

The cache is ``num_blocks`` blocks of ``block_size`` token slots per layer. A
request holds ``ceil(num_tokens / block_size)`` blocks, taken from a free queue as
it grows and given back when it finishes or is preempted. The block ids go to the
runner's per-row block tables (``block_table.py``). See
notebooks/01_qwen3_and_paged_kv.ipynb.

Automatic prefix caching (vLLM V1's design; notebooks/03_gather_block_tables.ipynb):

* A *full* block whose tokens' KV has been written gets a **block hash** chained with
  its parent's: ``hash((parent_hash, tokens of the block, extra_keys))``. Equal hashes
  mean equal token prefixes, so equal KV.
* Blocks are **ref-counted**: a cached block may be held by several requests (a shared
  system prompt, the ``n`` completions of one prompt).
* A block whose count drops to 0 goes to the **free queue** but keeps its hash and its
  KV: it can still be hit. Allocation takes the queue's head, so blocks without a hash
  (put at the head) go first, then cached blocks in least-recently-freed order
  (**LRU eviction**); taking a cached block drops its hash.
* At admission the scheduler looks up the **longest cached prefix** of the request's
  full blocks; the request starts with those blocks and ``num_computed_tokens`` at the
  hit length.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


#: The "parent hash" of a request's first block.
ROOT_HASH = 0


def hash_block_tokens(parent_hash: int, token_ids: Sequence[int],
                      extra_keys: Hashable = ()) -> int:
    """The hash of one full block, chained with its parent's.

    Args:
        parent_hash: the previous block's hash (``ROOT_HASH`` for the first block).
        token_ids: the block's ``block_size`` token ids.
        extra_keys: anything else that changes the block's KV (e.g. a LoRA id); ``()``: none.

    Returns:
        A 64-bit int. NOTE: Python's tuple hash: a collision (~2**-64 per pair) would
        share wrong KV; vLLM offers sha256 for that reason. Tuples of ints hash the same
        in every process (``None`` would not on Python 3.11: its hash is its address).
    """
    return hash((parent_hash, tuple(token_ids), extra_keys))


class KVCacheManager:
    """Hands out KV blocks to requests, and keeps full blocks as a prefix cache.

    Args:
        num_blocks: blocks in the pool.
        block_size: token slots per block.
        enable_caching: keep and look up hashed full blocks (``False``: a plain pool).
        extra_keys: ``fn(request) -> hashable | None`` mixed into every block hash of
            that request: the hook for anything besides token ids that changes the KV
            (a future LoRA adapter id, a cache salt). Default: nothing.

    Attributes:
        ref_cnt: ``[num_blocks]`` holders of each block.
        block_hash: ``[num_blocks]`` the hash of a cached block, else ``None``.
        cached_block_hash_to_block: hash -> block id of every cached block.
        free_queue: the blocks with ``ref_cnt == 0``, head first out.
        req_blocks: request id -> its block ids, in order.
        num_slots: request id -> token slots its blocks hold (``len(blocks) * block_size``):
            a caller that compares a step's need with it calls :meth:`allocate` only when
            the request crosses a block boundary (once every ``block_size`` decode steps).
        next_full: request id -> the computed-token count from which :meth:`cache_blocks`
            has a new full block to register (``(cached blocks + 1) * block_size``); below
            it the call would return at once. Absent: call it (it checks for itself).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 extra_keys: Callable[[object], Hashable] | None = None):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.extra_keys = extra_keys
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.cached_block_hash_to_block: dict[int, int] = {}
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.req_blocks: dict[str, list[int]] = {}
        self.num_slots: dict[str, int] = {}
        # request id -> how many of its leading blocks are cached (or were tried); always
        # set through _set_num_cached, which keeps next_full in step.
        self._num_cached: dict[str, int] = {}
        self.next_full: dict[str, int] = {}
        # Counters: blocks hit / full blocks looked up at admission; cached blocks evicted.
        self.num_hits = self.num_queries = self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks with no holder (cached ones included: they can be evicted)."""
        return len(self.free_queue)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached_block_hash_to_block)

    def get_blocks(self, req_id: str) -> list[int]:
        return self.req_blocks.get(req_id, [])

    def blocks_needed(self, req_id: str, num_tokens: int) -> int:
        """Extra blocks ``req_id`` needs so that ``num_tokens`` tokens fit."""
        have = len(self.req_blocks.get(req_id, ()))
        return max(0, cdiv(num_tokens, self.block_size) - have)

    # -- block hashes ----------------------------------------------------------------

    def block_hashes(self, req, num_blocks: int) -> list[int]:
        """The hashes of ``req``'s first ``num_blocks`` full blocks (computed once each).

        They live on the request (``req.block_hashes``) and grow as its blocks fill:
        each block is hashed once per request, however often it is asked for.

        Args:
            req: a ``Request`` with at least ``num_blocks * block_size`` known tokens.
            num_blocks: how many leading blocks.
        """
        hashes = req.block_hashes
        if len(hashes) < num_blocks:
            bs, prompt, output = self.block_size, req.prompt_token_ids, req.output_token_ids
            extra = self.extra_keys(req) if self.extra_keys is not None else None
            extra = () if extra is None else extra
            parent = hashes[-1] if hashes else ROOT_HASH
            num_prompt = len(prompt)
            for i in range(len(hashes), num_blocks):
                start, end = i * bs, (i + 1) * bs
                if end <= num_prompt:
                    tokens = prompt[start:end]
                elif start >= num_prompt:
                    tokens = output[start - num_prompt:end - num_prompt]
                else:
                    tokens = prompt[start:] + output[:end - num_prompt]
                parent = hash_block_tokens(parent, tokens, extra)
                hashes.append(parent)
        return hashes

    def get_computed_blocks(self, req) -> tuple[list[int], int]:
        """The longest cached prefix of ``req``'s full blocks, for its admission.

        Skipped (no hit) with caching off and for a request asking for
        ``prompt_logprobs``: a cached prefix has no hidden states to score (vLLM V1 does
        the same). NOTE: the hit stops one token short of the request's known tokens:
        at least the last one is recomputed, so the step has logits to sample from; for a
        block-aligned prompt that means its whole last block.

        Args:
            req: a waiting ``Request``.

        Returns:
            ``(block ids, number of tokens they hold)``; nothing is allocated or held yet
            (pass the blocks to :meth:`allocate`).
        """
        if not self.enable_caching or req.sampling_params.prompt_logprobs is not None:
            return [], 0
        max_blocks = (req.num_tokens - 1) // self.block_size
        hits, lookup = [], self.cached_block_hash_to_block
        hashes = req.block_hashes
        for i in range(max_blocks):
            h = hashes[i] if i < len(hashes) else self.block_hashes(req, i + 1)[i]
            block = lookup.get(h)
            if block is None:
                break
            hits.append(block)
        self.num_queries += max_blocks
        self.num_hits += len(hits)
        return hits, len(hits) * self.block_size

    # -- allocation --------------------------------------------------------------------

    def allocate(self, req_id: str, num_tokens: int,
                 computed_blocks: Sequence[int] = ()) -> list[int] | None:
        """Grow ``req_id`` to hold ``num_tokens`` tokens.

        Args:
            req_id: the request.
            num_tokens: tokens it must hold after this call.
            computed_blocks: cache hits (:meth:`get_computed_blocks`) that a new request
                starts with; they are held (ref count + 1) before new blocks are taken.

        Returns:
            The newly allocated block ids, hits excluded (possibly empty), or ``None``
            when the pool has too few free blocks (nothing is allocated or held then).
        """
        blocks = self.req_blocks.get(req_id)
        # NOTE: the common decode step (room left in its last block) returns at once:
        # this runs for every running request in every step (cdiv inlined).
        if blocks is not None and not computed_blocks and (
                -(-num_tokens // self.block_size) <= len(blocks)):
            return []
        need = cdiv(num_tokens, self.block_size) - len(computed_blocks) - (
            len(blocks) if blocks is not None else 0)
        if need <= 0 and blocks is not None and not computed_blocks:
            return []
        need = max(0, need)
        # NOTE: a hit on a free cached block takes it off the free queue too.
        held_from_free = sum(1 for b in computed_blocks if self.ref_cnt[b] == 0)
        if need + held_from_free > len(self.free_queue):
            return None
        blocks = self.req_blocks.setdefault(req_id, [])
        for b in computed_blocks:
            if self.ref_cnt[b] == 0:
                del self.free_queue[b]
            self.ref_cnt[b] += 1
        blocks.extend(computed_blocks)
        if computed_blocks:
            self._set_num_cached(req_id, len(blocks))
        new = [self._take_free_block() for _ in range(need)]
        blocks.extend(new)
        self.num_slots[req_id] = len(blocks) * self.block_size
        return new

    def _set_num_cached(self, req_id: str, n: int) -> None:
        self._num_cached[req_id] = n
        self.next_full[req_id] = (n + 1) * self.block_size

    def _take_free_block(self) -> int:
        block, _ = self.free_queue.popitem(last=False)
        h = self.block_hash[block]
        if h is not None:  # evict: its KV is about to be overwritten
            self.block_hash[block] = None
            if self.cached_block_hash_to_block.get(h) == block:
                del self.cached_block_hash_to_block[h]
            self.num_evictions += 1
        self.ref_cnt[block] = 1
        return block

    def cache_blocks(self, req, num_computed_tokens: int) -> None:
        """Register ``req``'s blocks that are full and written as cached.

        A block qualifies when its tokens are all known on the CPU and
        ``num_computed_tokens`` (scheduled, hence launched before any later step that
        could read it) is past its end. Under async scheduling a token still in flight
        is not known yet: its block is cached at a later call. Cheap when nothing new
        is full (most decode steps): a division, a lookup and a compare.

        Args:
            req: a ``Request`` holding blocks.
            num_computed_tokens: its computed tokens once the scheduled step has run.
        """
        # NOTE: the fast path (nothing new is full) runs for every request in every step.
        if not self.enable_caching or (num_computed_tokens // self.block_size
                                       <= self._num_cached.get(req.request_id, 0)):
            return
        req_id = req.request_id
        num_full = min(num_computed_tokens, req.num_tokens) // self.block_size
        done = self._num_cached.get(req_id, 0)
        if num_full <= done:
            return
        blocks = self.req_blocks[req_id]
        hashes = self.block_hashes(req, num_full)
        lookup = self.cached_block_hash_to_block
        for i in range(done, num_full):
            h, block = hashes[i], blocks[i]
            # NOTE: another request may have cached the same prefix first (both computed
            # it in one step); this copy then stays uncached and is reused first.
            if h not in lookup and self.block_hash[block] is None:
                lookup[h] = block
                self.block_hash[block] = h
        self._set_num_cached(req_id, num_full)

    def free(self, req_id: str) -> None:
        """Give back every block of ``req_id`` (no-op if it holds none).

        A block left without holders joins the free queue: at the head without a hash
        (reused first), at the tail with one (evicted last, least recently used first).
        NOTE: in reverse order, so a request's last blocks (least likely to be shared)
        are evicted before its first ones.
        """
        self._num_cached.pop(req_id, None)
        self.next_full.pop(req_id, None)
        self.num_slots.pop(req_id, None)
        queue = self.free_queue
        for block in reversed(self.req_blocks.pop(req_id, ())):
            self.ref_cnt[block] -= 1
            if self.ref_cnt[block] == 0:
                queue[block] = None
                if self.block_hash[block] is None and self.enable_caching:
                    queue.move_to_end(block, last=False)

    def reset_prefix_cache(self) -> int:
        """Forget every cached block (their KV stays; they are plain blocks again).

        Returns:
            How many blocks were cached.
        """
        n = len(self.cached_block_hash_to_block)
        for block in self.cached_block_hash_to_block.values():
            self.block_hash[block] = None
        self.cached_block_hash_to_block.clear()
        for req_id, blocks in self.req_blocks.items():
            self._set_num_cached(req_id, len(blocks))  # held blocks are not cached again
        return n
