"""Prompt logprobs, in chunks within one prompt, accumulated across steps.

The hidden state at prompt position ``p`` predicts prompt token ``p + 1``, so a
prompt of ``P`` tokens has ``P - 1`` logprob rows (its first token has none:
``None`` in vLLM's ``PromptLogprobs``). All of them at once would need a
``[P, V]`` logits tensor: 1.2 GB in fp32 for a 2,000-token prompt of Qwen3's
151,936-token vocabulary. ``compute_prompt_logprobs`` instead runs the LM head on
``chunk_size`` positions at a time and keeps only the ``k + 1`` logprobs per
position (``mrv2/kernels/logprobs.py``), so at most ``[chunk_size, V]`` logits
are alive, whatever the prompt length.

A prompt reaches the runner over several steps (chunked prefill), and a
preempted request comes back with prompt + output as one longer prefill.
``PromptLogprobsAccumulator`` keeps, per request, how many prompt positions it
already has; each step computes only the positions that are new *and* inside the
prompt, so nothing is computed twice and nothing past the prompt is computed.
Logprobs are raw (of the model's logits, before temperature or penalties).
See notebooks/06_logprobs.ipynb.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from mrv2.kernels.logprobs import compute_topk_logprobs
from mrv2.outputs import PromptLogprobs
from mrv2.sample.logprobs import Detokenize, make_logprob_dict

LogitsFn = Callable[[torch.Tensor], torch.Tensor]
LogprobTensors = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # ids, logprobs, ranks


def compute_prompt_logprobs(hidden_states: torch.Tensor, target_ids: torch.Tensor,
                            compute_logits: LogitsFn, num_logprobs: int,
                            chunk_size: int = 1024) -> LogprobTensors:
    """Logprobs of ``target_ids`` given ``hidden_states``, ``chunk_size`` rows at a time.

    Args:
        hidden_states: ``[T, H]`` hidden states of positions ``p``.
        target_ids: ``[T]`` int64, the token at ``p + 1`` of each position.
        compute_logits: ``[c, H] -> [c, V]`` (the model's LM head).
        num_logprobs: k top tokens per position (``-1``: the whole vocabulary).
        chunk_size: rows per ``compute_logits`` call; bounds the logits memory.

    Returns:
        ``ids`` ``[T, k + 1]`` int64 (column 0 the target, then the top-k),
        ``logprobs`` ``[T, k + 1]`` float32, ``ranks`` ``[T]`` int64 (the target's).
    """
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    num_tokens, device = hidden_states.shape[0], hidden_states.device
    if num_tokens == 0:
        width = max(num_logprobs, 0) + 1
        return (torch.empty(0, width, dtype=torch.int64, device=device),
                torch.empty(0, width, dtype=torch.float32, device=device),
                torch.empty(0, dtype=torch.int64, device=device))
    out: LogprobTensors | None = None
    for start in range(0, num_tokens, chunk_size):
        end = min(start + chunk_size, num_tokens)
        # NOTE: only this chunk's [c, V] logits are alive; they die at the next iteration.
        logits = compute_logits(hidden_states[start:end])  # [c, V]
        k = logits.shape[1] if num_logprobs == -1 else num_logprobs
        ids, logprobs, ranks = compute_topk_logprobs(logits, k, target_ids[start:end])
        del logits
        if out is None:  # preallocated: no list of chunks to concatenate at the end
            out = (torch.empty(num_tokens, k + 1, dtype=torch.int64, device=device),
                   torch.empty(num_tokens, k + 1, dtype=torch.float32, device=device),
                   torch.empty(num_tokens, dtype=torch.int64, device=device))
        out[0][start:end], out[1][start:end], out[2][start:end] = ids, logprobs, ranks
    return out


def prompt_logprobs_to_output(ids: torch.Tensor, logprobs: torch.Tensor, ranks: torch.Tensor,
                              num_logprobs: int, detok: Detokenize | None = None
                              ) -> PromptLogprobs:
    """vLLM's ``PromptLogprobs``: ``None`` for the first prompt token, then one dict per row.

    Args:
        ids, logprobs: ``[P - 1, k + 1]``; ranks: ``[P - 1]`` (rows of positions 0..P-2).
        num_logprobs: k (``-1``: every column).
        detok: token id -> text, or ``None``.
    """
    k = ids.shape[1] - 1 if num_logprobs == -1 else num_logprobs
    ids_l, lps_l, ranks_l = ids.tolist(), logprobs.tolist(), ranks.tolist()
    return [None] + [make_logprob_dict(i, lp, r, k, detok)
                     for i, lp, r in zip(ids_l, lps_l, ranks_l)]


@dataclass
class _PromptState:
    prompt_token_ids: torch.Tensor              # [P] int64, CPU
    num_logprobs: int
    next_pos: int = 0                           # position of the next token the runner runs
    num_done: int = 0                           # positions 0..num_done-1 have their row
    parts: list[LogprobTensors] = field(default_factory=list)
    taken: bool = False                         # already handed out (kept to skip recompute)

    @property
    def num_rows(self) -> int:                  # P - 1 rows in all
        return max(self.prompt_token_ids.numel() - 1, 0)


class PromptLogprobsAccumulator:
    """Collects each request's prompt logprobs over chunked-prefill steps and preemptions.

    Per step, for every request that asked for prompt logprobs, the runner passes the
    hidden states (or logits) of that request's tokens in the step and, optionally,
    their first position; the accumulator computes rows only for positions that are
    inside the prompt and not done before. Results stay on the device until taken.

    Args:
        compute_logits: ``[c, H] -> [c, V]`` (e.g. ``model.compute_logits``).
        chunk_size: rows per LM-head call (bounds the ``[chunk_size, V]`` logits).
    """

    def __init__(self, compute_logits: LogitsFn, chunk_size: int = 1024):
        self.compute_logits = compute_logits
        self.chunk_size = chunk_size
        self._reqs: dict[str, _PromptState] = {}

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._reqs

    def __len__(self) -> int:
        return len(self._reqs)

    def add_request(self, req_id: str, prompt_token_ids: Sequence[int] | torch.Tensor,
                    num_logprobs: int) -> None:
        """Register a request at admission, and again at each re-admission after preemption.

        A re-admitted request keeps the rows it has; only its position cursor restarts
        at 0 (its prefill starts over from the first token).
        """
        if req_id in self._reqs:
            self._reqs[req_id].next_pos = 0
            return
        prompt = torch.as_tensor(prompt_token_ids, dtype=torch.int64).cpu()  # [P]
        self._reqs[req_id] = _PromptState(prompt, num_logprobs)

    def remove_request(self, req_id: str) -> None:
        """Forget a request: call when it finishes or is aborted, NOT when it is preempted."""
        self._reqs.pop(req_id, None)

    def _new_rows(self, req_id: str, num_tokens: int,
                  start_pos: int | None) -> tuple[int, int, int]:
        """Advance the cursor; return the step's first position and the ``[lo, hi)`` to do."""
        st = self._reqs[req_id]
        start = st.next_pos if start_pos is None else start_pos
        st.next_pos = start + num_tokens
        lo, hi = max(start, st.num_done), min(start + num_tokens, st.num_rows)
        if lo < hi and start > st.num_done:
            raise ValueError(f"request {req_id!r}: prompt positions {st.num_done}..{start - 1} "
                             f"were never run (a prefix-cache hit?); their logprobs are missing")
        return start, lo, hi

    def _store(self, st: _PromptState, lo: int, hi: int,
               compute: Callable[[torch.Tensor], LogprobTensors]) -> None:
        targets = st.prompt_token_ids[lo + 1:hi + 1]  # [hi - lo] the next prompt tokens
        st.parts.append(compute(targets))
        st.num_done = hi

    def add_step(self, req_id: str, hidden_states: torch.Tensor,
                 start_pos: int | None = None) -> None:
        """Record one step of a request from its hidden states.

        Args:
            req_id: a registered request.
            hidden_states: ``[n, H]`` hidden states of the request's ``n`` tokens in this
                step (a view of the flat batch: ``hidden[query_start:query_end]``).
            start_pos: absolute position of the first of them (its ``num_computed_tokens``
                before the step); ``None``: continue where the last step ended.
        """
        first, lo, hi = self._new_rows(req_id, hidden_states.shape[0], start_pos)
        if lo >= hi:
            return
        st = self._reqs[req_id]
        h = hidden_states[lo - first:hi - first]  # [hi - lo, H] the rows still missing
        self._store(st, lo, hi, lambda t: compute_prompt_logprobs(
            h, t.to(h.device, non_blocking=True), self.compute_logits, st.num_logprobs,
            self.chunk_size))

    def add_step_logits(self, req_id: str, logits: torch.Tensor,
                        start_pos: int | None = None) -> None:
        """Like :meth:`add_step`, from the ``[n, V]`` logits of the step's tokens."""
        first, lo, hi = self._new_rows(req_id, logits.shape[0], start_pos)
        if lo >= hi:
            return
        st = self._reqs[req_id]
        rows = logits[lo - first:hi - first]  # [hi - lo, V]
        k = rows.shape[1] if st.num_logprobs == -1 else st.num_logprobs
        self._store(st, lo, hi, lambda t: compute_topk_logprobs(
            rows, k, t.to(rows.device, non_blocking=True)))

    def is_complete(self, req_id: str) -> bool:
        """Whether every prompt row is computed (and not yet taken)."""
        st = self._reqs[req_id]
        return st.num_done == st.num_rows and not st.taken

    def take_tensors(self, req_id: str) -> LogprobTensors | None:
        """The ``P - 1`` rows (device tensors) once complete, else ``None``; only once.

        The request stays registered (marked taken) so that a re-admission after
        preemption neither recomputes nor returns them again.
        """
        if not self.is_complete(req_id):
            return None
        st = self._reqs[req_id]
        parts, st.parts, st.taken = st.parts, [], True
        if not parts:  # a one-token prompt
            k = max(st.num_logprobs, 0)
            return (torch.empty(0, k + 1, dtype=torch.int64), torch.empty(0, k + 1),
                    torch.empty(0, dtype=torch.int64))
        if len(parts) == 1:
            return parts[0]
        return tuple(torch.cat([p[i] for p in parts]) for i in range(3))

    def take(self, req_id: str, detok: Detokenize | None = None) -> PromptLogprobs | None:
        """vLLM's ``PromptLogprobs`` (``P`` entries, ``None`` first) once complete; only once.

        Copies to the host: call it where outputs are processed, not in the step loop.
        """
        out = self.take_tensors(req_id)
        if out is None:
            return None
        return prompt_logprobs_to_output(*out, self._reqs[req_id].num_logprobs, detok)
