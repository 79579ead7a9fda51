"""tool_stream.ToolCallStream on its own: outputs fed a few characters at a time give vLLM's
delta.tool_calls sequence (per call: id + name first, then argument chunks) for the hermes and
llama3_json parsers, "required" and a named function; content stops where a call begins; an
output that turns out to hold no call is content; a cut call keeps what was streamed."""
from __future__ import annotations

import json

import pytest

from jvllm.server.tool_stream import ToolCallStream, scan
from jvllm.server.tools import ToolMode

HERMES = ToolMode("auto", parser="hermes")
LLAMA = ToolMode("auto", parser="llama3_json")


def _stream(mode, text, step=3):
    """(content, calls [{id, name, arguments, chunks}], called, deltas) of `text` fed `step`
    characters at a time (the last feed finished)."""
    st, content, calls, called, deltas = ToolCallStream(mode), "", {}, False, []
    ends = list(range(step, len(text), step)) + [len(text)]
    for k in ends:
        d, called = st.feed(text[:k], k == len(text))
        deltas.append(d)
        content += d["content"] or ""
        for tc in d.get("tool_calls", []):
            if "id" in tc:
                assert tc["index"] not in calls and tc["type"] == "function" and tc["function"]["name"]
                calls[tc["index"]] = {"id": tc["id"], "name": tc["function"]["name"], "arguments": "", "chunks": 0}
            c = calls[tc["index"]]  # a call is announced before its arguments
            if tc["function"].get("arguments"):
                c["arguments"] += tc["function"]["arguments"]
                c["chunks"] += 1
    return content, [calls[i] for i in sorted(calls)], called, deltas


def test_hermes_calls_stream_name_then_argument_chunks():
    args = {"city": 'Pa"ris', "nested": [1, {"x": "}{"}]}
    text = ('Let me check.\n<tool_call>\n' + json.dumps({"name": "get_weather", "arguments": args}) +
            '\n</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    content, calls, called, deltas = _stream(HERMES, text)
    assert called and content == "Let me check.\n"
    assert [c["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["arguments"]) == args and calls[0]["chunks"] > 5  # incremental, not whole
    assert json.loads(calls[1]["arguments"]) == {}
    assert calls[0]["id"] != calls[1]["id"]
    first = next(i for i, d in enumerate(deltas) if "tool_calls" in d)
    assert deltas[first]["content"] is None and "id" in deltas[first]["tool_calls"][0]
    assert not any(d["content"] for d in deltas[first:])  # nothing after a call begins is content


def test_llama3_json_required_and_named():
    content, calls, called, _ = _stream(LLAMA, '<|python_tag|>{"name": "f", "parameters": {"x": "y z"}}; '
                                               '{"name": "g", "parameters": {"n": 1}}')
    assert called and content == "" and [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("f", {"x": "y z"}), ("g", {"n": 1})]
    assert calls[0]["chunks"] > 1
    _, calls, called, _ = _stream(ToolMode("required"), '[{"name": "f", "parameters": {"a": [1, 2]}}, '
                                                         '{"name": "g", "parameters": {}}]', step=2)
    assert called and [(c["name"], json.loads(c["arguments"])) for c in calls] == [("f", {"a": [1, 2]}), ("g", {})]
    _, calls, called, deltas = _stream(ToolMode("named", name="h"), '{"city": "Paris", "unit": "c"}')
    assert called and calls[0]["name"] == "h" and json.loads(calls[0]["arguments"]) == {"city": "Paris", "unit": "c"}
    assert "tool_calls" in deltas[0] and calls[0]["chunks"] > 3  # the name at once, then the arguments


def test_no_call_is_content_and_a_cut_call_keeps_its_text():
    text = "I would say <tool but no, plain text."
    content, calls, called, deltas = _stream(HERMES, text)
    assert content == text and not calls and not called
    assert _stream(LLAMA, 'hello {"a": 1}')[:3] == ('hello {"a": 1}', [], False)
    # a leading '{' that is not a call: held, then content at the end
    content, calls, called, _ = _stream(LLAMA, '{"answer": 42}')
    assert content == '{"answer": 42}' and not calls and not called
    content, calls, called, _ = _stream(HERMES, 'x <tool_call>{"name": "f", "arguments": {"a": "tru')
    assert content == "x " and not called and calls[0]["name"] == "f" and calls[0]["arguments"] == '{"a": "tru'
    # keys in another order: no streaming prefix, the parser's call at the end
    content, calls, called, _ = _stream(HERMES, '<tool_call>{"arguments": {"a": 1}, "name": "f"}</tool_call>')
    assert called and [(c["name"], json.loads(c["arguments"])) for c in calls] == [("f", {"a": 1})]


@pytest.mark.parametrize("text", ['<tool_call>{"name": "f", "arguments": {"a": "}"', '<tool_call>{"name": "f'])
def test_scan_open_calls(text):
    _, calls = scan(HERMES, text)
    if text.endswith('"f'):
        assert calls == []  # the name is not closed yet: not announced
    else:
        assert calls[0].name == "f" and not calls[0].closed and calls[0].args == '{"a": "}"'
