"""`jvllm serve` start-up: process start -> /health 200, and -> the first streamed token of one chat
request, with an empty cache and then a warm one.

    python benchmarks/serve_start.py [--model smollm2] [--max-model-len 512] [--dtype float32]
        [--out PATH] [--build before=/tmp/site_before --build after=/tmp/site_after] [-- SERVE FLAGS]

Each run is a fresh `python -m jvllm.cli serve` child against one fresh temporary cache directory
per build (the first run fills it, the second finds it warm). The clock starts just before the
child is spawned, so interpreter start-up and imports count. /health is polled every 20 ms; as
soon as it answers 200, one streamed chat request (max_tokens 8, greedy) is sent and the time of
the first SSE chunk with content is taken; then the server is stopped with SIGTERM. Figures per
run: seconds to healthy, to the first streamed token, to the request's end; the server process's
CPU seconds (all threads) at healthy and at the request's end, which a loaded machine inflates far
less than wall time; the server's own "engine ready" line; the streamed text (must be equal in
every run). Only the standard library is
used on the client side, so the client adds no import time of its own.

`--build LABEL=SITE` as in warm_start.py: SITE goes first on the child's PYTHONPATH, empty for the
installed jvllm; builds are interleaved so that they share the machine's load.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process `pid` so far, all its threads (Linux /proc; else None).
    On a shared machine this is the figure that load inflates least: wall time waits for the cores."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def wait_healthy(port: int, proc, timeout: float) -> float | None:
    """time.time() of the first /health 200, or None when the server died or `timeout` passed."""
    end = time.time() + timeout
    while time.time() < end and proc.poll() is None:
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            c.request("GET", "/health")
            if c.getresponse().status == 200:
                return time.time()
        except OSError:
            pass
        time.sleep(0.02)
    return None


def first_streamed_token(port: int, model: str, timeout: float) -> dict:
    """One streamed chat request: wall-clock times of the first content chunk and of [DONE], and the text."""
    body = json.dumps(dict(model=model, messages=[{"role": "user", "content": "Name three colours."}],
                           max_tokens=8, temperature=0.0, stream=True))
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    t_sent = time.time()
    c.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        return dict(error=f"HTTP {r.status}: {r.read()[:500]!r}")
    first, text = None, []
    for raw in r:
        line = raw.decode().strip()
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        if data == "[DONE]":
            break
        delta = json.loads(data)["choices"][0].get("delta", {})
        if delta.get("content"):
            first = first or time.time()
            text.append(delta["content"])
    return dict(sent=t_sent, first=first, done=time.time(), text="".join(text))


def run_once(model: str, serve_flags: list[str], site: str, cache: str, cwd: str, timeout: float) -> dict:
    port = free_port()
    env = dict(os.environ)
    if site:
        env["PYTHONPATH"] = os.pathsep.join(x for x in (site, os.environ.get("PYTHONPATH")) if x)
    cmd = [sys.executable, "-m", "jvllm.cli", "serve", model, "--port", str(port), "--compilation-cache-dir", cache,
           "--disable-access-log", *serve_flags]
    log = open(os.path.join(cwd, f"serve_{port}.log"), "w+")
    t0 = time.time()
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT)
    out: dict = {}
    try:
        t_health = wait_healthy(port, proc, timeout)
        if t_health is None:
            log.seek(0)
            return dict(error=f"not healthy (rc={proc.poll()})", log_tail=log.read()[-3000:])
        out["process_start_to_healthy_s"] = t_health - t0
        out["cpu_s_at_healthy"] = cpu_seconds(proc.pid)
        req = first_streamed_token(port, model, timeout)
        if "error" in req:
            return dict(out, **req)
        out.update(process_start_to_first_token_s=req["first"] - t0 if req["first"] else None,
                   healthy_to_first_token_s=req["first"] - t_health if req["first"] else None,
                   request_s=req["done"] - req["sent"], text=req["text"], cpu_s_at_done=cpu_seconds(proc.pid))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.seek(0)
        m = re.search(r"engine ready in ([0-9.]+)s", log.read())
        out["engine_ready_line_s"] = float(m.group(1)) if m else None
        log.close()
    return out


def main():
    argv = sys.argv[1:]
    serve_flags = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for healthy / for the request")
    ap.add_argument("--out", default="benchmarks/results/serve_start.json")
    ap.add_argument("--build", action="append", default=[], metavar="LABEL=SITE",
                    help="a build to run (repeatable): SITE first on PYTHONPATH, empty = the installed jvllm")
    a = ap.parse_args(argv)
    builds = {}
    for spec in a.build or ["current="]:
        label, sep, site = spec.partition("=")
        if not sep or not label:
            ap.error(f"--build wants LABEL=SITE, got {spec!r}")
        if site and not os.path.isdir(os.path.join(site, "jvllm")):
            ap.error(f"--build {spec!r}: {site} holds no jvllm package")
        builds[label] = os.path.abspath(site) if site else ""
    flags = ["--max-model-len", str(a.max_model_len), "--dtype", a.dtype, *serve_flags]
    from importlib import metadata

    res = dict(benchmark="serve_start", model=a.model, serve_flags=flags, jax=metadata.version("jax"),
               python=platform.python_version(),
               backend=os.environ.get("JAX_PLATFORMS"), cpus=os.cpu_count(), time=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
               builds=builds, runs={b: {} for b in builds})
    with tempfile.TemporaryDirectory() as d:
        for name in ("empty_cache", "warm_cache"):
            for label, site in builds.items():
                run = run_once(a.model, flags, site, os.path.join(d, "cache_" + label), d, a.timeout)
                res["runs"][label][name] = run
                print(label, name, json.dumps({k: v for k, v in run.items() if k != "log_tail"}), flush=True)
                if "log_tail" in run:
                    print(run["log_tail"], file=sys.stderr)
    texts = [r.get("text") for runs in res["runs"].values() for r in runs.values()]
    res["same_text"] = all(t == texts[0] for t in texts) and texts[0] is not None
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print("same text:", res["same_text"], "->", a.out)


if __name__ == "__main__":
    main()
