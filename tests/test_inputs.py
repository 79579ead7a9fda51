"""Prompt dicts and chat messages (jvllm.inputs) and LLM.chat's template options."""
import pytest

from jvllm import SamplingParams
from jvllm.inputs import check_prompt_dict, content_text, template_messages

ONE = SamplingParams(max_tokens=1, temperature=0)


def test_content_text():
    assert content_text(None) == "" and content_text("hi") == "hi"
    parts = [{"type": "text", "text": "a"}, {"type": "input_text", "text": "b"}, {"type": "refusal", "refusal": "c"}]
    assert content_text(parts) == "a\nb\nc"
    with pytest.raises(ValueError, match=r"messages\[1\]\.content\[1\] has type 'image_url'.*only 'text'"):
        content_text([{"type": "text", "text": "x"}, {"type": "image_url", "image_url": {"url": "u"}}],
                     "messages[1].content")
    with pytest.raises(ValueError, match="unknown content part type 'blob'"):
        content_text([{"type": "blob"}])
    with pytest.raises(ValueError, match="'text' part without a string 'text'"):
        content_text([{"type": "text", "text": 3}])
    with pytest.raises(ValueError, match="must be a string, null or a list"):
        content_text(5)


def test_template_messages():
    msgs = [{"role": "developer", "content": [{"type": "text", "text": "be brief"}]},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}]
    assert template_messages(msgs) == [{"role": "system", "content": "be brief"},
                                       {"role": "assistant", "content": "", "tool_calls": [{"id": "1"}]}]
    with pytest.raises(ValueError, match=r"messages\[0\] needs a string 'role'"):
        template_messages([{"content": "x"}])
    with pytest.raises(ValueError, match=r"messages\[0\] must be a dict"):
        template_messages(["hello"])


def test_server_message_text_is_the_shared_function():
    from jvllm.server.protocol import ChatMessage

    m = ChatMessage.model_validate({"role": "user", "content": [{"type": "text", "text": "a"},
                                                                {"type": "text", "text": "b"}]})
    assert m.text() == content_text([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}])


def test_check_prompt_dict():
    check_prompt_dict({"prompt": "x"})
    check_prompt_dict({"prompt_token_ids": [1], "prompt": "x"})
    with pytest.raises(ValueError, match=r"\['multi_modal_data'\] are not implemented by jvllm"):
        check_prompt_dict({"prompt": "x", "multi_modal_data": {"image": None}})
    with pytest.raises(ValueError, match=r"unknown prompt field\(s\) \['promt'\]"):
        check_prompt_dict({"promt": "x"})
    with pytest.raises(ValueError, match="needs 'prompt' or 'prompt_token_ids'"):
        check_prompt_dict({})


def test_generate_refuses_prompt_fields_it_does_not_take(smollm2_llm):
    with pytest.raises(ValueError, match="multi_modal_data"):
        smollm2_llm.generate([{"prompt": "ok"}, {"prompt": "Describe", "multi_modal_data": {"image": object()}}],
                             ONE, use_tqdm=False)
    with pytest.raises(ValueError, match="cache_salt"):
        smollm2_llm.generate({"prompt_token_ids": [1, 2], "cache_salt": "s"}, ONE, use_tqdm=False)
    assert not smollm2_llm.llm_engine.has_unfinished_requests()


def test_chat_with_content_parts(smollm2_llm):
    parts = smollm2_llm.chat([{"role": "user", "content": [{"type": "text", "text": "Say"},
                                                           {"type": "text", "text": "hi"}]}], ONE, use_tqdm=False)[0]
    plain = smollm2_llm.chat([{"role": "user", "content": "Say\nhi"}], ONE, use_tqdm=False)[0]
    assert parts.prompt_token_ids == plain.prompt_token_ids and "Say\nhi" in parts.prompt
    with pytest.raises(ValueError, match=r"messages\[0\]\.content\[1\] has type 'image_url'"):
        smollm2_llm.chat([{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                                       {"type": "image_url", "image_url": {"url": "x"}}]}],
                         ONE, use_tqdm=False)
    # a list of conversations names the conversation
    with pytest.raises(ValueError, match=r"messages\[1\]\[0\]\.content\[0\] has type 'input_audio'"):
        smollm2_llm.chat([[{"role": "user", "content": "a"}], [{"role": "user", "content": [{"type": "input_audio"}]}]],
                         ONE, use_tqdm=False)


TOOLS_TEMPLATE = (
    "{% if tools %}TOOLS:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}\n{% endif %}"
    "{% if persona %}PERSONA: {{ persona }}\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_chat_tools_template_and_kwargs(smollm2_llm):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
             {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    out = smollm2_llm.chat(msgs, ONE, use_tqdm=False, chat_template=TOOLS_TEMPLATE, tools=tools,
                           chat_template_kwargs={"persona": "pirate"})[0]
    # (HF renders with trim_blocks: the newline after a block tag goes)
    assert out.prompt.startswith("TOOLS: get_weather addPERSONA: pirate\n<|im_start|>user\nWeather in Paris?")
    assert out.prompt.endswith("<|im_start|>assistant\n")
    bare = smollm2_llm.chat(msgs, ONE, use_tqdm=False, chat_template=TOOLS_TEMPLATE)[0]
    assert bare.prompt.startswith("<|im_start|>user")
    default = smollm2_llm.chat(msgs, ONE, use_tqdm=False)[0]
    assert "TOOLS" not in default.prompt and "<|im_start|>assistant" in default.prompt


def test_chat_bad_options(smollm2_llm):
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(ValueError, match=r"chat_template_kwargs \['tools'\] are set by chat\(\) itself"):
        smollm2_llm.chat(msgs, ONE, use_tqdm=False, chat_template_kwargs={"tools": []})
    with pytest.raises(ValueError, match="tools must be a list of dicts"):
        smollm2_llm.chat(msgs, ONE, use_tqdm=False, tools="get_weather")
    with pytest.raises(ValueError, match="cannot both be True"):
        smollm2_llm.chat(msgs, ONE, use_tqdm=False, continue_final_message=True)
    with pytest.raises(ValueError, match="last message of messages to be from the assistant, got role 'user'"):
        smollm2_llm.chat(msgs, ONE, use_tqdm=False, continue_final_message=True, add_generation_prompt=False)
    with pytest.raises(ValueError, match="messages is empty"):
        smollm2_llm.chat([], ONE, use_tqdm=False)
