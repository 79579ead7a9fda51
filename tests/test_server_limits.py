"""Server limits on a server with ONE engine slot and a queue of ONE (--max-num-seqs 1
--max-queue-len 1): admission is `max_num_seqs + max_queue_len` = 2 engine requests, so of 10
simultaneous long requests exactly 2 get 200 and 8 get 503 + Retry-After. Then SIGTERM with a
request in flight (this test ends the module's server, so it runs last in this file)."""
from __future__ import annotations

import asyncio
import signal
import threading
import time

import pytest

from tests.test_server import MODEL, L, ServerProcess, assert_error

httpx = pytest.importorskip("httpx")


@pytest.fixture(scope="module")
def server(tmp_path_factory, ckpt_dir):
    d = ckpt_dir("llama", tokenizer=True, max_position_embeddings=L)
    srv = ServerProcess(d, str(tmp_path_factory.mktemp("srv_limits") / "server.log"), "--max-queue-len", "1",
                        "--drain-timeout", "20", max_num_seqs=1)
    yield srv
    srv.stop()


def test_queue_limit(server):
    """Deterministic as long as the 10 requests arrive before the first admitted one ends: the
    connections are opened first, so the 10 POSTs leave within milliseconds, and each admitted
    request runs 255 engine steps (hundreds of ms even on a fast machine)."""
    body = {"model": MODEL, "prompt": "Queue", "max_tokens": 255, "temperature": 0, "ignore_eos": True}

    async def main():
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=10)) as c:
            await asyncio.gather(*[c.get(server.url + "/health") for _ in range(10)])  # open 10 connections
            return await asyncio.gather(*[c.post(server.url + "/v1/completions", json=body) for _ in range(10)])

    res = asyncio.run(main())
    codes = sorted(r.status_code for r in res)
    assert codes == [200, 200] + [503] * 8, codes
    for r in res:
        if r.status_code == 503:
            assert r.headers.get("retry-after") == "1"
            assert_error(r, 503, "max_queue_len")
        else:
            assert r.json()["choices"][0]["finish_reason"] == "length"
    # the queue is free again
    r = httpx.post(server.url + "/v1/completions", json={**body, "max_tokens": 2}, timeout=30)
    assert r.status_code == 200
    m = server.metrics()
    assert m['jvllm:request_rejected_total{"reason": "queue_full"}'] == 8
    assert m["jvllm:num_requests_admitted"] == 0


def test_sigterm_drains(server):
    """In-flight stream finishes after SIGTERM; new requests are refused; exit 0 in bounded time."""
    body = {"model": MODEL, "prompt": "Drain", "max_tokens": 150, "temperature": 0, "ignore_eos": True,
            "stream": True}
    events, started = [], threading.Event()

    def stream():
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    started.set()

    t = threading.Thread(target=stream)
    t.start()
    assert started.wait(30)
    t0 = time.time()
    server.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    try:  # new requests: refused (connection closed, or 503 on a connection still open)
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}, timeout=5)
        assert r.status_code == 503, r.text
    except httpx.TransportError:
        pass
    t.join(30)
    assert not t.is_alive()
    assert events[-1] == "[DONE]"
    import json

    finish = [json.loads(e)["choices"][0]["finish_reason"] for e in events[:-1]]
    assert finish[-1] == "length"
    assert server.proc.wait(30) == 0
    assert time.time() - t0 < 25
    log = server.tail(20000)
    assert "Traceback" not in log, log
