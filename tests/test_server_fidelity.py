"""vLLM fidelity and hardening of the server, in process, against the fake engine of
test_server_unit.py with SmolLM2's real tokenizer (no JAX compile): known-but-unimplemented fields,
unknown fields, chat templates, tools, lone surrogates, CORS, echo with logprobs, vLLM's metric
names, admission by sequences, generic 500s, the drain timeout, the prompt character cap and
tokenization that does not hold up other requests.

`python -m tests.test_server_fidelity PORT DRAIN_TIMEOUT` serves a fake-engine app through
jvllm's own uvicorn runner (the SIGTERM test starts it)."""
from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
from fastapi.testclient import TestClient  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from jvllm.server.app import build_app  # noqa: E402
from jvllm.server.chat import load_chat_template  # noqa: E402
from jvllm.server.middleware import CorsConfig  # noqa: E402
from jvllm.server.render import CHARS_PER_TOKEN_BOUND, Limits  # noqa: E402
from tests.test_server_unit import FakeEngine, sse  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
C, CH, TOK = "/v1/completions", "/v1/chat/completions", "/tokenize"
MSG = [{"role": "user", "content": "hi"}]
TEMPLATE = ("{% for t in tools or [] %}TOOL:{{ t.function.name }}\n{% endfor %}"
            "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}{{ greeting | default('') }}")


@pytest.fixture(scope="module")
def tokenizer():
    transformers = pytest.importorskip("transformers")
    from tests.helpers import smollm2_tokenizer_dir

    return transformers.AutoTokenizer.from_pretrained(smollm2_tokenizer_dir())


def make_app(tokenizer, **kw):
    eng = FakeEngine(max_model_len=kw.pop("max_model_len", 256), max_num_seqs=kw.pop("max_num_seqs", 4),
                     tokenizer=kw.pop("tok", tokenizer))
    eng.model_config.vocab_size = 49152  # SmolLM2's
    return eng, build_app(eng, "fake", **kw)


@pytest.fixture(scope="module")
def fake(tokenizer):
    """(engine, client) of one app with a server template and trusted request templates."""
    eng, app = make_app(tokenizer, chat_template=TEMPLATE, trust_request_chat_template=True)
    with TestClient(app) as c:
        yield eng, c


def assert_error(r, status, param, *words):
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert err["code"] == status and err["param"] == param, err
    for w in words:
        assert w in err["message"], (w, err)
    return err


# ---------------------------------------------------------------------- fields
UNIMPLEMENTED = [
    (CH, {"structural_tag": "x"}, "structural_tag"),
    (CH, {"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend"),
    (CH, {"use_beam_search": True}, "use_beam_search"),
    (CH, {"reasoning_effort": "low"}, "reasoning_effort"),
    (CH, {"functions": [{"name": "f"}]}, "functions"),
    (C, {"priority": 3}, "priority"),
    (C, {"cache_salt": "s"}, "cache_salt"),
]


@pytest.mark.parametrize("path,extra,field", UNIMPLEMENTED, ids=[f"{p[4:8]}-{f}" for p, _, f in UNIMPLEMENTED])
def test_unimplemented_fields_are_400(fake, path, extra, field):
    _, c = fake
    base = {"messages": MSG} if path == CH else {"prompt": "hi"}
    assert_error(c.post(path, json={**base, "max_tokens": 1, **extra}), 400, field, field, "not supported")


def test_neutral_values_and_unknown_fields(fake, caplog):
    eng, c = fake
    ok = [{"response_format": {"type": "text"}}, {"tool_choice": "none"}, {"use_beam_search": False},
          {"guided_json": None}, {"priority": 0}, {"tools": [{"type": "function", "function": {"name": "f"}}],
                                                   "tool_choice": "none", "parallel_tool_calls": False}]
    for extra in ok:
        r = c.post(CH, json={"messages": MSG, "max_tokens": 1, **extra})
        assert r.status_code == 200, (extra, r.text)
    with caplog.at_level(logging.WARNING, logger="jvllm.server"):
        r = c.post(C, json={"prompt": "hi", "max_tokens": 1, "frobnicate": 3, "store": True})
    assert r.status_code == 200
    warned = [rec.getMessage() for rec in caplog.records if "ignored" in rec.getMessage()]
    assert len(warned) == 1 and "frobnicate" in warned[0] and "store" in warned[0], warned
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="jvllm.server"):
        msgs = [{"role": "user", "content": [{"type": "text", "text": "x", "cache_control": {}}], "weird": 1}]
        r = c.post(CH, json={"messages": msgs, "max_tokens": 1, "stream": True,
                             "stream_options": {"include_usage": True, "later": 1}})
    assert r.status_code == 200
    warned = [rec.getMessage() for rec in caplog.records if "ignored" in rec.getMessage()]
    assert len(warned) == 1, warned
    for path in ("messages.0.weird", "messages.0.content.0.cache_control", "stream_options.later"):
        assert path in warned[0], (path, warned)


# ---------------------------------------------------------------------- vLLM's sampling extras
def _recording(eng, monkeypatch):
    """[(prompt dict, SamplingParams)] of every request the app hands the engine."""
    seen = []
    orig = eng.add_request

    def add(rid, prompt, params, arrival_time=None):
        seen.append((prompt, params))
        return orig(rid, prompt, params, arrival_time)

    monkeypatch.setattr(eng, "add_request", add)
    return seen


def test_sampling_extras_are_forwarded(fake, monkeypatch, tokenizer):
    eng, c = fake
    seen = _recording(eng, monkeypatch)
    body = {"prompt": "hi", "max_tokens": 1, "allowed_token_ids": [5, 6], "bad_words": ["x"], "n": 2, "best_of": 3}
    r = c.post(C, json=body)
    assert r.status_code == 200, r.text
    sp = seen[-1][1]
    assert (sp.allowed_token_ids, sp.bad_words, sp.n, sp.best_of) == ([5, 6], ["x"], 2, 3)
    r = c.post(CH, json={"messages": MSG, "max_tokens": 1, "best_of": 2})
    assert r.status_code == 200, r.text
    assert seen[-1][1].best_of == 2
    # truncate_prompt_tokens: the last k tokens reach the engine (completions and chat)
    ids = list(range(100, 120))
    r = c.post(C, json={"prompt": ids, "max_tokens": 1, "truncate_prompt_tokens": 4})
    assert r.status_code == 200 and seen[-1][0]["prompt_token_ids"] == ids[-4:]
    r = c.post(C, json={"prompt": ids * 20, "max_tokens": 1, "truncate_prompt_tokens": -1})  # 400 > 256
    assert r.status_code == 200 and seen[-1][0]["prompt_token_ids"] == (ids * 20)[-255:]
    r = c.post(CH, json={"messages": [{"role": "user", "content": "one two three four five six"}],
                         "max_tokens": 1, "truncate_prompt_tokens": 3})
    assert r.status_code == 200, r.text
    assert len(seen[-1][0]["prompt_token_ids"]) == 3
    assert seen[-1][0]["prompt"] == tokenizer.decode(seen[-1][0]["prompt_token_ids"])


@pytest.mark.parametrize("path,extra,field,words", [
    (C, {"n": 2, "best_of": 1}, "best_of", [">= n (2)"]),
    (C, {"best_of": 17}, "best_of", ["--max-n"]),
    (CH, {"best_of": 3, "stream": True}, "best_of", ["streamed"]),
    (C, {"best_of": 3, "temperature": 0}, "best_of", ["greedy"]),
    (C, {"allowed_token_ids": [1, 49152]}, "allowed_token_ids", ["49152", "vocabulary"]),
    (C, {"truncate_prompt_tokens": 0}, "truncate_prompt_tokens", ["-1"]),
    (CH, {"truncate_prompt_tokens": 300}, "truncate_prompt_tokens", ["256"]),
], ids=lambda v: str(v)[:24])
def test_sampling_extras_bad_values(fake, path, extra, field, words):
    _, c = fake
    base = {"messages": MSG} if path == CH else {"prompt": "hi"}
    assert_error(c.post(path, json={**base, "max_tokens": 1, **extra}), 400, field, *words)


# ---------------------------------------------------------------------- chat templates, tools
def test_server_template_tools_and_kwargs(fake):
    eng, c = fake
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    r = c.post(CH, json={"messages": MSG, "max_tokens": 1, "tools": tools, "tool_choice": "none",
                         "chat_template_kwargs": {"greeting": "HELLO"}})
    assert r.status_code == 200, r.text
    assert eng.prompts[-1] == "TOOL:get_weather\n<user>hi\nHELLO"
    r = c.post(CH, json={"messages": [{"role": "developer", "content": "sys"}, *MSG], "max_tokens": 1})
    assert r.status_code == 200 and eng.prompts[-1] == "<system>sys\n<user>hi\n"
    r = c.post(CH, json={"messages": MSG, "max_tokens": 1, "chat_template": "[{{ messages[0].content }}]"})
    assert r.status_code == 200 and eng.prompts[-1] == "[hi]"
    tok = c.post(TOK, json={"messages": MSG, "chat_template": "[{{ messages[0].content }}]",
                            "add_generation_prompt": False}).json()
    assert c.post("/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"] == "[hi]"
    tok = c.post(TOK, json={"messages": MSG, "tools": tools, "add_generation_prompt": False}).json()
    assert c.post("/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"] == "TOOL:get_weather\n<user>hi\n"
    assert_error(c.post(CH, json={"messages": MSG, "chat_template_kwargs": {"tokenize": True}}), 400,
                 "chat_template_kwargs", "tokenize")
    assert_error(c.post(CH, json={"messages": MSG, "chat_template": "{% if %}"}), 400, "chat_template",
                 "chat template failed")
    assert_error(c.post(CH, json={"messages": MSG, "chat_template_kwargs": [1]}), 400, "chat_template_kwargs")


def test_request_template_needs_trust_and_tokenizer_template_is_default(tokenizer):
    eng, app = make_app(tokenizer)
    with TestClient(app) as c:
        assert_error(c.post(CH, json={"messages": MSG, "chat_template": "{{ 1 }}"}), 400, "chat_template",
                     "--trust-request-chat-template")
        assert c.post(CH, json={"messages": MSG, "max_tokens": 1}).status_code == 200
        assert eng.prompts[-1] == tokenizer.apply_chat_template(MSG, tokenize=False, add_generation_prompt=True)


class BosTokenizer:
    """SmolLM2's tokenizer plus a BOS (id 0) when asked for special tokens (SmolLM2 adds none)."""

    def __init__(self, tok):
        self._tok = tok

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def __call__(self, text, add_special_tokens=True, **kw):
        out = self._tok(text, add_special_tokens=False, **kw)
        return {"input_ids": ([0] if add_special_tokens else []) + list(out["input_ids"])}


def test_tokenize_special_tokens(tokenizer):
    """/tokenize: prompts add special tokens unless told not to; messages add them only when asked
    (vLLM's chat default is False: the template writes them)."""
    _, app = make_app(tokenizer, tok=BosTokenizer(tokenizer))
    with TestClient(app) as c:
        assert c.post(TOK, json={"prompt": "hi"}).json()["tokens"][0] == 0
        assert c.post(TOK, json={"prompt": "hi", "add_special_tokens": False}).json()["tokens"][0] != 0
        plain = c.post(TOK, json={"messages": MSG}).json()["tokens"]
        assert plain[0] != 0 and c.post(TOK, json={"messages": MSG, "add_special_tokens": None}).json()["tokens"] == plain
        assert c.post(TOK, json={"messages": MSG, "add_special_tokens": True}).json()["tokens"] == [0] + plain


def test_load_chat_template(tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text(TEMPLATE)
    assert load_chat_template(str(f)) == TEMPLATE
    assert load_chat_template("{{ messages }}") == "{{ messages }}"
    assert load_chat_template(None) is None
    with pytest.raises(ValueError, match="no/such/file.jinja"):
        load_chat_template("no/such/file.jinja")
    (tmp_path / "empty").write_text("  ")
    with pytest.raises(ValueError, match="empty"):
        load_chat_template(str(tmp_path / "empty"))


# ---------------------------------------------------------------------- lone surrogates
SURROGATE = [
    (CH, {"messages": [{"role": "user", "content": "emoji \ud83d cut"}]}, "messages", "messages.0.content"),
    (CH, {"messages": [{"role": "user", "content": [{"type": "text", "text": "x\ude00"}]}]}, "messages",
     "messages.0.content.0.text"),
    (C, {"prompt": ["fine", "bad \ud800"]}, "prompt", "prompt.1"),
    (C, {"prompt": "hi", "stop": ["\udfff"]}, "stop", "stop.0"),
    (C, {"prompt": "hi", "model": "m\ud83d"}, "model", "model"),
    (C, {"prompt": "hi", "unknown\ud83d": 1}, None, "a field name"),
    (TOK, {"prompt": "\ud83d"}, "prompt", "prompt"),
    (TOK, {"messages": [{"role": "user", "content": "\ud83d"}]}, "messages", "messages.0.content"),
]


@pytest.mark.parametrize("path,body,param,where", SURROGATE, ids=[w for *_, w in SURROGATE])
def test_lone_surrogates_are_400(fake, path, body, param, where):
    _, c = fake
    r = c.post(path, content=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    err = assert_error(r, 400, param)
    # constrained strings (stop) are refused by pydantic itself ("unable to parse ... unicode string")
    assert "surrogate" in err["message"] or "unicode string" in err["message"], err
    assert err["message"].startswith(where.split("\\")[0]), err
    assert c.post(C, json={"prompt": "ok \U0001F600", "max_tokens": 1}).status_code == 200


# ---------------------------------------------------------------------- CORS
def test_cors(tokenizer):
    pre = {"Origin": "http://app.example", "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization,content-type"}
    _, app = make_app(tokenizer, api_key="k")
    with TestClient(app) as c:  # vLLM's defaults: any origin; preflight needs no key
        r = c.options(C, headers=pre)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
        r = c.post(C, json={"prompt": "hi"}, headers={"Origin": "http://app.example"})
        assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "*"
    cors = CorsConfig(allowed_origins=["http://app.example"], allowed_methods=["POST"],
                      allowed_headers=["authorization", "content-type"], allow_credentials=True)
    _, app = make_app(tokenizer, cors=cors)
    with TestClient(app) as c:
        r = c.options(C, headers=pre)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://app.example"
        assert r.headers["access-control-allow-credentials"] == "true"
        assert c.options(C, headers={**pre, "Origin": "http://evil.example"}).status_code == 400
        assert c.options(C, headers={**pre, "Access-Control-Request-Method": "DELETE"}).status_code == 400
        r = c.post(C, json={"prompt": "hi", "max_tokens": 1}, headers={"Origin": "http://evil.example"})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    for bad in (dict(allowed_origins="*"), dict(allowed_methods=[""]), dict(allow_credentials="yes")):
        with pytest.raises(ValueError, match="allow"):
            CorsConfig(**bad)


def test_cors_and_template_flags():
    import argparse

    from jvllm.server import cli as server_cli

    p = argparse.ArgumentParser()
    server_cli.register(p.add_subparsers())
    a = p.parse_args(["serve", "m", "--allowed-origins", '["http://a"]', "--allow-credentials", "--chat-template",
                      "{{ x }}", "--trust-request-chat-template", "--max-prompt-chars", "99"])
    assert a.allowed_origins == ["http://a"] and a.allow_credentials and a.trust_request_chat_template
    assert a.chat_template == "{{ x }}" and a.max_prompt_chars == 99 and a.allowed_methods == ["*"]
    with pytest.raises(SystemExit):
        p.parse_args(["serve", "m", "--allowed-headers", "*"])


def test_bad_serve_flags_exit_before_loading():
    for flags, words in ((["--chat-template", "no/such.jinja"], "no/such.jinja"),
                         (["--allowed-origins", "*"], "JSON list"), (["--max-prompt-chars", "0"], ">= 1")):
        p = subprocess.run([sys.executable, "-m", "jvllm.cli", "serve", "no-such-model", *flags], cwd=ROOT,
                           capture_output=True, text=True, timeout=120, env=dict(os.environ, JAX_PLATFORMS="cpu"))
        assert p.returncode != 0 and words in p.stderr and flags[0] in p.stderr, (flags, p.stderr[-2000:])


# ---------------------------------------------------------------------- echo + logprobs
def test_echo_with_logprobs(fake, tokenizer):
    _, c = fake
    ids = tokenizer("The cat sat", add_special_tokens=False)["input_ids"]
    text = tokenizer.decode(ids)
    r = c.post(C, json={"prompt": ids, "echo": True, "logprobs": 1, "max_tokens": 2}).json()
    ch = r["choices"][0]
    assert ch["text"] == text + "aa"
    lp = ch["logprobs"]
    n = len(ids)
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == n + 2
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:n] == [-1.0] * (n - 1) and lp["token_logprobs"][n:] == [-0.5, -0.5]
    assert lp["tokens"][0] == tokenizer.decode(ids[:1]) and lp["tokens"][n:] == ["a", "a"]
    assert lp["text_offset"][0] == 0 and lp["text_offset"][n:] == [len(text), len(text) + 1]
    # streamed: the echo chunk carries the prompt's logprobs, then the generated tokens follow
    with c.stream("POST", C, json={"prompt": ids, "echo": True, "logprobs": 1, "max_tokens": 2,
                                   "stream": True}) as s:
        ev = [json.loads(e) for e in sse(s)[:-1]]
    first = ev[0]["choices"][0]
    assert first["text"] == text and first["logprobs"]["token_logprobs"][1:] == [-1.0] * (n - 1)
    gen = [e["choices"][0] for e in ev[1:]]
    assert "".join(g["text"] for g in gen) == "aa"
    assert [o for g in gen for o in g["logprobs"]["text_offset"]] == [len(text), len(text) + 1]
    # echo without logprobs: no prompt logprobs asked of the engine
    r = c.post(C, json={"prompt": ids, "echo": True, "max_tokens": 1}).json()
    assert r["choices"][0]["logprobs"] is None and r["choices"][0]["prompt_logprobs"] is None
    # tokens cut inside UTF-8 characters: one rising offset list, the same streamed or not
    wide = "🎉🐉你好"
    r = c.post(C, json={"prompt": wide, "echo": True, "logprobs": 1, "max_tokens": 3}).json()
    offs = r["choices"][0]["logprobs"]["text_offset"]
    assert offs == sorted(offs) and len(offs) == len(tokenizer(wide, add_special_tokens=False)["input_ids"]) + 3
    with c.stream("POST", C, json={"prompt": wide, "echo": True, "logprobs": 1, "max_tokens": 3, "stream": True}) as s:
        ev = [json.loads(e)["choices"][0]["logprobs"]["text_offset"] for e in sse(s)[:-1]]
    assert [o for e in ev for o in e] == offs


def test_continuous_usage_stats(fake):
    _, c = fake
    body = {"prompt": [1, 2, 3], "max_tokens": 3, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with c.stream("POST", C, json=body) as s:
        ev = [json.loads(e) for e in sse(s)[:-1]]
    assert [e["usage"]["completion_tokens"] for e in ev] == [1, 2, 3, 3] and ev[-1]["choices"] == []
    assert all(e["usage"]["prompt_tokens"] == 3 for e in ev)
    # chat, n=2: each chunk counts its own choice (vLLM's), the role chunks 0
    with c.stream("POST", CH, json={"messages": MSG, "max_tokens": 2, "stream": True, "n": 2, **{
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}}) as s:
        ev = [json.loads(e) for e in sse(s)[:-1]]
    per = {}
    for e in ev[:-1]:
        per.setdefault(e["choices"][0]["index"], []).append(e["usage"]["completion_tokens"])
    assert per == {0: [0, 1, 2], 1: [0, 1, 2]} and ev[-1]["usage"]["completion_tokens"] == 4, ev
    with c.stream("POST", CH, json={"messages": MSG, "max_tokens": 2, "stream": True,
                                    "stream_options": {"include_usage": True}}) as s:
        ev = [json.loads(e) for e in sse(s)[:-1]]
    assert all(e["usage"] is None for e in ev[:-1]) and ev[-1]["usage"]["completion_tokens"] == 2


# ---------------------------------------------------------------------- metrics
def test_vllm_metric_names(fake):
    _, c = fake
    before = metric_values(c)
    for p in ([1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11]):
        assert c.post(C, json={"prompt": p, "max_tokens": 3}).status_code == 200
    m = metric_values(c)
    assert m["vllm:prefix_cache_queries_total"] - before.get("vllm:prefix_cache_queries_total", 0) == 11
    assert m["vllm:prefix_cache_hits_total"] - before.get("vllm:prefix_cache_hits_total", 0) == 4
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prompt_tokens_total",
                 "generation_tokens_total", "time_to_first_token_seconds_count",
                 "inter_token_latency_seconds_count", "e2e_request_latency_seconds_count",
                 "prefix_cache_queries_total", "prefix_cache_hits_total", "e2e_request_latency_seconds_sum"):
        assert m["vllm:" + name] == m["jvllm:" + name], name
    assert m["vllm:inter_token_latency_seconds_count"] - before.get("vllm:inter_token_latency_seconds_count", 0) == 4
    text = c.get("/metrics").text
    assert 'vllm:num_requests_running{model_name="fake"}' in text
    assert 'vllm:request_success_total{finished_reason="length",model_name="fake"}' in text
    assert m["vllm:time_per_output_token_seconds_count"] == m["jvllm:time_per_output_token_seconds_count"] > 0
    assert m["vllm:num_preemptions_total"] == m["jvllm:num_preemptions_total"]
    assert 'vllm:time_to_first_token_seconds_bucket{le="0.001",model_name="fake"}' in text


def metric_values(c) -> dict:
    out = {}
    for fam in text_string_to_metric_families(c.get("/metrics").text):
        for s in fam.samples:
            if set(s.labels) <= {"model_name"}:
                out[s.name] = s.value
    return out


# ---------------------------------------------------------------------- admission, errors
def test_admission_counts_sequences(tokenizer):
    eng, app = make_app(tokenizer, max_num_seqs=1, max_queue_len=2)  # capacity: 3 sequences
    with TestClient(app) as c:
        with c.stream("POST", C, json={"prompt": [1], "max_tokens": 60, "n": 3, "stream": True}) as s:
            lines = s.iter_lines()
            assert next(lines).startswith("data: ")
            assert app.state.aengine.num_admitted == 3
            r = c.post(C, json={"prompt": [1], "max_tokens": 1})
            assert r.status_code == 503 and "sequences" in r.json()["error"]["message"]
        t0 = time.time()
        while app.state.aengine.num_admitted and time.time() - t0 < 5:
            time.sleep(0.01)
        assert app.state.aengine.num_admitted == 0
        assert_error(c.post(C, json={"prompt": [1], "n": 4, "max_tokens": 1}), 400, "n", "4 sequences", "3")
        assert_error(c.post(C, json={"prompt": [[1], [2]], "n": 2, "max_tokens": 1}), 400, "n", "4 sequences")
        assert c.post(C, json={"prompt": [[1], [2], [3]], "max_tokens": 1}).status_code == 200


class _Boom(FakeEngine):
    def add_request(self, *a, **kw):
        raise RuntimeError("secret internal detail /home/x")


def test_internal_error_is_generic_and_logged(tokenizer, caplog):
    app = build_app(_Boom(tokenizer=tokenizer), "fake")
    with TestClient(app, raise_server_exceptions=False) as c, caplog.at_level(logging.ERROR, "jvllm.server"):
        r = c.post(C, json={"prompt": [1, 2], "max_tokens": 1})
    assert r.status_code == 500, r.text
    msg = r.json()["error"]["message"]
    rid = r.headers["x-request-id"]
    assert "secret" not in msg and rid in msg and rid.startswith("err-")
    logged = [rec for rec in caplog.records if rid in rec.getMessage()]
    assert logged and "secret internal detail" in str(logged[0].exc_info[1])


# ---------------------------------------------------------------------- drain timeout
def test_drain_timeout_ends_requests_cleanly(tokenizer):
    eng, app = make_app(tokenizer, max_model_len=10000)
    eng.step_delay = 0.01
    with TestClient(app) as c:
        full: dict = {}
        t = threading.Thread(target=lambda: full.update(r=c.post(C, json={"prompt": [1], "max_tokens": 5000})))
        with c.stream("POST", C, json={"prompt": [2], "max_tokens": 5000, "stream": True}) as s:
            lines = s.iter_lines()
            assert next(lines).startswith("data: ")
            t.start()
            time.sleep(0.2)
            app.state.aengine.begin_drain(0.3)  # what SIGTERM does (jvllm.server.cli)
            ev = [line[6:] for line in lines if line.startswith("data: ")]
        t.join(10)
        assert ev[-1] == "[DONE]"
        err = json.loads(ev[-2])["error"]
        assert err["code"] == 503 and "drain-timeout" in err["message"]
        assert_error(full["r"], 503, None, "drain-timeout")
        t0 = time.time()
        while eng.reqs and time.time() - t0 < 5:  # aborts reach the engine thread between its steps
            time.sleep(0.01)
        assert app.state.aengine.num_admitted == 0 and not eng.reqs and len(eng.aborted) == 2


def _serve_main(port: int, drain: float):
    """The subprocess side of test_sigterm_past_drain_timeout."""
    from jvllm.server.cli import serve_app

    eng = FakeEngine(max_model_len=100000)
    eng.step_delay = 0.01
    serve_app(build_app(eng, "fake"), "127.0.0.1", port, drain_timeout=drain, log_level="warning")


def test_sigterm_past_drain_timeout(tmp_path):
    from tests.test_server import free_port

    port, drain = free_port(), 1.0
    log = open(tmp_path / "log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "tests.test_server_fidelity", str(port), str(drain)], cwd=ROOT,
                            stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    url = f"http://127.0.0.1:{port}"
    try:
        t0 = time.time()
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.time() - t0 < 60, (tmp_path / "log").read_text()
            time.sleep(0.1)
        got: dict = {"events": []}
        started = threading.Event()

        def stream():
            with httpx.stream("POST", url + C, json={"prompt": [1], "max_tokens": 90000, "stream": True},
                              timeout=30) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        got["events"].append(line[6:])
                        started.set()

        def full():
            got["full"] = httpx.post(url + C, json={"prompt": [2], "max_tokens": 90000}, timeout=30)

        threads = [threading.Thread(target=stream), threading.Thread(target=full)]
        for th in threads:
            th.start()
        assert started.wait(20)
        time.sleep(0.3)
        t1 = time.time()
        proc.send_signal(signal.SIGTERM)
        for th in threads:
            th.join(20)
        ev = got["events"]
        assert ev[-1] == "[DONE]", ev[-3:]
        assert json.loads(ev[-2])["error"]["code"] == 503
        r = got["full"]
        assert r.status_code == 503 and r.headers["content-type"] == "application/json", (r.status_code, r.text)
        assert "drain-timeout" in r.json()["error"]["message"]
        assert proc.wait(20) == 0
        assert drain <= time.time() - t1 < drain + 8  # (uvicorn itself would cancel at drain + DRAIN_GRACE)
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    assert "Traceback" not in (tmp_path / "log").read_text()


# ---------------------------------------------------------------------- oversized prompts
def test_prompt_character_cap(tokenizer):
    _, app = make_app(tokenizer, limits=Limits(max_prompt_chars=100))
    with TestClient(app) as c:
        assert c.post(C, json={"prompt": "a" * 100, "max_tokens": 1}).status_code == 200
        assert_error(c.post(C, json={"prompt": "a" * 101}), 400, "prompt", "101 characters", "--max-prompt-chars")
        assert_error(c.post(C, json={"prompt": ["ok", "b" * 200]}), 400, "prompt", "200 characters")
        assert_error(c.post(CH, json={"messages": [{"role": "user", "content": "c" * 60}] * 2}), 400, "messages",
                     "120 characters")
        assert_error(c.post(TOK, json={"prompt": "d" * 101}), 400, "prompt", "101")
    _, app = make_app(tokenizer, max_model_len=16)
    with TestClient(app) as c:  # the default: CHARS_PER_TOKEN_BOUND per position
        assert_error(c.post(C, json={"prompt": "e" * (16 * CHARS_PER_TOKEN_BOUND + 1)}), 400, "prompt",
                     str(16 * CHARS_PER_TOKEN_BOUND))
    with pytest.raises(ValueError, match="max_prompt_chars"):
        Limits(max_prompt_chars=0)


class _SlowTokenizer:
    """The real tokenizer, but 1.5 s per text that holds "SLOW" (a stand-in for megabytes)."""

    def __init__(self, tok):
        self.tok = tok
        self.chat_template = tok.chat_template

    def __call__(self, text, **kw):
        if "SLOW" in text:
            time.sleep(1.5)
        return self.tok(text, **kw)

    def __getattr__(self, name):
        return getattr(self.tok, name)


def test_long_tokenization_does_not_hold_up_others(tokenizer):
    _, app = make_app(tokenizer, tok=_SlowTokenizer(tokenizer))
    with TestClient(app) as c:
        slow: dict = {}
        t = threading.Thread(target=lambda: slow.update(r=c.post(C, json={"prompt": "SLOW", "max_tokens": 1}),
                                                        t=time.time()))
        t.start()
        time.sleep(0.2)
        t0 = time.time()
        fast = c.post(C, json={"prompt": "quick", "max_tokens": 1})
        done = time.time()
        t.join(10)
        assert fast.status_code == 200 and slow["r"].status_code == 200
        assert done - t0 < 1.0 and done < slow["t"], (done - t0, slow["t"] - done)


if __name__ == "__main__":
    _serve_main(int(sys.argv[1]), float(sys.argv[2]))
