"""Chat templates: conversations -> prompt text, for ``LLM.chat``.

A chat model's tokenizer carries a Jinja template (``chat_template.jinja`` or the
``chat_template`` of ``tokenizer_config.json``) that turns a list of
``{"role", "content"}`` messages into the exact text the model was trained on,
special tokens included. vLLM renders it and then tokenizes without adding special
tokens again. This module renders it in a sandboxed Jinja environment set up the
way Hugging Face's ``apply_chat_template`` sets it up (``trim_blocks``,
``lstrip_blocks``, ``loopcontrols``, ``raise_exception``, ``strftime_now``, a
``tojson`` that does not escape HTML), so the text is the same: the tests check it
against ``transformers`` on the Qwen3 tokenizer. The embedded tiny model has a small
template of its own (``mrv2/assets/tiny-qwen3-shakespeare/chat_template.jinja``):
each turn becomes a Tiny Shakespeare speech, ``ROLE:\\ncontent\\n\\n``.
"""

from __future__ import annotations

import functools
import json
import pathlib
from datetime import datetime

from mrv2.inputs import TokensPrompt

#: vLLM's error when neither the tokenizer nor the call gives a template.
NO_TEMPLATE_ERROR = ("As of transformers v4.44, default chat template is no longer allowed, so "
                     "you must provide a chat template if the tokenizer does not define one.")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


@functools.lru_cache(maxsize=16)
def _compile(template: str):
    """The compiled template (cached: a template is compiled once per process)."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # NOTE: Jinja's own tojson escapes <, >, & as HTML: templates expect plain JSON.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def resolve_chat_template(tokenizer, chat_template: str | None = None) -> str:
    """The template to use: the argument (text or a file path), else the tokenizer's.

    Args:
        tokenizer: a Hugging Face tokenizer, or ``None``.
        chat_template: a Jinja template, or the path of a ``.jinja`` file.

    Returns:
        The template text.

    Raises:
        ValueError: no template anywhere (vLLM's message).
    """
    if chat_template is not None:
        if "{" not in chat_template and pathlib.Path(chat_template).is_file():
            return pathlib.Path(chat_template).read_text()
        return chat_template
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # several named templates: the "default" one
        template = template.get("default")
    if not template:
        raise ValueError(NO_TEMPLATE_ERROR)
    return template


def _message_text(message: dict, i: int) -> dict:
    """A copy of ``message`` whose content is a string (text parts joined by newlines)."""
    if not isinstance(message, dict) or "role" not in message:
        raise TypeError(f"message {i} must be a dict with a 'role', got {message!r}")
    content = message.get("content")
    if isinstance(content, list):  # OpenAI-style parts: only text is supported
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(f"message {i}: content part of type {kind!r} is not supported "
                                 "(mrv2 is text-only)")
            texts.append(part["text"])
        message = {**message, "content": "\n".join(texts)}
    return dict(message)


def apply_chat_template(tokenizer, conversation: list[dict], chat_template: str | None = None,
                        add_generation_prompt: bool = True, continue_final_message: bool = False,
                        tools: list[dict] | None = None, **kwargs) -> str:
    """Render one conversation to prompt text.

    Args:
        tokenizer: gives the template and the special tokens (``bos_token``, ...).
        conversation: ``{"role", "content"}`` messages.
        chat_template: overrides the tokenizer's template.
        add_generation_prompt: end with the header of the assistant's turn.
        continue_final_message: end inside the last message, for the model to continue it.
        tools: tool schemas (dicts), for templates that render them.
        **kwargs: extra template variables (e.g. ``enable_thinking=False``).

    Returns:
        The prompt text.
    """
    if add_generation_prompt and continue_final_message:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be True")
    template = resolve_chat_template(tokenizer, chat_template)
    messages = [_message_text(m, i) for i, m in enumerate(conversation)]
    final = None
    if continue_final_message:
        if not messages or not isinstance(messages[-1].get("content"), str):
            raise ValueError("continue_final_message needs a last message with text content")
        final = messages[-1]["content"]
        messages[-1]["content"] = final + _CONTINUE_TAG
    special = dict(getattr(tokenizer, "special_tokens_map", None) or {})
    text = _compile(template).render(messages=messages, tools=tools, documents=None,
                                     add_generation_prompt=add_generation_prompt,
                                     **{**special, **kwargs})
    if final is not None:
        tag = text.rfind(_CONTINUE_TAG.strip())
        if tag < 0 or final.strip() not in text:
            raise ValueError("continue_final_message: the template dropped part of the final "
                             "message")
        # NOTE: a template that strips the message also strips the tag's trailing space.
        text = text[:tag] if text[tag:tag + len(_CONTINUE_TAG)] == _CONTINUE_TAG \
            else text[:tag].rstrip()
    return text


def render_conversations(tokenizer, messages, chat_template: str | None = None,
                         add_generation_prompt: bool = True, continue_final_message: bool = False,
                         tools=None, chat_template_kwargs: dict | None = None
                         ) -> list[TokensPrompt]:
    """``LLM.chat``'s input -> one ``TokensPrompt`` per conversation.

    Args:
        tokenizer: the engine's tokenizer (``None``: no chat).
        messages: one conversation (a list of message dicts) or a list of them.
        chat_template, add_generation_prompt, continue_final_message, tools: as in
            ``apply_chat_template``.
        chat_template_kwargs: extra template variables.

    Returns:
        Prompts with ``prompt`` (the rendered text) and ``prompt_token_ids`` (encoded
        without adding special tokens: the template already wrote them).
    """
    if tokenizer is None:
        raise ValueError("LLM.chat needs a tokenizer (the engine has skip_tokenizer_init=True)")
    if not isinstance(messages, (list, tuple)) or not messages:
        raise TypeError("messages must be a non-empty list of messages or of conversations")
    conversations = [messages] if isinstance(messages[0], dict) else list(messages)
    prompts = []
    for conv in conversations:
        text = apply_chat_template(tokenizer, list(conv), chat_template, add_generation_prompt,
                                   continue_final_message, tools, **(chat_template_kwargs or {}))
        ids = tokenizer.encode(text, add_special_tokens=False)
        prompts.append(TokensPrompt(prompt=text, prompt_token_ids=ids))
    return prompts
