"""The server's failure paths, in process, against a fake engine (no JAX compile): an engine error on
one request ends only that request; an exception out of step() kills the engine, fails what is in
flight, and /health turns 503; a cancelled submission never leaks its admission slot."""
from __future__ import annotations

import json
import time
import types

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")
from fastapi.testclient import TestClient  # noqa: E402

from jvllm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput  # noqa: E402
from jvllm.server.app import build_app  # noqa: E402

FAIL_TOKEN, DIE_TOKEN = 13, 66


class FakeEngine:
    """LLMEngine's interface, one token ("a", id 5, logprob -0.5) per step per request; DELTA outputs
    only. Prompt logprobs: -1.0 per prompt token (rank 1) after the first; half of each prompt
    (whole blocks of 4) counts as cached. A prompt containing FAIL_TOKEN finishes with "error" on its
    first step; DIE_TOKEN makes step() raise (an engine bug). `prompts` records every prompt text."""

    def __init__(self, max_model_len=64, max_num_seqs=4, tokenizer=None):
        self.tokenizer = tokenizer
        self.prompts: list = []
        self.params: list = []  # every request's SamplingParams
        self.model_config = types.SimpleNamespace(vocab_size=100)
        self.sched_config = types.SimpleNamespace(max_model_len=max_model_len, max_num_seqs=max_num_seqs)
        self.reqs: dict[str, dict] = {}
        self.aborted: list[str] = []
        self.step_delay = 0.002

    def add_request(self, rid, prompt, params, arrival_time=None):
        ids = prompt["prompt_token_ids"]
        if rid in self.reqs:
            raise ValueError(f"request id {rid!r} is already in use")
        self.reqs[rid] = dict(ids=ids, params=params, n=0, arrival=arrival_time or time.time())
        self.prompts.append(prompt.get("prompt"))
        self.params.append(params)
        return rid

    def abort_request(self, rids):
        for r in [rids] if isinstance(rids, str) else rids:
            if self.reqs.pop(r, None) is not None:
                self.aborted.append(r)

    def has_unfinished_requests(self):
        return bool(self.reqs)

    def step(self):
        time.sleep(self.step_delay)
        outs = []
        for rid, r in list(self.reqs.items())[: self.sched_config.max_num_seqs]:
            if DIE_TOKEN in r["ids"]:
                raise RuntimeError("simulated engine bug")
            p = r["params"]
            if FAIL_TOKEN in r["ids"]:
                comps = [CompletionOutput(i, "", [], None, None, "error") for i in range(p.n)]
            else:
                r["n"] += 1
                fr = "length" if r["n"] >= p.max_tokens else None
                lps = [{5: Logprob(-0.5, 1, "a")}] if p.logprobs is not None else None
                comps = [CompletionOutput(i, "a", [5], None, lps, fr) for i in range(p.n)]
            plp = None
            if p.prompt_logprobs is not None and r["n"] <= 1:
                plp = [None] + [{t: Logprob(-1.0, 1, None)} for t in r["ids"][1:]]
            done = comps[0].finish_reason is not None
            outs.append(RequestOutput(rid, None, r["ids"], plp, comps, done, RequestMetrics(r["arrival"]),
                                      num_cached_tokens=len(r["ids"]) // 8 * 4))
            if done:
                del self.reqs[rid]
        return outs

    def get_stats(self):
        return dict(num_running=min(len(self.reqs), 4), num_waiting=max(0, len(self.reqs) - 4), kv_usage=0.0,
                    num_blocks=9, num_free_blocks=8, prefix_cache_hit_rate=0.0, num_preemptions=0,
                    compiles_after_warmup=0, num_prompt_tokens=0, num_generation_tokens=0, num_requests=0)

    warm = True  # False: a background warm-up still compiling (the `jvllm:warmup_pending` gauge)

    def warmup_done(self):
        return self.warm


def sse(resp) -> list:
    return [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]


def test_engine_error_ends_only_that_request():
    eng = FakeEngine()
    with TestClient(build_app(eng, "fake")) as c:
        ok = c.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 3})
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "aaa"
        bad = c.post("/v1/completions", json={"prompt": [1, FAIL_TOKEN], "max_tokens": 3})
        assert bad.status_code == 200 and bad.json()["choices"][0]["finish_reason"] == "error"
        with c.stream("POST", "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}) as r:
            assert r.status_code == 400  # no tokenizer: a clean 400
        with c.stream("POST", "/v1/completions", json={"prompt": [FAIL_TOKEN], "stream": True}) as r:
            ev = sse(r)
        assert ev[-1] == "[DONE]" and json.loads(ev[-2])["error"]["code"] == 500
        assert json.loads(ev[-3])["choices"][0]["finish_reason"] == "error"
        assert c.get("/health").status_code == 200
        assert c.post("/v1/completions", json={"prompt": [1], "max_tokens": 2}).status_code == 200
        m = c.get("/metrics").text
        assert 'jvllm:request_success_total{finished_reason="error",model_name="fake"} 2.0' in m


def test_dead_engine_fails_in_flight_and_health_503():
    eng = FakeEngine()
    eng.step_delay = 0.02
    with TestClient(build_app(eng, "fake")) as c:
        with c.stream("POST", "/v1/completions", json={"prompt": [1], "max_tokens": 50, "stream": True}) as r1:
            lines = r1.iter_lines()
            assert next(lines).startswith("data: ")
            dying = c.post("/v1/completions", json={"prompt": [DIE_TOKEN], "max_tokens": 5})
            ev = [line[6:] for line in lines if line.startswith("data: ")]
        assert dying.status_code == 503 and "engine" in dying.json()["error"]["message"]
        assert ev[-1] == "[DONE]" and json.loads(ev[-2])["error"]["code"] == 503
        h = c.get("/health")
        assert h.status_code == 503 and h.json()["error"]["code"] == 503
        for msg in (h.json()["error"]["message"], dying.json()["error"]["message"], json.loads(ev[-2])["error"]["message"]):
            assert "RuntimeError" in msg and "simulated" not in msg, msg  # the type, never the text
        r = c.post("/v1/completions", json={"prompt": [1], "max_tokens": 2})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert "jvllm:engine_alive{model_name=\"fake\"} 0.0" in c.get("/metrics").text


def test_warmup_pending_gauge_is_live_and_serve_bench_waits_for_it():
    """An engine still compiling in the background serves (health 200) with the gauge at 1; the gauge
    drops to 0 without another engine step (the idle engine thread refreshes no snapshot), and
    serve_bench's wait_warm returns only then."""
    import os
    import sys
    import threading

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    try:
        import serve_bench
    finally:
        sys.path.pop(0)
    eng = FakeEngine()
    eng.warm = False
    with TestClient(build_app(eng, "fake")) as c:
        assert c.get("/health").status_code == 200
        assert c.post("/v1/completions", json={"prompt": [1], "max_tokens": 2}).status_code == 200
        assert serve_bench.gauge(c, "", "jvllm:warmup_pending") == 1.0
        with pytest.raises(TimeoutError, match="warm-up"):
            serve_bench.wait_warm(c, "", timeout=0.2)
        threading.Timer(0.6, lambda: setattr(eng, "warm", True)).start()
        assert serve_bench.wait_warm(c, "", timeout=30) >= 0.3
        assert serve_bench.gauge(c, "", "jvllm:warmup_pending") == 0.0
        assert serve_bench.gauge(c, "", "jvllm:no_such_gauge") is None


def test_admission_is_released():
    eng = FakeEngine(max_num_seqs=1)
    app = build_app(eng, "fake", max_queue_len=0)
    with TestClient(app) as c:
        for _ in range(5):  # errors, aborts and successes all hand their slot back
            assert c.post("/v1/completions", json={"prompt": [FAIL_TOKEN], "max_tokens": 2}).status_code == 200
            assert c.post("/v1/completions", json={"prompt": [1], "max_tokens": 2}).status_code == 200
            with c.stream("POST", "/v1/completions", json={"prompt": [1], "max_tokens": 40, "stream": True}) as r:
                next(iter(r.iter_lines()))
            t0 = time.time()
            while app.state.aengine.num_admitted and time.time() - t0 < 5:
                time.sleep(0.01)
            assert app.state.aengine.num_admitted == 0
        assert eng.aborted  # the abandoned streams were aborted in the engine
        assert c.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 1}).status_code == 200


def test_api_key_and_routes():
    with TestClient(build_app(FakeEngine(), ["fake", "alias"], api_key="k")) as c:
        assert c.get("/v1/models").status_code == 401
        assert c.get("/v1/models", headers={"Authorization": "Bearer k"}).json()["data"][1]["id"] == "alias"
        assert c.get("/v1/models", headers={"Authorization": "bearer k"}).status_code == 200
        assert c.get("/v1/models", headers={"Authorization": "Basic k"}).status_code == 401
        for path in ("/health", "/metrics", "/version", "/openapi.json"):
            assert c.get(path).status_code == 200, path
        assert c.get("/nope").status_code == 404 and c.get("/nope").json()["error"]["code"] == 404
        r = c.post("/v1/completions", json={"prompt": [1], "model": "alias", "max_tokens": 1},
                   headers={"Authorization": "Bearer k"})
        assert r.status_code == 200 and r.json()["model"] == "alias"


def test_draining_refuses_new_requests():
    app = build_app(FakeEngine(), "fake")
    with TestClient(app) as c:
        with c.stream("POST", "/v1/completions", json={"prompt": [1], "max_tokens": 30, "stream": True}) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            app.state.aengine.draining = True  # what SIGTERM does (jvllm.server.cli)
            refused = c.post("/v1/completions", json={"prompt": [1], "max_tokens": 1})
            ev = [line[6:] for line in lines if line.startswith("data: ")]
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert "shutting down" in refused.json()["error"]["message"]
        assert ev[-1] == "[DONE]" and json.loads(ev[-2])["choices"][0]["finish_reason"] == "length"
        assert c.get("/health").status_code == 200  # draining is not dead


def test_explicit_nulls_mean_the_defaults():
    """`"temperature": null` (the openai SDK sends it for a None argument) is the default, as in vLLM;
    a null where null has a meaning (completions max_tokens: up to the context) keeps it."""
    eng = FakeEngine()
    nulls = {k: None for k in ("temperature", "top_p", "n", "presence_penalty", "frequency_penalty", "stream",
                               "top_k", "min_p", "repetition_penalty", "ignore_eos", "min_tokens",
                               "skip_special_tokens", "seed", "stop", "logit_bias")}
    with TestClient(build_app(eng, "fake")) as c:
        r = c.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2, "echo": None, "logprobs": None, **nulls})
        assert r.status_code == 200, r.text
        p = eng.params[-1]
        assert (p.temperature, p.top_p, p.n, p.top_k, p.min_p, p.repetition_penalty, p.ignore_eos, p.seed,
                p.logprobs) == (1.0, 1.0, 1, 0, 0.0, 1.0, False, None, None)
        r = c.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": None, **nulls})
        assert r.status_code == 200 and len(r.json()["choices"][0]["text"]) == 64 - 2, r.text
        r = c.post("/v1/completions", json={"prompt": None, "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x", "name": None}],
                                                 "logprobs": None, "add_generation_prompt": None, **nulls})
        assert r.status_code == 400 and "tokenizer" in r.json()["error"]["message"], r.text  # past validation
