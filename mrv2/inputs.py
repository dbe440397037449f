"""Prompt types of vLLM's offline API: ``TextPrompt``, ``TokensPrompt`` and their union.

vLLM users write ``from vllm.inputs import TokensPrompt``; here it is ``mrv2.inputs``.
The types are ``TypedDict``s, so a plain ``{"prompt_token_ids": [...]}`` dict is one too.
``normalize_prompts`` turns what ``LLM.generate`` accepts into a list of such dicts.
"""

from __future__ import annotations

from typing import Any, TypedDict

from typing_extensions import NotRequired


class TextPrompt(TypedDict):
    """A text prompt, tokenized by the engine.

    Attributes:
        prompt: the text.
        multi_modal_data: not supported (only accepted when absent or ``None``).
    """

    prompt: str
    multi_modal_data: NotRequired[Any]
    mm_processor_kwargs: NotRequired[Any]
    cache_salt: NotRequired[str]


class TokensPrompt(TypedDict):
    """A prompt given as token ids (no tokenizer needed).

    Attributes:
        prompt_token_ids: the token ids.
        prompt: optional text of the same prompt (returned as ``RequestOutput.prompt``).
    """

    prompt_token_ids: list[int]
    prompt: NotRequired[str]
    token_type_ids: NotRequired[list[int]]
    multi_modal_data: NotRequired[Any]
    mm_processor_kwargs: NotRequired[Any]
    cache_salt: NotRequired[str]


#: What one prompt may be: vLLM's ``SingletonPrompt`` (``PromptType`` without encoder/decoder).
SingletonPrompt = str | TextPrompt | TokensPrompt
PromptType = SingletonPrompt

_UNSUPPORTED_KEYS = ("multi_modal_data", "mm_processor_kwargs")


def normalize_prompts(prompts, prompt_token_ids=None) -> list[TextPrompt | TokensPrompt]:
    """Turn ``LLM.generate``'s ``prompts`` into a list of prompt dicts.

    Args:
        prompts: a string, a ``TextPrompt`` / ``TokensPrompt`` dict, or a sequence of them.
        prompt_token_ids: the legacy keyword: a list of token-id lists (when ``prompts``
            is ``None``).

    Returns:
        One dict per prompt, each with ``prompt`` and/or ``prompt_token_ids``.

    Raises:
        TypeError: a prompt of another type.
        ValueError: a multimodal field with a value (not supported).
    """
    if prompts is None:
        if prompt_token_ids is None:
            raise ValueError("generate() needs prompts (or prompt_token_ids)")
        prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in prompt_token_ids]
    if isinstance(prompts, (str, dict)):
        prompts = [prompts]
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            out.append(TextPrompt(prompt=p))
            continue
        if not isinstance(p, dict):
            raise TypeError(f"prompt {i} must be a str, TextPrompt or TokensPrompt dict, "
                            f"got {type(p).__name__}")
        if "prompt_token_ids" not in p and not isinstance(p.get("prompt"), str):
            raise TypeError(f"prompt {i} is a dict without 'prompt_token_ids' or a 'prompt' "
                            f"string (keys: {sorted(p)})")
        for key in _UNSUPPORTED_KEYS:
            if p.get(key) is not None:
                raise ValueError(f"prompt {i}: {key} is not supported (mrv2 is text-only)")
        out.append(p)
    return out


def check_unsupported_args(num_prompts: int, lora_request=None, priority=None) -> None:
    """Accept vLLM's ``generate`` keywords mrv2 can honour, refuse the others clearly.

    Args:
        num_prompts: prompts in the call (``priority`` must have one entry each).
        lora_request: only ``None`` (mrv2 has no LoRA).
        priority: ``None`` or all zeros (first-come-first-served, vLLM's default policy).

    Raises:
        ValueError: a LoRA request, or a non-zero priority.
    """
    if lora_request is not None:
        raise ValueError("lora_request is not supported by mrv2 (no LoRA adapters); pass None")
    if priority is not None:
        if len(priority) != num_prompts:
            raise ValueError(f"priority has {len(priority)} entries for {num_prompts} prompts")
        if any(p != 0 for p in priority):
            raise ValueError("priority != 0 is not supported: mrv2 schedules first-come-first-"
                             "served (vLLM's default scheduling_policy='fcfs')")


def truncate_prompt(ids: list[int], truncate_prompt_tokens: int | None,
                    max_model_len: int) -> list[int]:
    """Keep the last ``truncate_prompt_tokens`` prompt tokens (vLLM truncates on the left).

    Args:
        ids: the prompt's token ids.
        truncate_prompt_tokens: ``None`` (keep all), ``-1`` (``max_model_len - 1``: the
            longest prompt that leaves room for one generated token) or k >= 1.
        max_model_len: the engine's length limit.

    Returns:
        The (possibly shorter) token ids.
    """
    if truncate_prompt_tokens is None:
        return ids
    k = max_model_len - 1 if truncate_prompt_tokens == -1 else truncate_prompt_tokens
    return ids[-k:] if len(ids) > k else ids
