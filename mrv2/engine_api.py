"""``LLMEngine``: vLLM's request-level engine API over ``mrv2.engine.Engine``.

``add_request(request_id, prompt, params)`` validates everything about one request (the
prompt, and ``SamplingParams.verify`` against the model's ``ParamLimits``) before it is
queued, so a bad request raises ``ValueError``/``TypeError`` and nothing else is touched;
``step()`` runs one engine step and returns a ``RequestOutput`` for every request that
got a token (cumulative, ``finished=False`` until its last token: streaming);
``abort_request(ids)`` ends requests in any state and frees their KV blocks and state
rows at once. ``LLM.generate`` is built on it; ``llm.llm_engine`` is the instance.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable

from mrv2.engine import Engine
from mrv2.inputs import truncate_prompt
from mrv2.metrics import group_metrics, now
from mrv2.outputs import CompletionOutput, RequestOutput
from mrv2.request import Request
from mrv2.sampling_params import ParamLimits, SamplingParams, is_token_int


class LLMEngine:
    """Requests in, streamed ``RequestOutput``s out (vLLM's ``LLMEngine`` shape).

    Args:
        engine: the step engine (scheduler + runner).
        limits: what the model can serve (``SamplingParams.verify`` checks against it).
        max_model_len: a prompt must be shorter (room for one generated token).
        tokenizer: encodes text prompts (``None``: token-id prompts only).
        validate_params: the runner's own feature check (``None``: none).
        seed: seeds the random seeds of unseeded requests.
    """

    def __init__(self, engine: Engine, limits: ParamLimits, max_model_len: int, tokenizer=None,
                 validate_params: Callable[[SamplingParams], None] | None = None, seed: int = 0):
        self.engine = engine
        self.limits = limits
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer
        self._validate = validate_params
        self._rng = random.Random(seed)
        self._arrival = 0
        self._groups: dict[str, list[Request]] = {}  # request_id -> its n child requests
        self._owner: dict[str, str] = {}             # child id -> request_id

    # -- validation ---------------------------------------------------------------------

    def parse_prompt(self, prompt, truncate: int | None = None) -> tuple[str | None, list[int]]:
        """The text and token ids of a prompt: a string, or a dict with ``prompt_token_ids``
        (optionally ``prompt``) or ``prompt`` (text). Raises before any work if invalid.

        Args:
            prompt: the prompt.
            truncate: ``SamplingParams.truncate_prompt_tokens`` (keep the last k tokens).

        Returns:
            ``(text or None, token ids)``.
        """
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer; with skip_tokenizer_init=True "
                                 "pass {'prompt_token_ids': [...]}")
            text, ids = prompt, list(self.tokenizer.encode(prompt))
        elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            text, ids = prompt.get("prompt"), prompt["prompt_token_ids"]
            if isinstance(ids, (str, bytes, dict)) or not hasattr(ids, "__iter__"):
                raise TypeError(f"prompt_token_ids must be a list of integers, got "
                                f"{type(ids).__name__}")
            ids = list(ids)
        elif isinstance(prompt, dict) and "prompt" in prompt:
            return self.parse_prompt(prompt["prompt"], truncate)
        else:
            raise TypeError("a prompt must be a string or a dict with 'prompt_token_ids' or "
                            f"'prompt', got {type(prompt).__name__}")
        ids = truncate_prompt(ids, truncate, self.max_model_len)
        vocab = self.limits.vocab_size
        if not ids:
            raise ValueError("the prompt is empty (0 tokens)")
        if not all(is_token_int(t) for t in ids):
            raise TypeError("prompt_token_ids: prompt token ids must be integers (not bool)")
        if not all(0 <= t < vocab for t in ids):
            raise ValueError(f"prompt_token_ids: prompt token ids must be in [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"the prompt is {len(ids)} tokens long, but max_model_len is "
                             f"{self.max_model_len}: it must be shorter to leave room for one "
                             "generated token")
        return text, [int(t) for t in ids]

    def check_params(self, sp: SamplingParams) -> None:
        """Re-validate ``sp`` at submit time: every field, then the model's limits."""
        if not isinstance(sp, SamplingParams):
            raise TypeError(f"sampling_params must be SamplingParams, got {type(sp).__name__}")
        sp.verify(self.limits)
        if self._validate is not None:  # a runner may support fewer features (V1 baseline)
            self._validate(sp)

    # -- requests in and out ------------------------------------------------------------

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None) -> None:
        """Validate and queue one request (its ``n`` completions).

        Raises:
            ValueError, TypeError: a bad prompt, bad params, or a ``request_id`` in use.
        """
        params = SamplingParams() if params is None else params
        self.check_params(params)
        parsed = self.parse_prompt(prompt, params.truncate_prompt_tokens)
        self._submit(request_id, parsed, params)

    def _submit(self, request_id: str, parsed, sp: SamplingParams) -> None:
        """Queue already validated input (``LLM.generate`` validates a whole batch first)."""
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a string, got {type(request_id).__name__}")
        child_ids = [request_id] if sp.n == 1 else [f"{i}_{request_id}" for i in range(sp.n)]
        if request_id in self._groups or any(c in self._owner for c in child_ids):
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, ids = parsed
        group = [self._make_request(cid, text, ids, sp, i, request_id)
                 for i, cid in enumerate(child_ids)]
        self._groups[request_id] = group
        for req in group:
            self._owner[req.request_id] = request_id
            self.engine.add_request(req)

    def _make_request(self, req_id: str, text, ids, sp: SamplingParams, index: int,
                      parent_id: str) -> Request:
        sp = sp.clone()  # NOTE: later changes to the caller's object cannot reach the engine
        user_seeded = sp.seed is not None
        if sp.seed is None:
            sp.seed = self._rng.getrandbits(63)  # one seeded path serves every request
        elif index:
            sp.seed += index  # the n completions of a seeded prompt differ, reproducibly
        if sp.top_k >= self.limits.vocab_size:
            sp.top_k = 0  # as in vLLM: a top_k of the whole vocabulary is no top_k
        eos = set() if sp.ignore_eos else set(self.limits.eos_token_ids)
        sp.all_stop_token_ids = set(sp.stop_token_ids) | eos
        # NOTE: user_seeded: the V1 baseline keeps a generator only for these.
        req = Request(req_id, ids, sp, arrival=self._arrival, prompt=text, index=index,
                      user_seeded=user_seeded, parent_request_id=parent_id, arrival_time=now())
        req.allowed_set = (None if sp.allowed_token_ids is None
                           else frozenset(sp.allowed_token_ids))
        self._arrival += 1
        return req

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """End requests in any state (waiting, prefilling, decoding, preempted) at once.

        Their KV blocks and state rows are freed now; unknown ids are ignored (vLLM).
        """
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        children = []
        for rid in ids:
            for req in self._groups.pop(rid, ()):
                self._owner.pop(req.request_id, None)
                children.append(req.request_id)
        self.engine.abort_requests(children)

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups) or self.engine.has_unfinished()

    def get_num_unfinished_requests(self) -> int:
        return len(self._groups)

    def _step_finished(self) -> list[str]:
        """One engine step; the request ids whose every completion has finished."""
        done = []
        for req in self.engine.step():
            rid = self._owner.get(req.request_id)
            if rid is not None and all(r.is_finished for r in self._groups[rid]):
                done.append(rid)
        return done

    def step(self) -> list[RequestOutput]:
        """Run one step.

        Returns:
            A cumulative ``RequestOutput`` for each request that got a token or finished
            in this step (``finished`` set on its last one).
        """
        done = self._step_finished()
        touched = dict.fromkeys(self._owner[r.request_id] for r in self.engine.updated
                                if r.request_id in self._owner)
        touched.update(dict.fromkeys(done))
        outputs = [self.get_output(rid) for rid in touched]
        for rid in done:
            self.pop(rid)
        return outputs

    def get_output(self, request_id: str) -> RequestOutput:
        """The ``RequestOutput`` of a live request so far (text detokenized when partial)."""
        group = self._groups[request_id]
        outs = []
        for r in group:
            text = r.output_text if r.is_finished else self.engine.detokenize(r)
            outs.append(CompletionOutput(
                index=r.index, text=text, token_ids=list(r.output_token_ids),
                cumulative_logprob=r.cumulative_logprob, logprobs=r.logprobs,
                finish_reason=r.finish_reason, stop_reason=r.stop_reason))
        first = group[0]
        return RequestOutput(request_id=request_id, prompt=first.prompt,
                             prompt_token_ids=first.prompt_token_ids,
                             prompt_logprobs=first.prompt_logprobs, outputs=outs,
                             finished=all(r.is_finished for r in group),
                             num_cached_tokens=max(first.num_cached_tokens, 0),
                             metrics=group_metrics(group, self.engine.spec_stats))

    def pop(self, request_id: str) -> None:
        """Forget a finished request's bookkeeping (its output was taken)."""
        for req in self._groups.pop(request_id, ()):
            self._owner.pop(req.request_id, None)
