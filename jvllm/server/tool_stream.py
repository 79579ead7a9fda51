"""Streaming tool calls: one chat choice's output, read as it grows, becomes OpenAI
`delta.tool_calls` chunks as vLLM sends them: per call first {index, id, type, function: {name,
arguments: ""}} once the name is complete, then {index, function: {arguments: chunk}} as the
arguments' JSON text is generated.

Contracts:
- Where calls sit (`ToolMode.kind` / parser): hermes, after each `<tool_call>`; llama3_json, from
  the start (after an optional `<|python_tag|>`), calls separated by ';'; "required", the items of
  the JSON array; "named", the whole output is the arguments of the named function.
- A call is `{"name": "...", "arguments" | "parameters": VALUE}` with the name first. The
  arguments chunks are the model's own text of VALUE (not re-serialized), so their concatenation
  is VALUE exactly as generated; it parses as JSON once the call is complete. A call whose keys
  come in another order is sent whole at the end (from `ToolMode.parse`).
- Content: text before the first possible call streams as content (hermes: up to `<tool_call>`,
  or a partial tag at the end, which is held); nothing after a call begins is content.
- At the end (`finished`): `ToolMode.parse(text)` decides. Calls it finds that were not announced
  yet are sent whole; announced ones get the rest of their arguments. `called` says whether the
  final parse found calls (the finish_reason becomes "tool_calls"). What was streamed cannot be
  taken back: an output cut by max_tokens in the middle of a call leaves that call's arguments
  incomplete, as in vLLM.
"""
from __future__ import annotations

import dataclasses
import json
import re

from jvllm.server.tools import ToolCall, ToolMode

_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_ARGS = re.compile(r'\s*,\s*"(?:arguments|parameters)"\s*:\s*')
_TAG = "<tool_call>"
_PYTAG = "<|python_tag|>"


@dataclasses.dataclass
class _Scanned:
    """One call as far as the text goes: its name (None until its closing quote), the text of its
    arguments so far, whether that value is closed, and where the call's text ends."""
    name: str | None = None
    args: str = ""
    closed: bool = False
    end: int = 0


def _value_end(text: str, start: int) -> int | None:
    """The end of the JSON object / array starting at `start`, or None while it is open (a
    scalar value: None, it is sent at the end)."""
    if start >= len(text) or text[start] not in "{[":
        return None
    depth, in_str, esc = 0, False, False
    for i in range(start, len(text)):
        c = text[i]
        if in_str:
            if esc:
                esc = False
            elif c == "\\":
                esc = True
            elif c == '"':
                in_str = False
        elif c == '"':
            in_str = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def _scan_call(text: str, start: int) -> _Scanned | None:
    """The call whose object starts at `start` (after whitespace), or None if the text there is
    not (yet) `{"name": "...`."""
    m = _NAME.match(text, start)
    if m is None:
        return None
    try:
        name = json.loads('"' + m.group(1) + '"')
    except ValueError:
        return None
    c = _Scanned(name=name, end=m.end())
    a = _ARGS.match(text, m.end())
    if a is None:
        return c
    end = _value_end(text, a.end())
    if end is None:
        rest = text[a.end():]
        c.args = rest if rest[:1] in ("{", "[") else ""
        c.end = len(text)
        return c
    c.args, c.closed = text[a.end():end], True
    close = re.compile(r"\s*\}").match(text, end)
    c.end = close.end() if close else end
    return c


def _scan_sequence(text: str, pos: int, sep: str) -> list[_Scanned]:
    """Calls one after another from `pos`, separated by whitespace and `sep` characters."""
    out = []
    while True:
        c = _scan_call(text, pos)
        if c is None:
            return out
        out.append(c)
        if not c.closed:
            return out
        pos = c.end
        while pos < len(text) and (text[pos].isspace() or text[pos] in sep):
            pos += 1


def scan(mode: ToolMode, text: str) -> tuple[int, list[_Scanned]]:
    """(how much of `text` may stream as content, the calls in it so far)."""
    if mode.kind == "named":
        end = _value_end(text, len(text) - len(text.lstrip()))
        s = text.lstrip()
        return 0, [_Scanned(name=mode.name, args=s if end is None else text[len(text) - len(s):end],
                            closed=end is not None, end=len(text) if end is None else end)]
    if mode.kind == "required":
        s = text.lstrip()
        return 0, (_scan_sequence(text, len(text) - len(s) + 1, ",") if s.startswith("[") else [])
    hold = mode.hold_from(text)
    if mode.parser == "hermes":
        calls, i = [], text.find(_TAG)
        while i >= 0:
            c = _scan_call(text, i + len(_TAG))
            if c is None:
                break
            calls.append(c)
            if not c.closed:
                break
            i = text.find(_TAG, c.end)
        return (len(text) if hold is None else hold), calls
    if hold is None:  # llama3_json: plain content
        return len(text), []
    s = text.lstrip()
    pos = len(text) - len(s)
    if s.startswith(_PYTAG):
        pos += len(_PYTAG)
    return 0, _scan_sequence(text, pos, ";")


@dataclasses.dataclass
class _Sent:
    id: str
    args: str = ""  # the argument text streamed so far


class ToolCallStream:
    """One choice's streaming state: `feed(text, finished)` -> (delta, called)."""

    def __init__(self, mode: ToolMode):
        self.mode = mode
        self.content_len = 0
        self.sent: list[_Sent] = []

    def feed(self, text: str, finished: bool) -> tuple[dict, bool]:
        """The chunk delta for the output `text` so far: {"content": new content or None, and
        "tool_calls": [...] only when some call moved}; and whether the final parse found calls
        (False until `finished`)."""
        content_end, scanned = scan(self.mode, text)
        if self.sent:  # content only flows before the first call
            content_end = self.content_len
        deltas, called = [], False
        if finished:
            _, calls = self.mode.parse(text)
            called = bool(calls)
            if not calls and not self.sent:
                content_end = len(text)  # no call after all: the held text is content
            if not calls:  # calls already announced get the rest of their text (cut, unparsable)
                scanned, calls = scanned[:len(self.sent)], []
                for i, sc in enumerate(scanned):
                    deltas += self._advance(i, sc.name, sc.args)
            for i, final in enumerate(calls):
                sc = scanned[i] if i < len(scanned) else None
                use_scan = sc is not None and sc.closed and sc.name == final.name
                deltas += self._advance(i, final.name, sc.args if use_scan else final.arguments)
        else:
            for i, sc in enumerate(scanned):
                if sc.name is None:
                    break
                deltas += self._advance(i, sc.name, sc.args)
        new = text[self.content_len:content_end] if content_end > self.content_len else ""
        self.content_len += len(new)
        delta = {"content": new or (None if deltas else "")}
        if deltas:
            delta["tool_calls"] = deltas
        return delta, called

    def _advance(self, i: int, name: str, args: str) -> list[dict]:
        """Deltas that bring call `i` to (`name`, `args`): its announcement (once), then the new
        argument text. Text that does not extend what was streamed (the parser's normalized
        arguments after raw ones went out) sends nothing: a stream cannot take text back."""
        out = []
        if i == len(self.sent):
            self.sent.append(_Sent(ToolCall(name, "").id))
            out.append({"index": i, "id": self.sent[i].id, "type": "function",
                        "function": {"name": name, "arguments": ""}})
        s = self.sent[i]
        if args.startswith(s.args) and len(args) > len(s.args):
            new, s.args = args[len(s.args):], args
            if out:
                out[0]["function"]["arguments"] = new
            else:
                out.append({"index": i, "function": {"arguments": new}})
        return out
