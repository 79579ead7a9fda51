"""The server forwards the research fields (issue 23): `return_hidden_states` comes back per choice
(body and stream), `steering` reaches the engine; bad values are 400s naming
the field. In process (TestClient) on a real engine, checked against the offline API."""
from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from jvllm import LLM, SamplingParams  # noqa: E402
from jvllm.server.app import build_app  # noqa: E402

PROMPT = [5, 9, 200, 31, 17, 4, 8, 100]
C = "/v1/completions"


@pytest.fixture(scope="module")
def llm(ckpt_dir):
    # one token bucket: the fewest step programs (batch-invariant mode, tried before, compiles its
    # interpret-mode Pallas matmuls for every hidden-state and steering variant: 4 minutes here)
    llm = LLM(ckpt_dir("llama", tokenizer=True), dtype="float32", max_model_len=64, max_num_batched_tokens=32,
              max_num_seqs=4, token_buckets=(32,), use_tqdm_on_load=False)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def offline(llm):
    """Offline answers first (the app's engine thread owns the engine while the client is open)."""
    L, D = llm.llm_engine.model_config.num_layers, llm.llm_engine.model_config.hidden_size
    vec = np.linspace(-3, 3, D).astype(np.float32)

    def gen(**kw):
        sp = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, **kw)
        return llm.generate([{"prompt_token_ids": PROMPT}], sp, use_tqdm=False)[0].outputs[0]

    return dict(L=L, D=D, vec=vec, plain=gen(), hidden=gen(return_hidden_states=[0, L]),
                steered=gen(steering={1: vec}))


@pytest.fixture(scope="module")
def client(llm, offline):
    with TestClient(build_app(llm.llm_engine, "tiny")) as c:
        yield c


def _body(**kw):
    return dict(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0.0, ignore_eos=True, **kw)


def test_hidden_states_in_the_body_equal_offline(client, offline):
    L = offline["L"]
    r = client.post(C, json=_body(return_hidden_states=[0, L]))
    assert r.status_code == 200, r.text
    ch = r.json()["choices"][0]
    assert ch["text"] == offline["hidden"].text
    hs = ch["hidden_states"]
    assert sorted(hs) == ["0", str(L)]
    for k in (0, L):
        want = offline["hidden"].hidden_states[k]
        got = np.asarray(hs[str(k)], np.float32)
        assert got.shape == want.shape == (len(PROMPT) + 4, offline["D"])  # the last sampled token: none
        np.testing.assert_array_equal(got, want)
    plain = client.post(C, json=_body()).json()["choices"][0]
    assert "hidden_states" not in plain


def test_hidden_states_on_the_last_streamed_chunk(client, offline):
    with client.stream("POST", C, json=_body(return_hidden_states=[1], stream=True)) as r:
        assert r.status_code == 200
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    with_hs = [c for c in chunks if "hidden_states" in c["choices"][0]]
    assert len(with_hs) == 1 and with_hs[0] is chunks[-1] and chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert np.asarray(with_hs[0]["choices"][0]["hidden_states"]["1"]).shape == (len(PROMPT) + 4, offline["D"])


def test_steering_reaches_the_engine(client, offline):
    steer = {"1": offline["vec"].tolist()}
    assert offline["steered"].token_ids != offline["plain"].token_ids  # the vector is strong enough to show
    r = client.post(C, json=_body(steering=steer))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == offline["steered"].text
    # a batch of prompts in one request: each is steered (per-request isolation: tests/test_research.py)
    both = client.post(C, json=_body(steering=steer) | dict(prompt=[PROMPT[:6], PROMPT])).json()["choices"]
    assert both[1]["text"] == offline["steered"].text
    assert client.post(C, json=_body()).json()["choices"][0]["text"] == offline["plain"].text
    chat = client.post("/v1/chat/completions", json=dict(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                         max_tokens=3, steering=steer, return_hidden_states=[0]))
    assert chat.status_code == 200, chat.text
    assert "0" in chat.json()["choices"][0]["hidden_states"]


@pytest.mark.parametrize("field,value,words", [
    ("return_hidden_states", [99], ["return_hidden_states", "outside"]),
    ("return_hidden_states", [0, 0], ["return_hidden_states", "distinct"]),
    ("return_hidden_states", [], ["return_hidden_states"]),
    ("steering", {"0": [1.0, 2.0]}, ["steering", "hidden size"]),
    ("steering", {"50": [1.0]}, ["steering", "outside"]),
    ("steering", {"x": [1.0]}, ["steering"]),
    ("steering", {"0": ["a"]}, ["steering"]),
])
def test_bad_research_fields_are_400s_naming_them(client, field, value, words):
    r = client.post(C, json=_body(**{field: value}))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    for w in words:
        assert w in err["message"] or w == err["param"], (w, err)
    assert field in (err["param"] or "") + err["message"]
