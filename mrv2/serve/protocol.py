"""OpenAI request bodies (pydantic) and their translation to ``SamplingParams``.

The models only check shapes and types (a wrong type is a 400 naming the field); every
range check is ``SamplingParams``' own validation layer, so the server and the offline
``LLM`` refuse exactly the same values with the same messages. Besides OpenAI's fields,
vLLM's extra sampling fields are accepted (``top_k``, ``min_p``, ``repetition_penalty``,
``min_tokens``, ``ignore_eos``, ``stop_token_ids``, ``include_stop_str_in_output``,
``skip_special_tokens``); unknown fields are ignored, as vLLM does. Sampling fields a
request leaves unset take the model's ``generation_config.json`` values (vLLM's
``--generation-config auto``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from mrv2.sampling_params import SamplingParams


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    """The sampling fields shared by both endpoints."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def sampling_kwargs(self, defaults: dict | None = None) -> dict:
        """The ``SamplingParams`` arguments of the request.

        Args:
            defaults: the model's ``generation_config.json`` sampling fields
                (``mrv2.generation_config``), used where the request leaves one unset, as
                vLLM's server does; the rest keep ``SamplingParams``' defaults.
        """
        defaults = defaults or {}
        kw: dict[str, Any] = {"n": self.n, "presence_penalty": self.presence_penalty,
                              "frequency_penalty": self.frequency_penalty,
                              "max_tokens": self.max_tokens, "min_tokens": self.min_tokens,
                              "stop": self.stop, "seed": self.seed, "ignore_eos": self.ignore_eos,
                              "stop_token_ids": self.stop_token_ids,
                              "include_stop_str_in_output": self.include_stop_str_in_output,
                              "skip_special_tokens": self.skip_special_tokens}
        for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
            value = getattr(self, name)
            if value is None:
                value = defaults.get(name)
            if value is not None:
                kw[name] = value
        if self.logit_bias:
            try:
                kw["logit_bias"] = {int(k): v for k, v in self.logit_bias.items()}
            except ValueError:
                raise ValueError("logit_bias keys must be token ids (integers as strings), "
                                 f"got {list(self.logit_bias)!r}") from None
        return kw

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    """``POST /v1/completions``."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def to_sampling_params(self, defaults: dict | None = None) -> SamplingParams:
        """The request's ``SamplingParams`` (``ValueError``/``TypeError`` naming a field)."""
        if self.echo:
            raise ValueError("echo is not supported")
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.best_of not in (None, self.n):
            raise ValueError(f"best_of must equal n (no beam search), got {self.best_of}")
        return SamplingParams(**self.sampling_kwargs(defaults), logprobs=self.logprobs)

    def prompts(self) -> list:
        """One prompt per request: strings or ``{"prompt_token_ids": [...]}``."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise ValueError("prompt must not be empty")
        if all(isinstance(x, int) for x in p):
            return [{"prompt_token_ids": p}]
        return [x if isinstance(x, str) else {"prompt_token_ids": x} for x in p]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict] | None = None


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict | None = None

    def to_sampling_params(self, defaults: dict | None = None) -> SamplingParams:
        """The request's ``SamplingParams`` (``ValueError``/``TypeError`` naming a field)."""
        kw = self.sampling_kwargs(defaults)
        if self.max_completion_tokens is not None:
            kw["max_tokens"] = self.max_completion_tokens
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        return SamplingParams(**kw, logprobs=(self.top_logprobs or 0) if self.logprobs else None)

    def conversation(self) -> list[dict]:
        return [m.model_dump(exclude_none=True) for m in self.messages]


#: The ``type`` of an OpenAI error object, by HTTP status.
ERROR_TYPES: dict[int, Literal["BadRequestError", "AuthenticationError", "NotFoundError",
                               "InternalServerError", "ServiceUnavailableError"]] = {
    400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
    500: "InternalServerError", 503: "ServiceUnavailableError"}


def error_body(status: int, message: str, param: str | None = None) -> dict:
    """OpenAI's error JSON: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "BadRequestError"),
                      "param": param, "code": status}}
