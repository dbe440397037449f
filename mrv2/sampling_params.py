"""``SamplingParams``: how to sample one request, with vLLM's names and defaults.

Every field is checked when the object is built; a bad value raises ``ValueError``
naming the field, so a bad request fails before it touches the engine and
nothing else in flight is lost.
"""

from __future__ import annotations

from dataclasses import dataclass, field

_GREEDY_EPS = 1e-5


@dataclass
class SamplingParams:
    """Sampling parameters of one request (vLLM's offline API).

    Args:
        n: completions per prompt.
        temperature: 0 means greedy; otherwise logits are divided by it.
        top_p: keep the smallest set of tokens whose probability reaches ``top_p``.
        top_k: keep the ``top_k`` most likely tokens (0 or -1: all).
        min_p: drop tokens whose probability is below ``min_p`` times the top one.
        seed: a per-request seed; the same seed gives the same tokens whatever the batch.
        presence_penalty, frequency_penalty: OpenAI-style penalties on generated tokens.
        repetition_penalty: CTRL-style penalty (>1 discourages prompt and output tokens).
        max_tokens: most tokens to generate (``None``: up to the model's length).
        min_tokens: EOS and stop tokens are banned until this many were generated.
        stop: strings that end the output (not included unless ``include_stop_str_in_output``).
        stop_token_ids: token ids that end the output (included in ``token_ids``).
        ignore_eos: keep generating past EOS.
        logprobs: number of top log-probabilities to return per generated token.
        prompt_logprobs: number of top log-probabilities to return per prompt token.
        logit_bias: token id -> additive bias.
        allowed_token_ids: if set, only these tokens may be generated.
        skip_special_tokens: drop special tokens when detokenizing.
        bad_words: words never to generate: the last token of a word is banned whenever
            the generated tokens end with the word's other tokens (``mrv2/sample/bad_words.py``).
        truncate_prompt_tokens: keep only the last k prompt tokens (-1: the last
            ``max_model_len - 1``; ``None``: no truncation).
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    detokenize: bool = True
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    # Filled by the engine: the output-ending ids (stop_token_ids + EOS unless ignored).
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False)
    # Filled by the engine: bad_words as token-id sequences (mrv2.sample.bad_words).
    bad_words_token_ids: list[list[int]] | None = field(default=None, repr=False)

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._verify()
        if self.temperature < _GREEDY_EPS:
            # Greedy: the other knobs cannot change the argmax.
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    def _verify(self) -> None:
        def bad(name, why):
            raise ValueError(f"SamplingParams.{name} {why}, got {getattr(self, name)!r}")

        def is_int(x):
            return isinstance(x, int) and not isinstance(x, bool)

        if not is_int(self.n) or self.n < 1:
            bad("n", "must be an integer >= 1")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad("frequency_penalty", "must be in [-2, 2]")
        if not self.repetition_penalty > 0.0:
            bad("repetition_penalty", "must be > 0")
        if not self.temperature >= 0.0:
            bad("temperature", "must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", "must be in (0, 1]")
        if not is_int(self.top_k) or self.top_k < -1:
            bad("top_k", "must be -1 or 0 (disabled) or a positive integer")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", "must be in [0, 1]")
        if self.seed is not None and not is_int(self.seed):
            bad("seed", "must be an integer or None")
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 1):
            bad("max_tokens", "must be an integer >= 1 or None")
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must be <= max_tokens={self.max_tokens}")
        if not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", "must hold non-empty strings")
        if not all(is_int(t) and t >= 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must hold non-negative integers")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not is_int(v) or v < -1):
                bad(name, "must be None, -1 (full vocabulary) or an integer >= 0")
        if self.logit_bias is not None and not all(
                is_int(k) and k >= 0 for k in self.logit_bias):
            bad("logit_bias", "keys must be non-negative token ids")
        if self.allowed_token_ids is not None and (
                not self.allowed_token_ids
                or not all(is_int(t) and t >= 0 for t in self.allowed_token_ids)):
            bad("allowed_token_ids", "must be a non-empty list of non-negative token ids")
        if self.bad_words is not None and (
                isinstance(self.bad_words, str)
                or not all(isinstance(w, str) and w.strip() for w in self.bad_words)):
            bad("bad_words", "must be a list of non-empty strings")
        t = self.truncate_prompt_tokens
        if t is not None and (not is_int(t) or (t < 1 and t != -1)):
            bad("truncate_prompt_tokens", "must be None, -1 or an integer >= 1")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    def clone(self) -> SamplingParams:
        import copy

        return copy.deepcopy(self)
