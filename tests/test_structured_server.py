"""Structured outputs and tool calling through the server, with the real SmolLM2 and the official
`openai` client: response_format json_schema / json_object, vLLM's structured_outputs and legacy
guided_* fields, tool_choice "required" and a named function (streamed and not), auto tool calls streamed
incrementally, and the tool-call parsers on their own."""
from __future__ import annotations

import json

import pytest

from jvllm.server.tools import ToolMode, parse_hermes, parse_llama3_json

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather of a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
             "additionalProperties": False}}}]
MSG = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    from tests.test_server import ServerProcess

    srv = ServerProcess("smollm2", str(tmp_path_factory.mktemp("so_srv") / "server.log"),
                        "--tool-call-parser", "hermes", "--enable-auto-tool-choice")
    try:
        yield openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=120), srv
    finally:
        srv.stop()
    assert "Traceback" not in srv.tail(100000), srv.tail()


def _stream_calls(stream):
    """(tool calls accumulated from delta.tool_calls, finish_reason) of a chat stream."""
    calls, fr = {}, None
    for ch in stream:
        if not ch.choices:
            continue
        c = ch.choices[0]
        for tc in c.delta.tool_calls or []:
            d = calls.setdefault(tc.index, {"name": "", "arguments": ""})
            d["name"] += tc.function.name or ""
            d["arguments"] += tc.function.arguments or ""
        fr = c.finish_reason or fr
    return [calls[i] for i in sorted(calls)], fr


def test_tool_choice_required_and_named(client):
    c, _ = client
    r = c.chat.completions.create(model="tiny", messages=MSG, tools=TOOLS, tool_choice="required",
                                  max_tokens=80, temperature=0, parallel_tool_calls=False)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls", ch
    assert len(ch.message.tool_calls) == 1
    tc = ch.message.tool_calls[0]
    assert tc.function.name in ("get_weather", "get_time") and tc.id
    args = json.loads(tc.function.arguments)
    jsonschema.validate(args, next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == tc.function.name))
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = c.chat.completions.create(model="tiny", messages=MSG, tools=TOOLS, tool_choice=named, max_tokens=60,
                                  temperature=0)
    tc = r.choices[0].message.tool_calls[0]
    assert r.choices[0].finish_reason == "stop" and tc.function.name == "get_weather"  # named: OpenAI's "stop"
    jsonschema.validate(json.loads(tc.function.arguments), WEATHER)
    # cut by max_tokens: "length" (the arguments are cut JSON), streamed or not, never "tool_calls"
    cut = c.chat.completions.create(model="tiny", messages=MSG, tools=TOOLS, tool_choice=named, max_tokens=3,
                                    temperature=0)
    assert cut.choices[0].finish_reason == "length", cut
    assert _stream_calls(c.chat.completions.create(model="tiny", messages=MSG, tools=TOOLS, tool_choice=named,
                                                   max_tokens=3, temperature=0, stream=True))[1] == "length"
    cut = c.chat.completions.create(model="tiny", messages=MSG, tools=TOOLS, tool_choice="required", max_tokens=3,
                                    temperature=0)
    assert cut.choices[0].finish_reason == "length" and not cut.choices[0].message.tool_calls, cut
    # streamed: the same calls arrive as delta.tool_calls
    calls, fr = _stream_calls(c.chat.completions.create(model="tiny", messages=MSG, tools=TOOLS,
                                                        tool_choice=named, max_tokens=60, temperature=0, stream=True))
    assert fr == "stop" and [d["name"] for d in calls] == ["get_weather"]
    assert json.loads(calls[0]["arguments"]) == json.loads(tc.function.arguments)
    calls, fr = _stream_calls(c.chat.completions.create(model="tiny", messages=MSG, tools=TOOLS,
                                                        tool_choice="required", max_tokens=80, temperature=0,
                                                        stream=True, parallel_tool_calls=False))
    assert fr == "tool_calls" and len(calls) == 1 and isinstance(json.loads(calls[0]["arguments"]), dict)


def test_auto_tool_calls_stream_incrementally(client):
    """tool_choice auto with the hermes parser, streamed: the call's id and name come first, then
    its arguments in several chunks as they are generated, and the result equals the non-streamed
    answer. (A regex makes the 135M model write a call: the parser, not the grammar, reads it.)"""
    c, _ = client
    force = {"structured_outputs": {"regex": r'Checking\.\n<tool_call>\n\{"name": "get_weather", "arguments": '
                                             r'\{"city": "[A-Z][a-z]{2,8}", "unit": "(c|f)"\}\}\n</tool_call>'}}
    kw = dict(model="tiny", messages=MSG, tools=TOOLS, max_tokens=60, temperature=0, extra_body=force)
    whole = c.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content == "Checking.\n"  # unstripped, as vLLM
    tc = whole.message.tool_calls[0]
    assert tc.function.name == "get_weather"
    jsonschema.validate(json.loads(tc.function.arguments), WEATHER)
    events, content, fr = [], "", None
    for ch in c.chat.completions.create(stream=True, **kw):
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        content += d.content or ""
        fr = ch.choices[0].finish_reason or fr
        for t in d.tool_calls or []:
            events.append((t.index, t.id, t.function.name, t.function.arguments))
    assert fr == "tool_calls" and content == whole.message.content
    assert events[0][1] and events[0][2] == "get_weather" and not events[0][3]  # id and name first
    arg_chunks = [a for i, _, _, a in events[1:] if a]
    assert all(i == 0 and tid is None and name is None for i, tid, name, _ in events[1:])
    assert len(arg_chunks) >= 4, events  # incremental, not one piece at the end
    assert json.loads("".join(arg_chunks)) == json.loads(tc.function.arguments)


def test_history_with_tool_calls_and_auto(client):
    c, _ = client
    hist = MSG + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Paris", "unit": "c"}'}}]},
                  {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"}]
    r = c.chat.completions.create(model="tiny", messages=hist, tools=TOOLS, max_tokens=12, temperature=0)
    ch = r.choices[0]  # auto: the hermes parser found no call in plain text -> content
    assert ch.finish_reason in ("stop", "length") and ch.message.content and not ch.message.tool_calls


def test_response_format_and_vllm_fields(client):
    c, _ = client
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
                                               "confidence": {"type": "integer", "minimum": 0, "maximum": 100}},
              "required": ["answer", "confidence"], "additionalProperties": False}
    r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Is water wet?"}],
                                  max_tokens=40, temperature=0.7, seed=1, n=2,
                                  response_format={"type": "json_schema",
                                                   "json_schema": {"name": "a", "schema": schema, "strict": True}})
    for ch in r.choices:
        assert ch.finish_reason == "stop"
        jsonschema.validate(json.loads(ch.message.content), schema)
    r = c.chat.completions.create(model="tiny", messages=MSG, max_tokens=30, temperature=0,
                                  response_format={"type": "json_object"})
    assert r.choices[0].message.content.startswith("{")
    r = c.completions.create(model="tiny", prompt="Answer:", max_tokens=5, temperature=1.0, seed=2,
                             extra_body={"structured_outputs": {"choice": ["alpha", "beta"]}})
    assert r.choices[0].text in ("alpha", "beta")
    r = c.completions.create(model="tiny", prompt="Year:", max_tokens=8, temperature=0,
                             extra_body={"guided_regex": r"19\d\d"})
    assert r.choices[0].text[:2] == "19" and len(r.choices[0].text) == 4
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="tiny", prompt="x", max_tokens=2, extra_body={"guided_regex": "(a"})
    assert "rejected" in e.value.body["message"]


def test_parsers():
    content, calls = parse_hermes('Sure.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n'
                                  '<tool_call>{"name": "g", "arguments": {}}</tool_call>')
    assert content == "Sure.\n" and [(t.name, json.loads(t.arguments)) for t in calls] == [("f", {"a": 1}), ("g", {})]
    assert parse_hermes("no calls") == ("no calls", [])
    assert parse_hermes("<tool_call>{broken")[1] == []
    assert parse_hermes(' \n<tool_call>{"name": "f", "arguments": {}}</tool_call>')[0] is None  # blank: null
    for kind, raw, called, want in [("auto", "stop", True, "tool_calls"), ("auto", "length", True, "length"),
                                    ("auto", "stop", False, "stop"), ("required", "stop", True, "tool_calls"),
                                    ("required", "length", False, "length"), ("named", "stop", True, "stop"),
                                    ("named", "length", True, "length")]:
        assert ToolMode(kind, name="f").finish_reason(raw, called) == want, (kind, raw, called)
    content, calls = parse_llama3_json('<|python_tag|>{"name": "f", "parameters": {"x": "y"}}; {"name": "g", '
                                       '"parameters": {}}')
    assert content is None and [t.name for t in calls] == ["f", "g"] and json.loads(calls[0].arguments) == {"x": "y"}
    assert parse_llama3_json("hello")[1] == []
    m = ToolMode("auto", parser="hermes")
    assert m.hold_from("abc") is None and m.hold_from("abc<tool") == 3 and m.hold_from("x<tool_call>{") == 1
