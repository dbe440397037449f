"""Test harness: run an mrv2 model over hand-built paged steps (no runner, no scheduler).

``PagedHarness`` owns a KV cache whose free blocks are shuffled (so a request's blocks are
never contiguous) and builds ``AttentionMetadata`` by hand for each step. ``run_schedule``
is a tiny continuous-batching loop: requests arrive at different steps, prompts are split
into chunks by a token budget, decodes and prefill chunks share steps, and each request
feeds back its greedy token. Every computed logit row is kept so a test can compare it
with a full-sequence Hugging Face forward pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mrv2.forward_context import AttentionMetadata, set_forward_context
from mrv2.models.qwen3 import bind_kv_cache, kv_cache_shape, model_dims


class PagedHarness:
    """A per-layer paged KV cache bound to ``model``, with a shuffled free-block list.

    Args:
        model: an mrv2 model (``forward(input_ids, positions)``, ``compute_logits``).
        config: its Hugging Face config.
        num_blocks: blocks per layer cache.
        block_size: tokens per block.
        seed: shuffles the free-block list.
    """

    def __init__(self, model, config, num_blocks: int = 64, block_size: int = 4, seed: int = 0):
        p = next(model.parameters())
        self.model, self.block_size, self.device = model, block_size, p.device
        shape = kv_cache_shape(config, num_blocks, block_size)
        # NOTE: NaN-filled so a read of a never-written slot poisons the logits.
        self.kv_caches = [torch.full(shape, float("nan"), dtype=p.dtype, device=p.device)
                          for _ in range(model_dims(config).num_layers)]
        bind_kv_cache(model, self.kv_caches)
        gen = torch.Generator().manual_seed(seed)
        self.free_blocks = torch.randperm(num_blocks, generator=gen).tolist()
        self.blocks: dict[int, list[int]] = {}
        self.num_computed: dict[int, int] = {}

    def free(self, req_id: int) -> None:
        """Return a finished request's blocks to the free list (later requests reuse them)."""
        self.free_blocks.extend(self.blocks.pop(req_id, []))
        self.num_computed.pop(req_id, None)

    def step(self, chunks: list[tuple[int, list[int]]], pad_tokens: int = 0,
             pad_reqs: int = 0) -> list[torch.Tensor]:
        """Run one forward pass over the new tokens of several requests.

        Args:
            chunks: ``(req_id, new token ids)`` per request, in batch order.
            pad_tokens: padding tokens appended after the real ones (slot -1).
            pad_reqs: padding requests appended (seq_len 0, empty query).

        Returns:
            Per chunk, its logits ``[len(new tokens), vocab]``.
        """
        bs = self.block_size
        ids, positions, slots, qsl, seq_lens = [], [], [], [0], []
        for req_id, toks in chunks:
            start = self.num_computed.get(req_id, 0)
            end = start + len(toks)
            blocks = self.blocks.setdefault(req_id, [])
            while len(blocks) * bs < end:
                blocks.append(self.free_blocks.pop())
            for pos in range(start, end):
                slots.append(blocks[pos // bs] * bs + pos % bs)
            ids += toks
            positions += range(start, end)
            qsl.append(qsl[-1] + len(toks))
            seq_lens.append(end)
            self.num_computed[req_id] = end
        num_real = len(ids)
        ids += [0] * pad_tokens
        positions += [0] * pad_tokens
        slots += [-1] * pad_tokens
        qsl += [qsl[-1]] * pad_reqs
        seq_lens += [0] * pad_reqs
        max_blocks = max(len(self.blocks[r]) for r, _ in chunks)
        block_table = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
        for b, (req_id, _) in enumerate(chunks):
            row = self.blocks[req_id]
            block_table[b, :len(row)] = torch.tensor(row, dtype=torch.int32)
        dev = self.device
        md = AttentionMetadata(
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_table=block_table.to(dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            max_query_len=max(len(t) for _, t in chunks),
            max_seq_len=max(seq_lens),
        )
        with set_forward_context(md), torch.no_grad():
            hidden = self.model(torch.tensor(ids, device=dev),
                                torch.tensor(positions, device=dev))     # [T_padded, hidden]
            logits = self.model.compute_logits(hidden[:num_real])        # [T, vocab]
        return list(logits.split([len(t) for _, t in chunks]))


@dataclass
class Request:
    req_id: int
    prompt: list[int]
    max_new_tokens: int
    arrival: int = 0
    tokens: list[int] = field(default_factory=list)   # prompt + generated
    fed: int = 0                                       # tokens already run through the model
    logits: list[torch.Tensor] = field(default_factory=list)

    @property
    def output(self) -> list[int]:
        return self.tokens[len(self.prompt):]

    @property
    def all_logits(self) -> torch.Tensor:
        """``[len(tokens) - 1, vocab]``: row i predicts token i + 1."""
        return torch.cat(self.logits)


def run_schedule(harness: PagedHarness, prompts: list[list[int]], max_new_tokens: int,
                 token_budget: int, arrivals: list[int] | None = None,
                 pad_tokens: int = 0, pad_reqs: int = 0) -> list[Request]:
    """Greedy-generate every prompt with chunked prefill and mixed steps.

    Each step, decoding requests go first (one token each), then unfinished prompts take
    chunks of what is left of ``token_budget``. A request samples its argmax token when
    its whole known sequence has been fed; it finishes after ``max_new_tokens``.
    """
    arrivals = arrivals or [0] * len(prompts)
    reqs = [Request(i, list(p), max_new_tokens, a, tokens=list(p))
            for i, (p, a) in enumerate(zip(prompts, arrivals))]
    step_no = 0
    while any(len(r.output) < r.max_new_tokens for r in reqs):
        live = [r for r in reqs if r.arrival <= step_no and len(r.output) < r.max_new_tokens]
        decodes = [r for r in live if r.fed >= len(r.prompt)]
        prefills = [r for r in live if r.fed < len(r.prompt)]
        budget, chunks = token_budget, []
        for r in decodes + prefills:
            n = min(len(r.tokens) - r.fed, budget)
            if n > 0:
                chunks.append((r, r.tokens[r.fed:r.fed + n]))
                budget -= n
        step_no += 1
        if not chunks:
            continue
        out = harness.step([(r.req_id, t) for r, t in chunks], pad_tokens, pad_reqs)
        for (r, toks), logits in zip(chunks, out):
            r.logits.append(logits)
            r.fed += len(toks)
            if r.fed == len(r.tokens):
                r.tokens.append(int(logits[-1].argmax()))
                if len(r.output) == r.max_new_tokens:
                    harness.free(r.req_id)
    return reqs
