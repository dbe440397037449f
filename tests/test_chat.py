"""Chat templates (mrv2/chat.py) and LLM.chat: the same text as transformers, the same tokens."""

import pytest

from mrv2 import LLM, SamplingParams
from mrv2.chat import NO_TEMPLATE_ERROR, apply_chat_template, render_conversations

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}

CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "You are terse."},
     {"role": "user", "content": "What is 2+2?"},
     {"role": "assistant", "content": "4"},
     {"role": "user", "content": "And 3+3? <b>&</b>"}],
    [{"role": "user", "content": "Think first."},
     {"role": "assistant", "content": "Done.", "reasoning_content": "Let me see... easy."},
     {"role": "user", "content": "Again."}],
    [{"role": "user", "content": "Weather in Paris?"},
     {"role": "assistant", "content": "",
      "tool_calls": [{"type": "function",
                      "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
     {"role": "tool", "content": "{\"temp\": 21}"}],
]


@pytest.fixture(scope="module")
def _qwen3(request):
    from shared_paths import SHARED_DATA
    from transformers import AutoTokenizer

    path = SHARED_DATA / "qwen3-tokenizer"
    return AutoTokenizer.from_pretrained(str(path)) if path.is_dir() else None


@pytest.fixture
def qwen3_tokenizer(_qwen3, shared_data):
    """The Qwen3 tokenizer (a real chat template), loaded once; skips without shared data."""
    return _qwen3


@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("variant", [
    {"add_generation_prompt": True}, {"add_generation_prompt": False},
    {"add_generation_prompt": True, "enable_thinking": False},
    {"add_generation_prompt": True, "enable_thinking": True},
    {"add_generation_prompt": True, "tools": [WEATHER_TOOL]},
])
def test_qwen3_template_equals_transformers(qwen3_tokenizer, conv, variant):
    messages = CONVERSATIONS[conv]
    expected = qwen3_tokenizer.apply_chat_template(messages, tokenize=False, **variant)
    assert apply_chat_template(qwen3_tokenizer, messages, **variant) == expected


def test_qwen3_continue_final_message_equals_transformers(qwen3_tokenizer):
    messages = [{"role": "user", "content": "Name a colour."},
                {"role": "assistant", "content": "My favourite colour is"}]
    expected = qwen3_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=False, continue_final_message=True)
    got = apply_chat_template(qwen3_tokenizer, messages, add_generation_prompt=False,
                              continue_final_message=True)
    assert got == expected and got.endswith("My favourite colour is")


def test_text_parts_are_joined_and_tokens_not_doubled(qwen3_tokenizer):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello"},
                                          {"type": "text", "text": "there"}]}]
    plain = [{"role": "user", "content": "Hello\nthere"}]
    (prompt,) = render_conversations(qwen3_tokenizer, parts)
    assert prompt["prompt"] == qwen3_tokenizer.apply_chat_template(
        plain, tokenize=False, add_generation_prompt=True)
    assert prompt["prompt_token_ids"] == qwen3_tokenizer.encode(prompt["prompt"],
                                                                add_special_tokens=False)
    with pytest.raises(ValueError, match="image_url"):
        render_conversations(qwen3_tokenizer, [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "x"}}]}])


@pytest.fixture(scope="module")
def llm():
    return LLM(max_model_len=128, max_num_seqs=4)


def test_embedded_template_is_a_shakespeare_speech(llm):
    conv = [{"role": "user", "content": "Speak, good sir."},
            {"role": "assistant", "content": "I will."}, {"role": "user", "content": "Then!"}]
    expected = "USER:\nSpeak, good sir.\n\nASSISTANT:\nI will.\n\nUSER:\nThen!\n\nASSISTANT:\n"
    assert apply_chat_template(llm.tokenizer, conv) == expected
    assert llm.tokenizer.apply_chat_template(conv, tokenize=False,
                                             add_generation_prompt=True) == expected
    assert apply_chat_template(llm.tokenizer, conv, add_generation_prompt=False) == \
        expected[:-len("ASSISTANT:\n")]


def test_chat_batched_equals_generate_on_rendered_prompts(llm):
    convs = [[{"role": "user", "content": "Speak."}],
             [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who?"}]]
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    chat = llm.chat(convs, sp, use_tqdm=False)
    texts = [apply_chat_template(llm.tokenizer, c) for c in convs]
    ids = [llm.tokenizer.encode(t, add_special_tokens=False) for t in texts]
    ref = llm.generate([{"prompt_token_ids": i} for i in ids], sp, use_tqdm=False)
    assert [o.prompt for o in chat] == texts
    assert [o.outputs[0].token_ids for o in chat] == [o.outputs[0].token_ids for o in ref]
    one = llm.chat(convs[0], sp, use_tqdm=False)  # a single conversation
    assert len(one) == 1 and one[0].outputs[0].token_ids == chat[0].outputs[0].token_ids
    custom = llm.chat(convs[0], sp, use_tqdm=False,
                      chat_template="{{ messages[0]['content'] }}\nROMEO:")
    assert custom[0].prompt == "Speak.\nROMEO:"


def test_chat_without_template_raises_vllms_error(llm):
    saved = llm.tokenizer.chat_template
    llm.tokenizer.chat_template = None
    try:
        with pytest.raises(ValueError, match="must provide a chat template"):
            llm.chat([{"role": "user", "content": "Hi"}], use_tqdm=False)
    finally:
        llm.tokenizer.chat_template = saved
    assert "transformers v4.44" in NO_TEMPLATE_ERROR
    with pytest.raises(TypeError, match="role"):
        llm.chat([{"content": "no role"}], use_tqdm=False)
