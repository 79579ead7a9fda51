"""Tool calling for /v1/chat/completions: which tools a request offers, the constraint its
`tool_choice` asks for, and turning the generated text back into OpenAI `tool_calls`.

Contracts (vLLM's):
- `tool_choice` "none": the tools reach the chat template only; the output is plain content.
- "auto" (the default when tools are given): needs the server's `--tool-call-parser` (hermes:
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, as Qwen 2.5/3 and
  Hermes-style templates emit; llama3_json: a JSON object {"name", "parameters"} or several
  separated by ';', optionally after `<|python_tag|>`) and `--enable-auto-tool-choice`; text
  before the first call is the message content. Calls that do not parse stay content.
- "required": the output is constrained by a JSON-schema grammar to a JSON array of
  {"name": one of the tools, "parameters": that tool's parameter schema} (at most one item with
  `parallel_tool_calls: false`); a named function ({"type": "function", "function": {"name"}}):
  the output is that function's arguments object, constrained by its parameter schema. Both are
  parsed without a parser. `finish_reason` (`ToolMode.finish_reason`): "tool_calls" when calls
  came out of an "auto" or "required" output that stopped by itself; a named function keeps the
  engine's reason ("stop", as OpenAI answers), and an output cut by max_tokens stays "length"
  whatever it holds (its arguments may be cut JSON).
- Streaming: content streams as usual until a tool call may begin (`hold_from`; hermes:
  `<tool_call>`, llama3_json: a leading '{' or `<|python_tag|>`); from there `tool_stream.py`
  sends each call as `delta.tool_calls` chunks: id and name first, then the arguments' text as
  it is generated.
"""
from __future__ import annotations

import dataclasses
import json
import re
import uuid

from jvllm.sampling_params import StructuredOutputsParams
from jvllm.server.protocol import APIError

PARSERS = ("hermes", "llama3_json")


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON text
    id: str = dataclasses.field(default_factory=lambda: "chatcmpl-tool-" + uuid.uuid4().hex[:24])

    def as_openai(self, index: int | None = None) -> dict:
        d = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            d["index"] = index
        return d


@dataclasses.dataclass(frozen=True)
class ToolMode:
    """How one chat request's output is read: `kind` is "auto" (a parser reads the text),
    "required" (a JSON array of calls) or "named" (the arguments of `name`)."""
    kind: str
    parser: str | None = None
    name: str | None = None

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, tool calls) of a finished output."""
        if self.kind == "named":
            return None, [ToolCall(self.name, _compact(text))]
        if self.kind == "required":
            try:
                items = json.loads(text)
                return None, [ToolCall(i["name"], json.dumps(i.get("parameters", {}), ensure_ascii=False))
                              for i in items]
            except (ValueError, TypeError, KeyError):  # cut by max_tokens: no calls
                return text, []
        return parse_hermes(text) if self.parser == "hermes" else parse_llama3_json(text)

    def finish_reason(self, raw: str | None, called: bool) -> str | None:
        """The choice's finish_reason given the engine's `raw` one and whether calls came out."""
        return "tool_calls" if called and raw == "stop" and self.kind != "named" else raw

    def hold_from(self, text: str) -> int | None:
        """Streaming: the index from which `text` (the output so far) may be a tool call and is
        held back, or None to stream it all."""
        if self.kind != "auto":
            return 0
        if self.parser == "hermes":
            i = text.find("<tool_call>")
            if i >= 0:
                return i
            for k in range(min(len(text), len("<tool_call>") - 1), 0, -1):  # a partial tag at the end
                if "<tool_call>".startswith(text[-k:]):
                    return len(text) - k
            return None
        s = text.lstrip()
        if not s or s[0] == "{" or s.startswith("<|python_tag|>") or "<|python_tag|>".startswith(s):
            return 0
        return None


def _compact(text: str) -> str:
    try:
        return json.dumps(json.loads(text), ensure_ascii=False)
    except ValueError:
        return text


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def _call(obj, args_key: str) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


def parse_hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    i = text.find("<tool_call>")
    if i < 0:
        return text, []
    calls = []
    for m in _HERMES.finditer(text, i):
        try:
            c = _call(json.loads(m.group(1)), "arguments")
        except ValueError:
            c = None
        if c is None:
            return text, []
        calls.append(c)
    content = text[:i]  # unstripped, as vLLM's hermes parser (and as the stream sent it)
    return (content if content.strip() else None), calls


def parse_llama3_json(text: str) -> tuple[str | None, list[ToolCall]]:
    s = text.strip()
    if s.startswith("<|python_tag|>"):
        s = s[len("<|python_tag|>"):].strip()
    if not s.startswith("{"):
        return text, []
    dec, calls, pos = json.JSONDecoder(), [], 0
    try:
        while pos < len(s):
            obj, end = dec.raw_decode(s, pos)
            c = _call(obj, "parameters")
            if c is None:
                return text, []
            calls.append(c)
            pos = end
            while pos < len(s) and s[pos] in " \n\t;":
                pos += 1
    except ValueError:
        return text, []
    return None, calls


def _functions(tools) -> dict[str, dict]:
    out = {}
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(f, dict) \
                or not isinstance(f.get("name"), str):
            raise APIError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., 'parameters': "
                           f"{{...}}}}}}", param="tools")
        params = f.get("parameters", {"type": "object"})
        if not isinstance(params, dict):
            raise APIError(f"tools[{i}].function.parameters must be a JSON schema object", param="tools")
        out[f["name"]] = params
    return out


def tool_mode(req, parser: str | None, auto_enabled: bool) -> tuple[ToolMode | None, StructuredOutputsParams | None]:
    """(how to read the output, the constraint it needs) of a chat request; (None, None) when no
    tool calls can come out. APIError(400) for a tool_choice the server cannot serve."""
    tools, choice = req.tools, req.tool_choice
    if not tools:
        if choice is not None and choice != "none":
            raise APIError(f"tool_choice {choice!r} needs tools", param="tool_choice")
        return None, None
    fns = _functions(tools)
    choice = "auto" if choice is None else choice
    if choice == "none":
        return None, None
    if choice == "auto":
        if parser is None or not auto_enabled:
            raise APIError("tool_choice 'auto' needs the server started with --enable-auto-tool-choice and "
                           "--tool-call-parser (or send tool_choice 'required', a named function, or 'none')",
                           param="tool_choice")
        return ToolMode("auto", parser=parser), None
    if choice == "required":
        items = {"anyOf": [{"type": "object", "properties": {"name": {"const": n}, "parameters": p},
                            "required": ["name", "parameters"], "additionalProperties": False}
                           for n, p in fns.items()]}
        schema = {"type": "array", "items": items, "minItems": 1}
        if req.parallel_tool_calls is False:
            schema["maxItems"] = 1
        return ToolMode("required"), StructuredOutputsParams(json=schema)
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
        if not isinstance(name, str):
            raise APIError("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': "
                           "{'name': ...}}", param="tool_choice")
        if name not in fns:
            raise APIError(f"tool_choice names the function {name!r}, which is not among the tools "
                           f"{sorted(fns)}", param="tool_choice")
        return ToolMode("named", name=name), StructuredOutputsParams(json=fns[name])
    raise APIError(f"tool_choice {choice!r} is not one of 'none', 'auto', 'required' or a named function",
                   param="tool_choice")


def history_tool_calls(tool_calls: list) -> list:
    """Assistant `tool_calls` of the history as chat templates read them: arguments as a dict
    (OpenAI sends a JSON string), both under `function` and at the top (templates differ)."""
    out = []
    for tc in tool_calls:
        tc = dict(tc)
        f = dict(tc.get("function") or {})
        if isinstance(f.get("arguments"), str):
            try:
                f["arguments"] = json.loads(f["arguments"])
            except ValueError:
                pass
        tc["function"] = f
        tc.setdefault("name", f.get("name"))
        tc.setdefault("arguments", f.get("arguments"))
        out.append(tc)
    return out
