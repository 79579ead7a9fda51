"""Request fields beyond the declared ones, and the text check every request goes through.

Contracts:
- A field jvllm knows (OpenAI's or vLLM's protocol) but does not implement is a 400 naming it,
  unless its value asks for nothing (null, or the neutral value listed in `NEUTRAL`, e.g.
  `response_format: {"type": "text"}`). Output that silently ignores a request is never answered.
- A truly unknown field is accepted and named in one warning in the log, as vLLM does (clients
  send fields of newer API versions).
- `reject_surrogates`: every string anywhere in a request (values, dict keys, unknown fields) must
  be encodable as UTF-8. A lone UTF-16 surrogate (a JavaScript client that cut a string inside an
  emoji) is a 400 naming the field path, never a tokenizer TypeError or an encode error while
  building the answer.
"""
from __future__ import annotations

import logging
import re

from pydantic import BaseModel

from jvllm.server.protocol import APIError

log = logging.getLogger("jvllm.server")

_STRUCTURED = "structured output (guided decoding)"
# response_format, structured_outputs and guided_json/regex/choice/grammar are declared request
# fields (server/structured.py); the backend is llguidance, whatever a request names
# field -> what it asks for; shared by /v1/completions and /v1/chat/completions
_COMMON = {
    "guided_decoding_backend": "a structured-output backend other than llguidance",
    "structural_tag": _STRUCTURED,
    "use_beam_search": "beam search", "length_penalty": "beam search", "early_stopping": "beam search",
    "logits_processors": "custom logits processors",
    "priority": "priority scheduling", "return_tokens_as_token_ids": "tokens as token ids",
    "return_token_ids": "token ids in the answer", "cache_salt": "prefix-cache salting",
    "kv_transfer_params": "KV transfer", "vllm_xargs": "vLLM extra arguments", "request_id": "client request ids",
    "prompt_embeds": "prompt embeddings", "mm_processor_kwargs": "multi-modal input",
}
UNIMPLEMENTED = {
    "completions": dict(_COMMON),
    "chat": {**_COMMON, "functions": "function calling", "function_call": "function calling",
             "reasoning_effort": "reasoning control", "include_reasoning": "reasoning parsing",
             "documents": "documents in the chat template", "echo": "echoing the last message",
             "audio": "audio output", "modalities": "non-text output", "web_search_options": "web search",
             "thinking_token_budget": "reasoning control",
             "media_io_kwargs": "multi-modal input"},
    "tokenize": {"mm_processor_kwargs": "multi-modal input",
                 "return_token_strs": "token strings"},
    "detokenize": {},
}
NEUTRAL = {  # values that ask for nothing beyond what jvllm does anyway
    "guided_decoding_backend": ["llguidance", "guidance", "auto"], "use_beam_search": [False], "length_penalty": [1.0, 1],
    "early_stopping": [False],
    "priority": [0], "return_tokens_as_token_ids": [False], "return_token_ids": [False], "echo": [False],
    "modalities": [["text"]], "documents": [[]], "return_token_strs": [False],
}


def _same(a, b) -> bool:
    """Equal in JSON terms (False is not 0)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    return a == b


def check_extra_fields(req: BaseModel, kind: str, path: str):
    """400 for a known-but-unimplemented field with a non-neutral value; warn about unknown ones."""
    extra = req.model_extra or {}
    known = UNIMPLEMENTED[kind]
    for name, value in extra.items():
        if name in known and value is not None and not any(_same(value, n) for n in NEUTRAL.get(name, ())):
            raise APIError(f"{name}: {known[name]} is not supported by jvllm; remove the field (or send null)",
                           param=name)
    unknown = sorted(ascii(k)[1:-1] for k in extra if k not in known)
    unknown += _nested_extra(req, "")
    if unknown:
        log.warning("%s: the following fields were present in the request but ignored: %s", path, unknown)


def _nested_extra(model: BaseModel, path: str) -> list[str]:
    """Undeclared fields of the parts of `model` (messages, text parts, stream_options), as paths."""
    out = []
    for name in type(model).model_fields:
        value = getattr(model, name)
        subs = [(f"{path}{name}", value)] if isinstance(value, BaseModel) else (
            [(f"{path}{name}.{i}", v) for i, v in enumerate(value)] if isinstance(value, list) else [])
        for where, sub in subs:
            if isinstance(sub, BaseModel):
                out += [f"{where}.{ascii(k)[1:-1]}" for k in (sub.model_extra or {})]
                out += _nested_extra(sub, where + ".")
    return out


_SURROGATE = re.compile("[\ud800-\udfff]")


def _walk(value, path: str):
    if isinstance(value, str):
        m = _SURROGATE.search(value)
        if m:
            return path, f"U+{ord(m.group()):04X} at character {m.start()}"
        return None
    if isinstance(value, BaseModel):
        items = [(k, getattr(value, k)) for k in type(value).model_fields]
        items += list((value.model_extra or {}).items())
    elif isinstance(value, dict):
        items = list(value.items())
        for k in value:
            if isinstance(k, str) and _SURROGATE.search(k):
                return f"{path}.{ascii(k)}" if path else ascii(k), "in a key"
    elif isinstance(value, (list, tuple)):
        items = list(enumerate(value))
    else:
        return None
    for k, v in items:
        hit = _walk(v, f"{path}.{k}" if path else str(k))
        if hit:
            return hit
    return None


def reject_surrogates(req: BaseModel):
    """400 naming the first string (field path) that holds a lone UTF-16 surrogate."""
    hit = _walk(req, "")
    if hit:
        where, what = hit
        field = where.split(".", 1)[0]
        raise APIError(f"{where}: the text holds a lone UTF-16 surrogate ({what}), which is not valid "
                       f"Unicode text; send well-formed UTF-8", param=field)
