"""The OpenAI-compatible server, end to end: one real `python -m jvllm.cli serve` process per module
(tiny random Llama with SmolLM2's tokenizer, max_model_len L), the official `openai` client.

`ServerProcess` is imported by the other test_server_*.py modules."""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEY = "sk-test-key"
MODEL = "tiny"
L = 2048  # max_model_len of the test servers (long enough that a stream outlives a disconnect test)
V = 49152  # SmolLM2 vocabulary


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m jvllm.cli serve` on 127.0.0.1:<free port>, logging to a file (never a pipe, which
    would fill and block the server). `stop()` always ends it (SIGTERM, then SIGKILL)."""

    def __init__(self, model_dir: str, log_path: str, *extra: str, api_key: str | None = None,
                 max_num_seqs: int = 16):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [sys.executable, "-m", "jvllm.cli", "serve", model_dir, "--host", "127.0.0.1", "--port",
               str(self.port), "--dtype", "float32", "--max-model-len", str(L), "--max-num-batched-tokens", "64",
               "--max-num-seqs", str(max_num_seqs), "--token-buckets", "8,16,32,64", "--served-model-name", MODEL,
               "--disable-access-log", "--log-level", "warning", *extra]
        if api_key:
            cmd += ["--api-key", api_key]
        env = dict(os.environ, JAX_PLATFORMS="cpu", TOKENIZERS_PARALLELISM="false")
        env.pop("JVLLM_API_KEY", None)
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        try:
            self._wait_healthy(180)
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self, timeout):
        t0 = time.time()
        while time.time() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise TimeoutError(f"server not healthy after {timeout}s:\n{self.tail()}")

    def tail(self, n=4000) -> str:
        with open(self.log_path) as f:
            return f.read()[-n:]

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()

    def metrics(self) -> dict:
        """{name: value} of the unlabelled-by-reason samples (model_name label dropped)."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        out = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                extra = {k: v for k, v in s.labels.items() if k != "model_name"}
                key = s.name if not extra else s.name + json.dumps(extra, sort_keys=True)
                out[key] = s.value
        return out

    def wait_pool_idle(self, timeout=15.0) -> dict:
        t0 = time.time()
        while True:
            m = self.metrics()
            if (m["jvllm:kv_cache_free_blocks"] == m["jvllm:kv_cache_total_blocks"]
                    and m["jvllm:num_requests_running"] == 0 and m["jvllm:num_requests_waiting"] == 0
                    and m["jvllm:num_requests_admitted"] == 0):
                return m
            if time.time() - t0 > timeout:
                raise AssertionError(f"pool not idle after {timeout}s: {m}")
            time.sleep(0.1)


@pytest.fixture(scope="module")
def server(tmp_path_factory, ckpt_dir):
    d = ckpt_dir("llama", tokenizer=True, max_position_embeddings=L)
    srv = ServerProcess(d, str(tmp_path_factory.mktemp("srv") / "server.log"), "--max-n", "4", "--max-stop", "4",
                        "--max-prompts", "4", "--max-body-bytes", str(1 << 20), "--max-header-bytes", "16384",
                        api_key=KEY)
    yield srv
    srv.stop()
    assert "Traceback" not in srv.tail(100000), srv.tail()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def aclient_factory(server):
    def make(**kw):
        kw.setdefault("timeout", 120)
        return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, **kw)

    return make


def post(server, path, body=None, content=None, headers=None, key=KEY):
    h = {"Authorization": f"Bearer {key}"} if key else {}
    h.update(headers or {})
    if content is not None:
        return httpx.post(server.url + path, content=content, headers={"Content-Type": "application/json", **h},
                          timeout=60)
    return httpx.post(server.url + path, json=body, headers=h, timeout=60)


def assert_error(r, status, *words):
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["code"] == status
    for w in words:
        assert w in err["message"], (w, err)
    return err


def assert_still_serves(server):
    r = post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 200, r.text


# ---------------------------------------------------------------------- basic endpoints
def test_open_endpoints_and_models(server, client):
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/version").json()["version"]
    assert httpx.get(server.url + "/metrics").status_code == 200  # no key needed
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].model_extra["max_model_len"] == L


def test_auth(server):
    for key in (None, "wrong", KEY + "x"):
        assert_error(post(server, "/v1/completions", {"prompt": "a"}, key=key), 401, "API key")
        r = httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {key}"} if key else {})
        assert_error(r, 401)
    assert_error(post(server, "/tokenize", {"prompt": "a"}, key=None), 401)
    for path in ("/%76%31/completions", "/v1/completions/", "/v1//completions", "//v1/completions", "/V1/completions",
                 "/v1/completions?x=1", "/tokenize/"):  # no way around the key
        r = httpx.post(server.url + path, json={"prompt": "a", "max_tokens": 1})
        assert r.status_code in (401, 404, 405), (path, r.status_code)
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=MODEL, prompt="a", max_tokens=1)


def test_tokenize_detokenize(server):
    r = post(server, "/tokenize", {"prompt": "Hello world"}).json()
    assert r["count"] == len(r["tokens"]) > 0 and r["max_model_len"] == L
    assert post(server, "/detokenize", {"tokens": r["tokens"]}).json()["prompt"] == "Hello world"
    chat = post(server, "/tokenize", {"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat["count"] > 3
    assert_error(post(server, "/detokenize", {"tokens": [V, -1]}), 400, str(V))
    assert_error(post(server, "/tokenize", {}), 400, "prompt")


# ---------------------------------------------------------------------- generation
def test_completion_stream_equals_full(client):
    full = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=24, temperature=0)
    c = full.choices[0]
    assert c.finish_reason == "length" and len(c.text) > 0
    assert full.usage.completion_tokens == 24 and full.usage.prompt_tokens > 0
    assert full.usage.total_tokens == full.usage.prompt_tokens + 24
    chunks = list(client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=24,
                                            temperature=0, stream=True, stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == c.text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    assert all(ch.usage is None for ch in chunks[:-1])


def test_chat_stream_equals_full(client):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}]
    full = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=20, temperature=0)
    c = full.choices[0]
    assert c.message.role == "assistant" and c.finish_reason == "length"
    assert full.usage.completion_tokens == 20 and full.object == "chat.completion"
    stream = client.chat.completions.create(model=MODEL, messages=msgs, max_completion_tokens=20, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == c.message.content
    assert chunks[-1].usage.completion_tokens == 20 and chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    # without include_usage: no usage chunk
    plain = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=3, stream=True))
    assert all(ch.choices for ch in plain) and plain[-1].choices[0].finish_reason == "length"


def test_n_logprobs_seed(client):
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, n=3, temperature=1.0,
                                  seed=123, logprobs=2)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert r.usage.completion_tokens == 18
    for c in r.choices:
        lp = c.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
        assert all(x <= 0 for x in lp.token_logprobs)
        assert all(1 <= len(t) <= 3 for t in lp.top_logprobs)
        assert "".join(lp.tokens) == c.text
    again = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, n=3,
                                      temperature=1.0, seed=123, logprobs=2)
    assert [c.text for c in again.choices] == [c.text for c in r.choices]
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                          n=2, logprobs=True, top_logprobs=3, temperature=0)
    assert len(chat.choices) == 2 and chat.choices[0].message.content == chat.choices[1].message.content
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 3 for t in content)
    assert all(t.top_logprobs[0].logprob >= t.top_logprobs[-1].logprob for t in content)
    # streamed logprobs, n > 1
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=4, n=2, logprobs=True, top_logprobs=1, stream=True))
    for i in range(2):
        toks = [t for ch in chunks for c in ch.choices if c.index == i and c.logprobs for t in c.logprobs.content]
        assert len(toks) == 4
        assert [c.finish_reason for ch in chunks for c in ch.choices if c.index == i][-1] == "length"


def test_stop_strings(client):
    base = client.completions.create(model=MODEL, prompt="Stop test", max_tokens=12, temperature=0)
    lp = client.completions.create(model=MODEL, prompt="Stop test", max_tokens=12, temperature=0, logprobs=0)
    toks = lp.choices[0].logprobs.tokens
    stop = toks[3]
    full = base.choices[0].text
    expect = full[:full.find(stop)]
    for stream in (False, True):
        r = client.completions.create(model=MODEL, prompt="Stop test", max_tokens=12, temperature=0, stop=[stop],
                                      stream=stream)
        if stream:
            chunks = list(r)
            text = "".join(c.choices[0].text for c in chunks)
            fr = chunks[-1].choices[0].finish_reason
        else:
            text, fr = r.choices[0].text, r.choices[0].finish_reason
            assert r.choices[0].model_extra["stop_reason"] == stop
        assert (text, fr) == (expect, "stop")
    inc = client.completions.create(model=MODEL, prompt="Stop test", max_tokens=12, temperature=0, stop=stop,
                                    extra_body={"include_stop_str_in_output": True})
    assert inc.choices[0].text == expect + stop


def test_vllm_extras_and_batch(client):
    r = client.completions.create(model=MODEL, prompt=["Hi there", "Good morning"], max_tokens=5, n=2,
                                  temperature=0.8, top_p=0.9, seed=1,
                                  extra_body=dict(top_k=20, min_p=0.05, repetition_penalty=1.2, ignore_eos=True,
                                                  min_tokens=5, presence_penalty=0.5))
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    assert all(c.finish_reason == "length" for c in r.choices) and r.usage.completion_tokens == 20
    ids = client.completions.create(model=MODEL, prompt=[1, 2, 3, 4], max_tokens=3, temperature=0, echo=True)
    assert ids.choices[0].text and ids.usage.prompt_tokens == 4
    plp = client.completions.create(model=MODEL, prompt="a b c d", max_tokens=1, extra_body={"prompt_logprobs": 1})
    got = plp.choices[0].model_extra["prompt_logprobs"]
    assert got[0] is None and len(got) == plp.usage.prompt_tokens


def test_sampling_extras_end_to_end(server, client):
    """best_of, allowed_token_ids, bad_words and truncate_prompt_tokens on the real engine."""
    r = client.completions.create(model=MODEL, prompt="Hi", max_tokens=4, n=2, temperature=1.0, seed=3,
                                  logprobs=0, extra_body={"best_of": 4, "ignore_eos": True})
    cums = [sum(c.logprobs.token_logprobs) for c in r.choices]
    assert [c.index for c in r.choices] == [0, 1] and cums[0] >= cums[1] - 1e-4
    r = client.completions.create(model=MODEL, prompt="Hi", max_tokens=4, temperature=1.0, seed=3,
                                  extra_body={"allowed_token_ids": [1000], "ignore_eos": True})
    want = post(server, "/detokenize", {"tokens": [1000] * 4}).json()["prompt"]
    assert want and r.choices[0].text == want
    word = post(server, "/detokenize", {"tokens": [1000]}).json()["prompt"]
    r = client.completions.create(model=MODEL, prompt="Hi", max_tokens=4, temperature=1.0, seed=3,
                                  extra_body={"allowed_token_ids": [1000, 1001], "bad_words": [word],
                                              "ignore_eos": True})
    assert r.choices[0].text == post(server, "/detokenize", {"tokens": [1001] * 4}).json()["prompt"]
    r = post(server, "/v1/completions", {"prompt": list(range(3, 3 + L)), "max_tokens": 1, "temperature": 0,
                                         "truncate_prompt_tokens": -1}).json()
    assert r["usage"]["prompt_tokens"] == L - 1, r
    assert_still_serves(server)


def test_context_length_boundary(server, client):
    prompt = [100 + i for i in range(L - 1)]
    ok = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
    assert ok.usage.completion_tokens == 1
    err = assert_error(post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 2}), 400, str(L),
                       str(L + 1), str(L - 1))
    assert err["param"] == "max_tokens"
    assert_error(post(server, "/v1/completions", {"prompt": prompt + [7]}), 400, str(L))
    # chat without max_tokens: defaults to the rest of the context (a ~1930-token prompt, so the
    # rest is ~120 decode steps, not ~1900)
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x " * 1900}],
                                       temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.prompt_tokens + r.usage.completion_tokens == L


# ---------------------------------------------------------------------- bad input
C, CH = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]
BAD = [
    # (path, body or raw bytes, status, words in the message)
    (C, b"x{{", 400, ["JSON"]),
    (C, b"[1, 2]", 400, ["JSON object"]),
    (C, b"42", 400, ["JSON object"]),
    (C, b"null", 400, ["JSON object"]),
    (C, b"", 400, ["JSON object"]),
    (C, b'{"prompt": "a", "temperature": NaN}', 400, ["temperature"]),
    (C, {"prompt": "a", "max_tokens": "5"}, 400, ["max_tokens"]),
    (C, {"prompt": "a", "stream": "yes"}, 400, ["stream"]),
    (C, {"prompt": 5}, 400, ["prompt"]),
    (C, {"prompt": "a", "n": 1.5}, 400, ["n"]),
    (C, {"prompt": "a", "stop": 3}, 400, ["stop"]),
    (C, {"prompt": "a", "logit_bias": [1]}, 400, ["logit_bias"]),
    (C, {}, 400, ["prompt"]),
    (CH, {"messages": "hi"}, 400, ["messages"]),
    (CH, {"messages": []}, 400, ["messages"]),
    (CH, {"messages": [{"role": "wizard", "content": "x"}]}, 400, ["messages"]),
    (CH, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, 400, ["messages"]),
    (C, {"prompt": "a", "temperature": -1}, 400, ["temperature", "0"]),
    (C, {"prompt": "a", "top_p": 0}, 400, ["top_p"]),
    (C, {"prompt": "a", "top_p": 1.5}, 400, ["top_p", "1"]),
    (C, {"prompt": "a", "n": 0}, 400, ["n", "1"]),
    (C, {"prompt": "a", "max_tokens": 0}, 400, ["max_tokens", "1"]),
    (C, {"prompt": "a", "presence_penalty": 3}, 400, ["presence_penalty", "2"]),
    (C, {"prompt": "a", "frequency_penalty": -3}, 400, ["frequency_penalty", "-2"]),
    (C, {"prompt": "a", "min_p": 2}, 400, ["min_p", "1"]),
    (C, {"prompt": "a", "top_k": -2}, 400, ["top_k", "-1"]),
    (C, {"prompt": "a", "repetition_penalty": 0}, 400, ["repetition_penalty", "0"]),
    (C, {"prompt": "a", "max_tokens": 3, "min_tokens": 5}, 400, ["min_tokens", "3"]),
    (C, {"prompt": "a", "logprobs": 21}, 400, ["logprobs", "20"]),
    (CH, {"messages": MSG, "logprobs": True, "top_logprobs": 21}, 400, ["top_logprobs", "20"]),
    (CH, {"messages": MSG, "top_logprobs": 2}, 400, ["top_logprobs", "logprobs"]),
    (C, {"prompt": "a", "prompt_logprobs": -1}, 400, ["prompt_logprobs", "0"]),
    (C, {"prompt": "a", "stream_options": {"include_usage": True}}, 400, ["stream_options"]),
    (CH, {"messages": MSG, "stream": False, "stream_options": {"include_usage": True}}, 400, ["stream_options"]),
    (C, {"prompt": "a", "seed": 2**63}, 400, ["seed", str(2**63 - 1)]),
    (C, {"prompt": "a", "seed": -(2**63) - 1}, 400, ["seed", str(-(2**63))]),
    (C, {"prompt": "a", "logit_bias": {str(V): 1, "-5": 2, "7": 3, "99999": 1}}, 400,
     ["logit_bias", str(V), "-5", "99999"]),
    (C, {"prompt": "a", "logit_bias": {"x": 1}}, 400, ["logit_bias"]),
    (C, {"prompt": "a", "logit_bias": {"5": 101}}, 400, ["logit_bias", "100"]),
    (C, {"prompt": "a", "stop_token_ids": [V, 123456, 5]}, 400, ["stop_token_ids", str(V), "123456"]),
    (CH, {"messages": MSG, "stop_token_ids": [-1]}, 400, ["stop_token_ids", str(V)]),
    (C, {"prompt": [1, -1]}, 400, ["prompt", "-1", str(V)]),
    (C, {"prompt": [5, V]}, 400, ["prompt", str(V)]),
    (C, {"prompt": [[5], [V + 7]]}, 400, ["prompt", str(V + 7)]),
    (C, {"prompt": ""}, 400, ["prompt"]),
    (C, {"prompt": []}, 400, ["prompt"]),
    (C, {"prompt": [[]]}, 400, ["prompt"]),
    (C, {"prompt": "a", "logit_bias": {"1.5": 1}}, 400, ["logit_bias"]),
    (C, {"prompt": "a", "max_tokens": L}, 400, [str(L), str(L + 1)]),
    (CH, {"messages": MSG, "max_completion_tokens": 10**6}, 400, [str(L), "max_completion_tokens"]),
    (C, {"prompt": ["a"] * 3, "n": 4, "max_tokens": 10**6}, 400, ["max_tokens"]),
    (C, {"prompt": "a", "n": 5}, 400, ["n", "4"]),
    (C, {"prompt": ["a"] * 5}, 400, ["prompt", "4"]),
    (C, {"prompt": "a", "stop": ["a", "b", "c", "d", "e"]}, 400, ["stop", "4"]),
    (C, {"prompt": "a", "stop": [""]}, 400, ["stop"]),
    (C, {"prompt": "a", "stop": "x" * 513}, 400, ["stop", "512"]),
    (C, {"prompt": "a", "model": "gpt-4"}, 404, ["gpt-4"]),
    (CH, {"messages": MSG, "model": "nope"}, 404, ["nope"]),
    (C, {"prompt": "a", "suffix": "x"}, 400, ["suffix"]),
    (CH, {"messages": MSG, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400,
     ["tool_choice 'auto'", "--enable-auto-tool-choice"]),
    (CH, {"messages": MSG, "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "foo"}}}},
     400, ["rejected"]),
    (C, {"prompt": "a", "guided_regex": "a+", "guided_choice": ["a"]}, 400, ["only one of"]),
    (CH, {"messages": MSG, "chat_template": "{{ 1 }}"}, 400, ["--trust-request-chat-template"]),
    (CH, {"messages": [{"role": "user", "content": "\ud83d"}]}, 400, ["messages.0.content", "surrogate"]),
    (C, {"prompt": ["ok", "\ud83d"]}, 400, ["prompt.1", "surrogate"]),
    (C, {"prompt": "a", "model": "\ud83d"}, 400, ["model", "surrogate"]),
    (C, {"prompt": "a" * (32 * L + 1)}, 400, ["prompt", "--max-prompt-chars"]),
    (C, {"prompt": "a", "n": 2, "best_of": 1}, 400, ["best_of", ">= n (2)"]),
    (C, {"prompt": "a", "best_of": 3, "stream": True}, 400, ["best_of", "streamed"]),
    (CH, {"messages": [{"role": "user", "content": "a"}], "add_generation_prompt": True,
          "continue_final_message": True}, 400, ["continue_final_message"]),
]


@pytest.mark.parametrize("path,body,status,words", BAD, ids=[f"{i}" for i in range(len(BAD))])
def test_bad_input(server, path, body, status, words):
    if not isinstance(body, bytes):
        body = json.dumps(body).encode()  # ASCII: lone surrogates travel as \uXXXX escapes
    r = post(server, path, content=body)
    assert_error(r, status, *words)
    assert_still_serves(server)


def test_empty_model_name_is_the_served_model(client):
    """vLLM: an empty (or absent) model name is the served model, not a 404."""
    out = client.completions.create(model="", prompt="a", max_tokens=1, temperature=0)
    assert len(out.choices) == 1 and out.model == MODEL


def test_echo_with_max_tokens_0_scores_the_prompt(client):
    """vLLM / OpenAI: echo with max_tokens 0 returns the prompt alone with its logprobs (prompt
    scoring); without echo, max_tokens 0 is a 400."""
    ids = [5, 6, 7, 8]
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=0, echo=True, logprobs=1)
    c = out.choices[0]
    assert len(c.logprobs.tokens) == len(ids) and c.logprobs.token_logprobs[0] is None
    assert all(isinstance(v, float) for v in c.logprobs.token_logprobs[1:])
    assert out.usage.completion_tokens == 0 and out.usage.prompt_tokens == len(ids)
    chunks = list(client.completions.create(model=MODEL, prompt=ids, max_tokens=0, echo=True, logprobs=1, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == c.text
    assert sum(len(ch.choices[0].logprobs.tokens) for ch in chunks if ch.choices and ch.choices[0].logprobs) == len(ids)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=ids, max_tokens=0)
    assert e.value.body["param"] == "max_tokens"


def test_unsupported_fields_via_openai_client(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=1, extra_body={"structural_tag": "x"})
    assert e.value.body["param"] == "structural_tag"
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    with pytest.raises(openai.BadRequestError) as e:  # 'auto' (the default) needs --tool-call-parser
        client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=1, tools=tools)
    assert e.value.body["param"] == "tool_choice"
    r = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=2, tools=tools, tool_choice="none",
                                       response_format={"type": "text"})
    assert r.choices[0].finish_reason == "length"
    # (SmolLM2's template ignores tools; test_server_fidelity checks that a template receives them)
    r = client.completions.create(model=MODEL, prompt="a", max_tokens=1, extra_body={"not_a_field": 1})
    assert r.choices[0].finish_reason == "length"


def test_echo_with_logprobs(client):
    plain = client.completions.create(model=MODEL, prompt="The sky is blue and", max_tokens=3, temperature=0,
                                      logprobs=2)
    r = client.completions.create(model=MODEL, prompt="The sky is blue and", max_tokens=3, temperature=0,
                                  logprobs=2, echo=True)
    c, p = r.choices[0], r.usage.prompt_tokens
    assert c.text == "The sky is blue and" + plain.choices[0].text
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == p + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x <= 0 for x in lp.token_logprobs[1:]) and "".join(lp.tokens) == c.text
    assert lp.tokens[p:] == plain.choices[0].logprobs.tokens
    assert lp.token_logprobs[p:] == pytest.approx(plain.choices[0].logprobs.token_logprobs, abs=1e-4)
    assert all(1 <= len(t) <= 3 for t in lp.top_logprobs[1:])
    assert lp.text_offset[p] == len("The sky is blue and")
    chunks = list(client.completions.create(model=MODEL, prompt="The sky is blue and", max_tokens=3,
                                            temperature=0, logprobs=2, echo=True, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == c.text
    assert [t for ch in chunks for t in ch.choices[0].logprobs.tokens] == lp.tokens


def test_bad_input_via_openai_client(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="a", max_tokens=1, logprobs=21)
    assert e.value.body["param"] == "logprobs"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="missing", messages=MSG)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=MSG, stream=True, max_tokens=10**6)


def test_oversized_body_and_headers(server):
    big = json.dumps({"prompt": "a" * (2 << 20)}).encode()
    assert_error(post(server, C, content=big), 413, "bytes")
    r = httpx.post(server.url + C, json={"prompt": "a"}, headers={"Authorization": f"Bearer {KEY}",
                                                                 "X-Big": "b" * 40000}, timeout=30)
    assert r.status_code in (400, 431)

    def chunked():  # no Content-Length: counted while reading
        for _ in range(40):
            yield b" " * 65536

    r = httpx.post(server.url + C, content=chunked(), headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert_error(r, 413)
    assert_still_serves(server)


# ---------------------------------------------------------------------- concurrency, disconnects
def test_64_concurrent_streams(server, aclient_factory):
    async def one(cl, i):
        kind = i % 2
        toks, fr = [], None
        if kind:
            s = await cl.completions.create(model=MODEL, prompt=f"Request {i}", max_tokens=4 + i % 20,
                                            temperature=0, stream=True)
            async for ch in s:
                for c in ch.choices:
                    toks.append(c.text)
                    fr = c.finish_reason or fr
        else:
            s = await cl.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"#{i}"}],
                                                 max_tokens=4 + i % 20, temperature=0, stream=True)
            async for ch in s:
                for c in ch.choices:
                    toks.append(c.delta.content or "")
                    fr = c.finish_reason or fr
        return fr, "".join(toks)

    async def main():
        cl = aclient_factory()
        async with cl:
            return await asyncio.gather(*[one(cl, i) for i in range(64)])

    res = asyncio.run(main())
    assert len(res) == 64 and all(fr in ("length", "stop") for fr, _ in res), res
    assert sum(bool(t) for _, t in res) >= 60
    server.wait_pool_idle()


def test_disconnect_aborts_and_frees_blocks(server):
    body = {"model": MODEL, "prompt": "Tell me a long story", "max_tokens": L - 64, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=30) as c:
        with c.stream("POST", server.url + C, json=body, headers={"Authorization": f"Bearer {KEY}"}) as r:
            assert r.status_code == 200
            n = 0
            lines = r.iter_lines()  # keep a reference: a closed iterator closes the connection
            for line in lines:
                n += line.startswith("data: ")
                if n >= 5:
                    break
            m = server.metrics()
            assert m["jvllm:num_requests_running"] == 1
            assert m["jvllm:kv_cache_free_blocks"] < m["jvllm:kv_cache_total_blocks"]
    t0 = time.time()
    m = server.wait_pool_idle(timeout=5)
    assert time.time() - t0 < 5
    assert m['jvllm:request_success_total{"finished_reason": "abort"}'] >= 1
    # non-streamed request abandoned by its client
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + C, json={**body, "stream": False}, headers={"Authorization": f"Bearer {KEY}"},
                   timeout=0.5)
    server.wait_pool_idle(timeout=5)


def test_200_cancelled_requests_then_short_one(server, aclient_factory):
    async def main():
        cl = aclient_factory(timeout=0.5)
        async with cl:
            return await asyncio.gather(*[cl.completions.create(model=MODEL, prompt=f"go {i}", max_tokens=240,
                                                                temperature=0, extra_body={"ignore_eos": True})
                                          for i in range(200)], return_exceptions=True)

    res = asyncio.run(main())
    assert all(isinstance(r, (openai.APITimeoutError, openai.APIConnectionError)) or r.choices[0].finish_reason
               for r in res), [r for r in res if isinstance(r, Exception)][:3]
    assert sum(isinstance(r, openai.APITimeoutError) for r in res) >= 150
    t0 = time.time()
    cl = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=30)
    r = cl.completions.create(model=MODEL, prompt="short", max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason == "length" and time.time() - t0 < 10
    server.wait_pool_idle(timeout=10)


# ---------------------------------------------------------------------- metrics, schema, bench
def test_metrics_format(server):
    text = httpx.get(server.url + "/metrics").text
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("jvllm:num_requests_running", "jvllm:num_requests_waiting", "jvllm:kv_cache_usage_perc",
                 "jvllm:prefix_cache_hit_rate", "jvllm:compiles_after_warmup", "jvllm:time_to_first_token_seconds",
                 "jvllm:time_per_output_token_seconds", "jvllm:e2e_request_latency_seconds",
                 "jvllm:prompt_tokens", "jvllm:generation_tokens"):
        assert name in fams, (name, sorted(fams))
    m = server.metrics()
    assert m["jvllm:prompt_tokens_total"] > 0 and m["jvllm:generation_tokens_total"] > 0
    assert m["jvllm:time_to_first_token_seconds_count"] > 0 and m["jvllm:e2e_request_latency_seconds_count"] > 0
    assert 0 <= m["jvllm:kv_cache_usage_perc"] <= 1 and 0 <= m["jvllm:prefix_cache_hit_rate"] <= 1
    assert m["jvllm:engine_alive"] == 1 and m["jvllm:warmup_pending"] in (0, 1)
    # vLLM's names, same values, labelled with model_name
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prompt_tokens", "vllm:generation_tokens", "vllm:time_to_first_token_seconds",
                 "vllm:inter_token_latency_seconds", "vllm:e2e_request_latency_seconds", "vllm:prefix_cache_queries",
                 "vllm:prefix_cache_hits"):
        assert name in fams, (name, sorted(fams))
        assert all(s.labels.get("model_name") == MODEL for s in fams[name].samples), name
    assert m["vllm:prefix_cache_queries_total"] >= m["vllm:prefix_cache_hits_total"] > 0
    assert m["vllm:inter_token_latency_seconds_count"] > 0


def narrowed_schema(schema: dict, max_tokens: int = 2, max_n: int = 2) -> dict:
    """The server's own /openapi.json with generation lengths narrowed so that 50 sampled requests
    per operation fit in CI time on a CPU (a temperature > 0 step costs ~0.1-0.4 s there): max_tokens /
    max_completion_tokens required and <= `max_tokens`, n and prompt batches <= `max_n`. Every other
    field keeps the server's own constraints."""
    schema = json.loads(json.dumps(schema))
    comps = schema["components"]["schemas"]
    for name, field in (("CompletionRequest", "max_tokens"), ("ChatCompletionRequest", "max_completion_tokens")):
        m = comps[name]
        m["properties"][field] = {"type": "integer", "minimum": 1, "maximum": max_tokens}
        m["required"] = sorted(set(m.get("required", [])) | {field})
        m["properties"]["n"]["maximum"] = max_n
        m["properties"]["min_tokens"]["maximum"] = max_tokens
    for alt in comps["CompletionRequest"]["properties"]["prompt"]["anyOf"]:
        if alt.get("type") == "array" and alt["items"].get("type") != "integer":
            alt["maxItems"] = max_n
    return schema


def test_schemathesis(server, tmp_path):
    pytest.importorskip("schemathesis")
    schema = httpx.get(server.url + "/openapi.json").json()
    assert schema["components"]["schemas"]["CompletionRequest"]["properties"]["n"]["maximum"] == 4
    path = tmp_path / "openapi.json"
    path.write_text(json.dumps(narrowed_schema(schema)))
    cmd = [sys.executable, "-m", "schemathesis.cli", "run", str(path), "--url", server.url, "--mode", "positive",
           "--max-examples", "50", "--checks", "not_a_server_error", "--phases", "examples,fuzzing",
           "-H", f"Authorization: Bearer {KEY}", "--seed", "0", "--no-shrink", "--request-timeout", "60",
           "--workers", "1", "--suppress-health-check", "all"]  # (--workers 2 skipped an operation)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=400, cwd=str(tmp_path))
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-6000:]
    m = re.search(r"(\d+) generated, (\d+) passed", out)
    assert m and int(m.group(1)) == int(m.group(2)) >= 4 * 50 + 4, out[-3000:]  # 4 POST ops x 50, 4 GETs
    assert_still_serves(server)
    server.wait_pool_idle()


def test_serve_bench(server, tmp_path):
    out = tmp_path / "s1.json"
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "serve_bench.py"), "--base-url", server.url,
           "--api-key", KEY, "--num-prompts", "8", "--input-len", "8", "48", "--output-len", "4", "16",
           "--request-rates", "8,inf", "--output-json", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert p.returncode == 0, p.stdout + p.stderr
    res = json.loads(out.read_text())
    assert [r["request_rate"] for r in res["results"]] == ["8", "inf"]
    for r in res["results"]:
        assert r["completed"] == 8 and r["failed"] == 0
        for k in ("ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p99", "itl_ms_p50", "itl_ms_p99",
                  "request_throughput"):
            assert r[k] is not None and r[k] > 0, k
    assert res["versions"]["server"]["version"] and res["device"]
    assert res["compiles_after_warmup"]["after"] == res["compiles_after_warmup"]["before"]
    assert res["server_startup"]["warmup_wait_s"] >= 0
    try:
        import matplotlib  # noqa: F401

        assert res["plot"] and os.path.exists(res["plot"])
    except ImportError:
        pass
