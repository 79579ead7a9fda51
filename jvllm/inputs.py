"""What jvllm takes as input, checked in one place for the offline API and the server: prompt dicts
(vLLM's TextPrompt / TokensPrompt) and chat messages (OpenAI's shape). Plain Python, no jax.

Contracts:
- A prompt dict has "prompt" and/or "prompt_token_ids". Keys vLLM defines that jvllm does not
  implement (multi_modal_data, ...) and any other key are a ValueError naming them: a field is never
  silently ignored.
- A chat message's content is a string, None, or a list of content parts. Text parts
  ({"type": "text", "text": str}; also input_text, output_text, refusal) are joined with "\\n", as
  vLLM does for templates that take the content as a string; any other part type (image_url,
  input_audio, ...) is a ValueError naming it.
"""
from __future__ import annotations

import numbers
from typing import Any, Mapping, Required, Sequence, TypedDict

PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids"})
# vLLM's prompt fields that jvllm does not implement (named in the error as such)
UNIMPLEMENTED_PROMPT_KEYS = frozenset({"multi_modal_data", "mm_processor_kwargs", "multi_modal_uuids", "cache_salt",
                                       "prompt_embeds", "token_type_ids", "encoder_prompt", "decoder_prompt"})
# content part type -> the field holding its text (vLLM reads these as text too)
TEXT_PART_TYPES = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal"}
# content parts of OpenAI's / vLLM's chat API that carry something other than text
NON_TEXT_PART_TYPES = frozenset({"image_url", "image", "image_embeds", "image_pil", "input_image", "input_audio",
                                 "audio_url", "audio", "video_url", "video", "file", "input_file"})


class TextPrompt(TypedDict, total=False):
    """vLLM's text prompt dict (the fields jvllm takes): `TextPrompt(prompt="...")` is a plain dict."""
    prompt: Required[str]


class TokensPrompt(TypedDict, total=False):
    """vLLM's token-id prompt dict (the fields jvllm takes); `prompt` is the text to report with it."""
    prompt_token_ids: Required[list[int]]
    prompt: str


def _is_token_id(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def normalize_prompts(prompts) -> list:
    """`generate`'s prompts as a list of single prompts: a string, a prompt dict or one sequence of
    token ids (list, tuple or 1-D array of integers, numpy's included, as ints) is one prompt;
    any other sequence is a list of prompts, each normalized the same way."""
    def one(p):
        if isinstance(p, (str, Mapping)):
            return p
        if hasattr(p, "tolist") and getattr(p, "ndim", 1) == 1:  # a numpy / jax array of ids
            p = p.tolist()
        if isinstance(p, (list, tuple)) and all(_is_token_id(t) for t in p):
            return [int(t) for t in p]
        return p

    if isinstance(prompts, (str, Mapping)):
        return [prompts]
    if hasattr(prompts, "tolist") and getattr(prompts, "ndim", None) == 1:
        return [one(prompts)]
    if isinstance(prompts, (list, tuple)) and prompts and all(_is_token_id(t) for t in prompts):
        return [one(prompts)]
    return [one(p) for p in prompts]


def check_prompt_dict(prompt: Mapping[str, Any]) -> None:
    """Raise ValueError for a prompt dict with no prompt or with keys jvllm does not take."""
    keys = set(prompt)
    unimplemented = sorted(keys & UNIMPLEMENTED_PROMPT_KEYS)
    if unimplemented:
        raise ValueError(f"prompt field(s) {unimplemented} are not implemented by jvllm (text-only models); "
                         f"a prompt dict takes {sorted(PROMPT_KEYS)}")
    unknown = sorted(keys - PROMPT_KEYS)
    if unknown:
        raise ValueError(f"unknown prompt field(s) {unknown}; a prompt dict takes {sorted(PROMPT_KEYS)}")
    if not keys & PROMPT_KEYS:
        raise ValueError(f"a prompt dict needs 'prompt' or 'prompt_token_ids', got keys {sorted(keys)}")


def _part_field(part, name):
    return part.get(name) if isinstance(part, Mapping) else getattr(part, name, None)


def content_text(content, where: str = "content") -> str:
    """The text of one chat message's content (see the module contract). `where` names the
    message in errors (e.g. "messages[2].content"). Parts may be dicts or objects with `type` and
    `text` attributes (the server's request models)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, Sequence):
        raise ValueError(f"{where} must be a string, null or a list of content parts, got {type(content).__name__}")
    texts = []
    for i, part in enumerate(content):
        kind = _part_field(part, "type")
        if kind in TEXT_PART_TYPES:
            field = TEXT_PART_TYPES[kind]
            text = _part_field(part, field)
            if not isinstance(text, str):
                raise ValueError(f"{where}[{i}] is a {kind!r} part without a string {field!r} "
                                 f"(got {type(text).__name__})")
            texts.append(text)
        elif kind in NON_TEXT_PART_TYPES:
            raise ValueError(f"{where}[{i}] has type {kind!r}: jvllm serves text-only models and takes only "
                             f"'text' content parts")
        else:
            raise ValueError(f"{where}[{i}] has unknown content part type {kind!r}; jvllm takes only 'text' parts")
    return "\n".join(texts)


def template_messages(messages: Sequence[Mapping[str, Any]], where: str = "messages") -> list[dict]:
    """Chat messages as a chat template takes them: content flattened to text, the "developer"
    role mapped to "system" (as OpenAI's newer clients send it), other keys (name, tool_calls,
    tool_call_id, ...) passed through for templates that render them."""
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ValueError(f"{where}[{i}] must be a dict with 'role' and 'content', got {type(m).__name__}")
        if not isinstance(m.get("role"), str):
            raise ValueError(f"{where}[{i}] needs a string 'role', got {m.get('role')!r}")
        msg = dict(m)
        if msg["role"] == "developer":
            msg["role"] = "system"
        msg["content"] = content_text(m.get("content"), f"{where}[{i}].content")
        out.append(msg)
    return out
