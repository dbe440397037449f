"""Request outputs in vLLM's format: ``RequestOutput`` holding ``CompletionOutput``s."""

from __future__ import annotations

from dataclasses import dataclass, field

from mrv2.metrics import RequestMetrics


@dataclass
class Logprob:
    """One token's log-probability, its rank in the vocabulary and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per position: token id -> Logprob (vLLM's SampleLogprobs / PromptLogprobs).
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    """One completion of a request.

    Attributes:
        index: which of the request's ``n`` completions this is.
        text: the generated text (detokenized ``token_ids``, stop string removed).
        token_ids: the generated token ids.
        cumulative_logprob: sum of the sampled tokens' log-probabilities, when
            ``logprobs`` was asked for; else ``None``.
        logprobs: per generated token, the top log-probabilities, when asked for.
        finish_reason: ``"stop"`` (EOS, stop token or string), ``"length"``, or ``None``.
        stop_reason: the stop string or token id that ended it (``None`` for EOS/length).
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The output of one prompt.

    Attributes:
        request_id: the engine's id of the request.
        prompt: the prompt text (``None`` for token-id prompts without a tokenizer).
        prompt_token_ids: the prompt's token ids.
        prompt_logprobs: per prompt token, its log-probabilities, when asked for.
        outputs: one ``CompletionOutput`` per completion (``SamplingParams.n``).
        finished: whether every completion has finished.
        num_cached_tokens: prompt tokens found in the prefix cache when the request was
            first admitted (their KV was reused, not recomputed); for ``n > 1``, the
            first completion's (the later ones usually share its blocks too).
        metrics: arrival, scheduling, first/last token and finish times
            (``mrv2.metrics.RequestMetrics``; with speculative decoding its
            ``spec_decode`` holds the acceptance counts).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
