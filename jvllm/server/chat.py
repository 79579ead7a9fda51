"""Chat templates on the server: `--chat-template` (a file or the template itself), per-request
`chat_template` / `chat_template_kwargs`, and `tools` handed to the template.

Contracts:
- `load_chat_template(value)`: an existing file is read; a value with Jinja's `{` or a newline
  is the template itself; anything else (a path that does not exist) is a ValueError naming it.
- The template in use: the request's `chat_template` (only when the server trusts request
  templates: `--trust-request-chat-template`, as in vLLM, because a template is code run on the
  server), else the server's `--chat-template`, else the tokenizer's own.
- `chat_template_kwargs` become template variables; keys that would replace the arguments jvllm
  passes itself (`RESERVED_KWARGS`) are a 400 naming them.
- `tools` reach the template whatever `tool_choice` is (tools.py reads the calls back); assistant
  `tool_calls` in the history reach it with their arguments as dicts, `tool` messages with their
  `tool_call_id`.
"""
from __future__ import annotations

import dataclasses
import os

from jvllm.server.protocol import APIError

RESERVED_KWARGS = frozenset({"conversation", "messages", "tools", "documents", "chat_template", "tokenize",
                             "add_generation_prompt", "continue_final_message", "return_dict", "return_tensors",
                             "padding", "truncation", "max_length", "tokenizer_kwargs", "return_assistant_tokens_mask",
                             "sanitize_control_tokens", "self"})


def load_chat_template(value: str | None) -> str | None:
    """`--chat-template`'s value -> the template text (None stays None)."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            text = f.read()
        if not text.strip():
            raise ValueError(f"--chat-template: the file {value!r} is empty")
        return text
    if any(c in value for c in "{\n"):
        return value
    raise ValueError(f"--chat-template: {value!r} is neither an existing file nor a Jinja template "
                     f"(a template holds '{{' or a newline)")


@dataclasses.dataclass(frozen=True)
class ChatOptions:
    """How one conversation becomes a prompt (validated by `chat_options`)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None  # the request's own (already allowed)
    template_kwargs: tuple = ()  # (key, value) pairs
    tools: list | None = None


def chat_options(req, trust_request_template: bool, add_special_tokens: bool = False) -> ChatOptions:
    """ChatOptions of a chat or tokenize request; 400 for what the server refuses (tool_choice is
    checked by tools.tool_mode)."""
    if req.add_generation_prompt and req.continue_final_message:
        raise APIError("add_generation_prompt and continue_final_message cannot both be true",
                       param="continue_final_message")
    if req.chat_template is not None and not trust_request_template:
        raise APIError("chat_template: this server does not accept chat templates in requests (start it with "
                       "--trust-request-chat-template to allow them)", param="chat_template")
    kwargs = req.chat_template_kwargs or {}
    bad = sorted(ascii(k)[1:-1] for k in kwargs if k in RESERVED_KWARGS)
    if bad:
        raise APIError(f"chat_template_kwargs: {bad} are set by jvllm itself (use the request's own fields); "
                       f"reserved: {sorted(RESERVED_KWARGS)}", param="chat_template_kwargs")
    tools = req.tools
    return ChatOptions(req.add_generation_prompt, req.continue_final_message, add_special_tokens,
                       req.chat_template, tuple(kwargs.items()), tools or None)


def render_chat(tokenizer, default_template: str | None, messages, opts: ChatOptions) -> str:
    """The prompt text of `messages` (ChatMessage models) under `opts`."""
    template = opts.chat_template or default_template
    if template is None and getattr(tokenizer, "chat_template", None) is None:
        raise APIError("this model's tokenizer has no chat template: start the server with --chat-template, "
                       "or use /v1/completions", param="messages")
    if opts.continue_final_message and messages[-1].role != "assistant":
        raise APIError("continue_final_message needs the last message to be from the assistant",
                       param="continue_final_message")
    conv = []
    for m in messages:
        d = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        for k in ("name", "tool_calls", "tool_call_id"):
            if getattr(m, k) is not None:
                d[k] = getattr(m, k)
        if m.tool_calls is not None:
            from jvllm.server.tools import history_tool_calls

            d["tool_calls"] = history_tool_calls(m.tool_calls)
        conv.append(d)
    kw = dict(opts.template_kwargs)
    if opts.tools:
        kw["tools"] = opts.tools
    try:
        text = tokenizer.apply_chat_template(conv, chat_template=template, tokenize=False,
                                             add_generation_prompt=opts.add_generation_prompt,
                                             continue_final_message=opts.continue_final_message, **kw)
    except Exception as e:  # the template rejected the conversation (roles, order, syntax, ...)
        param = "chat_template" if opts.chat_template else "messages"
        raise APIError(f"{param}: the chat template failed: {type(e).__name__}: {e}", param=param) from None
    if not isinstance(text, str):
        raise APIError(f"messages: the chat template gave {type(text).__name__}, not text", param="messages")
    return text
