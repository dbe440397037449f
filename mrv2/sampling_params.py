"""``SamplingParams``: how to sample one request, with vLLM's names and defaults.

One validation layer. Every field is checked for type, finiteness and range when the
object is built (``__post_init__``) and again when it is submitted (``verify``, called by
the engine at ``add_request``), so a field changed after construction is caught too. The
checks that depend on the model (vocabulary size, most logprobs, capacity of the
logit-rule tables) take a ``ParamLimits``. A bad value raises ``TypeError`` (wrong type)
or ``ValueError`` (out of range) naming the field, before the request touches the engine,
so nothing else in flight is lost.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

import numpy as np

_GREEDY_EPS = 1e-5
_INT64_MIN, _INT64_MAX = -2**63, 2**63 - 1


@dataclass(frozen=True)
class ParamLimits:
    """What a model (and its runner) can serve: the submit-time limits of ``verify``.

    Args:
        vocab_size: token ids must be in ``[0, vocab_size)``.
        max_logprobs: most ``logprobs`` / ``prompt_logprobs`` (``-1``: the full vocabulary).
        max_logit_bias: most ``logit_bias`` entries (``None``: no limit).
        max_stop_ids: most stop token ids, EOS included (``None``: no limit).
        eos_token_ids: the model's EOS ids (they end a request unless ``ignore_eos``).
        has_tokenizer: ``stop`` strings need one.
    """

    vocab_size: int
    max_logprobs: int
    max_logit_bias: int | None = None
    max_stop_ids: int | None = None
    eos_token_ids: frozenset[int] = frozenset()
    has_tokenizer: bool = True


def _bad(name: str, why: str, value, exc=ValueError):
    raise exc(f"SamplingParams.{name} {why}, got {value!r}")


def is_token_int(x) -> bool:
    """An integer usable as a token id or count: Python or numpy ints, never ``bool``."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _int(name: str, value, *, lo=None, allow_none=False):
    if value is None and allow_none:
        return None
    if not is_token_int(value):
        _bad(name, "must be an integer" + (" or None" if allow_none else ""), value, TypeError)
    value = int(value)
    if lo is not None and value < lo:
        _bad(name, f"must be >= {lo}", value)
    return value


def _float(name: str, value) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        _bad(name, "must be a real number", value, TypeError)
    value = float(value)
    if not math.isfinite(value):
        _bad(name, "must be finite", value)
    return value


def _token_ids(name: str, value, *, allow_none=False, non_empty=False) -> list[int] | None:
    if value is None:
        return None if allow_none else []
    if isinstance(value, (str, bytes, dict)) or not hasattr(value, "__iter__"):
        _bad(name, "must be a list of token ids", value, TypeError)
    ids = list(value)
    for t in ids:
        if not is_token_int(t):
            _bad(name, "must hold integer token ids (not bool)", value, TypeError)
        if t < 0:
            _bad(name, "must hold non-negative token ids", value)
    if non_empty and not ids:
        _bad(name, "must be None or a non-empty list of token ids", value)
    return [int(t) for t in ids]


@dataclass
class SamplingParams:
    """Sampling parameters of one request (vLLM's offline API).

    Args:
        n: completions per prompt.
        temperature: 0 means greedy; otherwise logits are divided by it (finite, >= 0).
        top_p: keep the smallest set of tokens whose probability reaches ``top_p``.
        top_k: keep the ``top_k`` most likely tokens (0 or -1: all; as in vLLM, a value
            >= the vocabulary size also means all).
        min_p: drop tokens whose probability is below ``min_p`` times the top one.
        seed: a per-request seed (int64; completion ``i`` of ``n`` uses ``seed + i``); the
            same seed gives the same tokens whatever the batch.
        presence_penalty, frequency_penalty: OpenAI-style penalties on generated tokens.
        repetition_penalty: CTRL-style penalty (>1 discourages prompt and output tokens).
        max_tokens: most tokens to generate (``None``: up to the model's length).
        min_tokens: EOS and stop tokens are banned until this many were generated.
        stop: strings that end the output (not included unless ``include_stop_str_in_output``).
        stop_token_ids: token ids that end the output (included in ``token_ids``).
        ignore_eos: keep generating past EOS.
        logprobs: number of top log-probabilities to return per generated token.
        prompt_logprobs: number of top log-probabilities to return per prompt token.
        logit_bias: token id -> additive bias, a finite number. NOTE: ``-inf`` is refused
            (as NaN and ``+inf``): a large finite bias such as -100 bans a token.
        allowed_token_ids: if set, only these tokens may be generated.
        skip_special_tokens: drop special tokens when detokenizing.
        bad_words: words never to generate: the last token of a word is banned whenever
            the generated tokens end with the word's other tokens (``mrv2/sample/bad_words.py``).
        truncate_prompt_tokens: keep only the last k prompt tokens (-1: the last
            ``max_model_len - 1``; ``None``: no truncation).

    Fully masked logits: as far as we know vLLM does not check for them (its sampler then
    returns some id, possibly outside ``allowed_token_ids``). mrv2 refuses at submit the
    masks it can see (``allowed_token_ids`` all banned by ``min_tokens``); for masks it
    cannot see (logits processors) the engine finishes a request with
    ``allowed_token_ids`` whose sampled id falls outside the set with ``finish_reason
    "error"`` (a CPU check on the host output, no sync); without ``allowed_token_ids``
    the token of an all ``-inf`` row is undefined (observed: id 0, the argmax of a row of
    equal values).
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
        self.verify()

    def verify(self, limits: ParamLimits | None = None) -> None:
        """Check (and normalise) every field; with ``limits``, the model's limits too.

        Called at construction and by the engine at submit time. Normalising is
        idempotent: numpy ints become ``int``, a ``stop`` string a list, and a greedy
        request drops the knobs that cannot change its argmax.

        Args:
            limits: the model's limits (``None``: only the model-independent checks).

        Raises:
            TypeError: a field has the wrong type (named).
            ValueError: a field is out of range (named).
        """
        self._verify_fields()
        if limits is not None:
            self._verify_limits(limits)
        if self.temperature < _GREEDY_EPS:
            # Greedy: the other knobs cannot change the argmax.
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    def _verify_fields(self) -> None:
        self.n = _int("n", self.n, lo=1)
        for name in ("presence_penalty", "frequency_penalty"):
            setattr(self, name, _float(name, getattr(self, name)))
            if not -2.0 <= getattr(self, name) <= 2.0:
                _bad(name, "must be in [-2, 2]", getattr(self, name))
        self.repetition_penalty = _float("repetition_penalty", self.repetition_penalty)
        if not self.repetition_penalty > 0.0:
            _bad("repetition_penalty", "must be > 0", self.repetition_penalty)
        self.temperature = _float("temperature", self.temperature)
        if self.temperature < 0.0:
            _bad("temperature", "must be >= 0", self.temperature)
        self.top_p = _float("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            _bad("top_p", "must be in (0, 1]", self.top_p)
        self.top_k = _int("top_k", self.top_k, lo=-1)
        self.min_p = _float("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            _bad("min_p", "must be in [0, 1]", self.min_p)
        self.seed = _int("seed", self.seed, allow_none=True)
        # NOTE: completion i of n uses seed + i, and the state table stores int64 seeds.
        if self.seed is not None and not _INT64_MIN <= self.seed <= _INT64_MAX - (self.n - 1):
            _bad("seed", f"must fit in int64 with seed + n - 1 <= 2**63 - 1 (n={self.n})",
                 self.seed)
        self.max_tokens = _int("max_tokens", self.max_tokens, lo=1, allow_none=True)
        self.min_tokens = _int("min_tokens", self.min_tokens, lo=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            _bad("min_tokens", f"must be <= max_tokens={self.max_tokens}", self.min_tokens)
        self._verify_stop()
        for name in ("logprobs", "prompt_logprobs"):
            setattr(self, name, _int(name, getattr(self, name), lo=-1, allow_none=True))
        self._verify_logit_bias()
        self.allowed_token_ids = _token_ids("allowed_token_ids", self.allowed_token_ids,
                                            allow_none=True, non_empty=True)
        if self.bad_words is not None and (
                isinstance(self.bad_words, str) or not isinstance(self.bad_words, (list, tuple))
                or not all(isinstance(w, str) and w.strip() for w in self.bad_words)):
            wrong_type = not isinstance(self.bad_words, (list, tuple, str))
            _bad("bad_words", "must be a list of non-empty strings", self.bad_words,
                 TypeError if wrong_type else ValueError)
        self.truncate_prompt_tokens = _int("truncate_prompt_tokens", self.truncate_prompt_tokens,
                                           lo=-1, allow_none=True)
        if self.truncate_prompt_tokens == 0:
            _bad("truncate_prompt_tokens", "must be None, -1 or an integer >= 1", 0)
        for name in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
                     "include_stop_str_in_output", "detokenize"):
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                _bad(name, "must be a bool", getattr(self, name), TypeError)
            setattr(self, name, bool(getattr(self, name)))

    def _verify_stop(self) -> None:
        stop = self.stop
        if stop is None:
            stop = []
        elif isinstance(stop, str):
            stop = [stop]
        elif isinstance(stop, (list, tuple)):
            stop = list(stop)
        else:
            _bad("stop", "must be a string or a list of strings", stop, TypeError)
        if not all(isinstance(s, str) for s in stop):
            _bad("stop", "must hold strings", self.stop, TypeError)
        if not all(stop):
            _bad("stop", "must hold non-empty strings", self.stop)
        self.stop = stop
        self.stop_token_ids = _token_ids("stop_token_ids", self.stop_token_ids)

    def _verify_logit_bias(self) -> None:
        bias = self.logit_bias
        if bias is None:
            return
        if not isinstance(bias, dict):
            _bad("logit_bias", "must be a dict of token id -> bias", bias, TypeError)
        out = {}
        for k, v in bias.items():
            if not is_token_int(k):
                _bad("logit_bias", f"keys must be integer token ids (key {k!r})", bias, TypeError)
            if k < 0:
                _bad("logit_bias", "keys must be non-negative token ids", bias)
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Real):
                _bad("logit_bias", f"values must be real numbers (key {k!r})", bias, TypeError)
            if not math.isfinite(float(v)):
                _bad("logit_bias", f"values must be finite (key {k!r}; ban a token with a "
                     "large finite bias such as -100)", bias)
            out[int(k)] = float(v)
        self.logit_bias = out

    def _verify_limits(self, limits: ParamLimits) -> None:
        vocab = limits.vocab_size
        for name in ("stop_token_ids", "allowed_token_ids", "logit_bias"):
            ids = getattr(self, name) or ()
            if any(t >= vocab for t in ids):
                _bad(name, f"holds a token id >= the vocabulary size {vocab}",
                     getattr(self, name))
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and v > limits.max_logprobs:
                _bad(name, f"must be <= {limits.max_logprobs} (or -1: the full vocabulary)", v)
        if limits.max_logit_bias is not None and len(self.logit_bias or ()) > limits.max_logit_bias:
            _bad("logit_bias", f"has {len(self.logit_bias)} entries; at most "
                 f"{limits.max_logit_bias}", "...")
        eos = set() if self.ignore_eos else set(limits.eos_token_ids)
        stops = set(self.stop_token_ids) | eos
        if limits.max_stop_ids is not None and len(stops) > limits.max_stop_ids:
            _bad("stop_token_ids", f"at most {limits.max_stop_ids - len(eos)} ids "
                 f"(the runner holds {limits.max_stop_ids} stop ids, EOS included)",
                 self.stop_token_ids)
        if self.stop and not limits.has_tokenizer:
            _bad("stop", "needs a tokenizer (skip_tokenizer_init=True)", self.stop)
        if (self.allowed_token_ids is not None and self.min_tokens > 0
                and set(self.allowed_token_ids) <= stops):
            _bad("allowed_token_ids", "are all stop/EOS ids banned while min_tokens="
                 f"{self.min_tokens}: every token would be masked", self.allowed_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    def clone(self) -> SamplingParams:
        """An independent copy (the engine keeps one per request, so later changes to the
        caller's object cannot reach it). The fields are scalars, strings and containers of
        them (one level of nesting: ``bad_words_token_ids``), so copying each container is
        what ``copy.deepcopy`` would do, at a quarter of its cost (3.6 vs 14 us a request on
        the CI's CPU; every request of a ``generate`` call is cloned at submit)."""
        new = object.__new__(type(self))
        for name, value in self.__dict__.items():
            if isinstance(value, list):
                value = [list(v) if isinstance(v, list) else v for v in value]
            elif isinstance(value, dict):
                value = dict(value)
            elif isinstance(value, set):
                value = set(value)
            new.__dict__[name] = value
        return new
