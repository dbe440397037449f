"""A new sampling knob touches only ``sample/`` and ``SamplingParams``.

The toy knob ``banned_token_id`` lives in a ``SamplingParams`` subclass and a
``LogitsProcessor`` registered with ``register_sampling_rule``: no change to the
runner, the state table or the kernels, and it takes effect end to end.
"""

from dataclasses import dataclass

import pytest
import torch

from mrv2 import LLM, SamplingParams
from mrv2.sample import register_sampling_rule
from mrv2.sample.logits_processors import LogitsProcessor
from mrv2.sample.states import SAMPLING_RULES


@dataclass
class BanParams(SamplingParams):
    banned_token_id: int | None = None


class BanToken(LogitsProcessor):
    """Sets one token per row (``banned_token_id``) to -inf."""

    def __init__(self, max_num_reqs, device):
        self.banned = torch.full((max_num_reqs,), -1, dtype=torch.int64, device=device)
        self._staged: dict[int, int] = {}

    def add_request(self, row, prompt_token_ids, sampling_params):
        tid = getattr(sampling_params, "banned_token_id", None)
        self._staged[row] = -1 if tid is None else tid

    def remove_request(self, row):
        self._staged.pop(row, None)

    def apply_staged_writes(self):
        if self._staged:
            rows = torch.tensor(list(self._staged), device=self.banned.device)
            self.banned[rows] = torch.tensor(list(self._staged.values()), device=rows.device)
            self._staged.clear()

    def apply(self, logits, idx_mapping, state):
        banned = self.banned[idx_mapping[:logits.shape[0]].long()]               # [B]
        col = banned.clamp(min=0)[:, None]                                       # [B, 1]
        kept = logits.gather(1, col)                                             # [B, 1]
        ban = torch.full_like(kept, float("-inf"))
        return logits.scatter_(1, col, torch.where(banned[:, None] >= 0, ban, kept))


@pytest.fixture(scope="module")
def ban_llm():
    with register_sampling_rule(BanToken):
        llm = LLM(max_model_len=64, max_num_seqs=2, dtype="float32")
    assert BanToken not in SAMPLING_RULES  # the registration ends with the block
    return llm


def test_a_registered_knob_takes_effect(ban_llm):
    prompt = {"prompt_token_ids": ban_llm.tokenizer.encode("ROMEO:")}
    plain = ban_llm.generate(
        prompt, BanParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2),
        use_tqdm=False)[0].outputs[0]
    first, = [t for t, lp in plain.logprobs[0].items() if lp.rank == 1]
    second, = [t for t, lp in plain.logprobs[0].items() if lp.rank == 2]
    assert first == plain.token_ids[0]
    banned, unbanned = ban_llm.generate(
        [prompt, prompt],
        [BanParams(temperature=0, max_tokens=4, ignore_eos=True, banned_token_id=first),
         BanParams(temperature=0, max_tokens=4, ignore_eos=True)], use_tqdm=False)
    banned, unbanned = banned.outputs[0].token_ids, unbanned.outputs[0].token_ids
    assert banned[0] == second                  # the runner-up of the plain greedy step
    assert first not in banned
    assert unbanned == plain.token_ids          # a row without the knob is untouched
