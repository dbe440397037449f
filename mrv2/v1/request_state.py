"""``CachedRequestState``: V1's CPU backup copy of every live request.

The V1 runner keeps, beside its persistent batch, one Python object per request
that holds everything needed to (re)build the request's row: prompt, output so far,
sampling params, KV block ids, progress, RNG. A request that leaves the batch for a
step (not scheduled) or is preempted is re-added from here. Keeping it current costs
host work every step: each sampled token is appended to it after the step's
device-to-host copy. V2 has no such copy: its device state table is the only truth.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mrv2.sampling_params import SamplingParams


@dataclass
class CachedRequestState:
    """Everything the V1 runner knows about one request, on the CPU.

    Attributes:
        req_id: the request id.
        prompt_token_ids: the prompt.
        output_token_ids: the tokens sampled so far (after a preemption: the output
            generated before it, re-sent by the scheduler).
        sampling_params: how to sample it.
        block_ids: its KV block ids, in order.
        num_computed_tokens: tokens whose KV is in the cache.
        generator: its own RNG when the user gave a seed, else ``None``.
    """

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int = 0
    generator: torch.Generator | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt + output tokens known on the CPU."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)
