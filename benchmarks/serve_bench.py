"""S1, the serving benchmark (see shared BENCHMARKS.md): the OpenAI server under Poisson arrivals.

Workload (seeded; the same lengths and arrivals at every rate, token ids of its own per rate):
    rng = numpy.random.default_rng(seed)            # seed 0 = the S1 figure
    lens = rng.integers(in_min, in_max + 1, N)       # 64..1024 by default
    prompts = [rng.integers(100, min(128000, vocab_size), l) for l in lens]
    out_lens = rng.integers(out_min, out_max + 1, N) # 32..512 by default, ignore_eos, greedy
    the k-th rate (k = 1, 2, ...) replaces the prompts' token ids with ones of the same lengths
    from numpy.random.default_rng([seed, k]), so no rate finds the prompts of an earlier one in
    the server's prefix cache (the S1 JSONs before session 24 sent the same prompts at every rate:
    from the second rate on, their full blocks were cache hits); the warm-up request uses a prompt
    of its own
Arrivals: exponential inter-arrival gaps at each --request-rates value (req/s; "inf" = all at
t=0), from numpy.random.default_rng(seed + 1). Requests are streamed /v1/completions calls with
token-id prompts and stream_options.include_usage. Before the first rate the script waits for the
server's background warm-up (`jvllm:warmup_pending` 0): `jvllm serve --background-compile` (the
default from the core redesign to session 25) answers /health while it still compiles the programs
a first request does not need, and a rate measured then would time those compiles.

Figures per rate: TTFT, TPOT ((e2e - ttft) / (tokens - 1)) and ITL (gaps between content chunks)
at p50 / p99 (ms), request and output-token throughput, failures, and the server's
compiles_after_warmup before/after (must stay 0). JSON with versions, device and config; a
throughput-latency PNG when matplotlib is installed.

Targets either a running server (--base-url) or starts one (MODEL positional + --serve-args),
e.g. on a CPU: python benchmarks/serve_bench.py /path/tiny --num-prompts 8 --input-len 8 32
--output-len 4 16 --request-rates 4,inf --serve-args="--max-model-len 256 --dtype float32"
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import shlex
import socket
import subprocess
import sys
import time


def build_workload(n: int, in_len: tuple[int, int], out_len: tuple[int, int], vocab: int, seed: int = 0,
                   variant: int = 0):
    """(prompts, output lengths). `variant` k > 0: the same lengths, other token ids (one set per
    rate, so that no rate hits an earlier one's prompts in the prefix cache)."""
    import numpy as np

    hi = min(128000, vocab)  # ids drawn over the vocabulary (clipping them made most of a small one's the same)
    lo = min(100, hi - 1)
    rng = np.random.default_rng(seed)
    lens = rng.integers(in_len[0], in_len[1] + 1, n)
    prompts = [rng.integers(lo, hi, int(n_in)).tolist() for n_in in lens]
    outs = rng.integers(out_len[0], out_len[1] + 1, n).tolist()
    if variant:
        tok = np.random.default_rng([seed, variant])
        prompts = [tok.integers(lo, hi, int(n_in)).tolist() for n_in in lens]
    return prompts, outs


def arrival_times(n: int, rate: float, seed: int) -> list[float]:
    import numpy as np

    if math.isinf(rate):
        return [0.0] * n
    gaps = np.random.default_rng(seed + 1).exponential(1.0 / rate, n)
    gaps[0] = 0.0
    return np.cumsum(gaps).tolist()


async def one_request(client, url, model, prompt, max_tokens, t_start, delay, headers):
    await asyncio.sleep(max(0.0, t_start + delay - time.perf_counter()))
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    chunks, ntok, err = [], None, None
    try:
        async with client.stream("POST", url, json=body, headers=headers) as r:
            if r.status_code != 200:
                err = f"HTTP {r.status_code}: {(await r.aread())[:300]!r}"
            else:
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    ev = json.loads(line[6:])
                    if "error" in ev:
                        err = ev["error"].get("message")
                    if ev.get("usage"):
                        ntok = ev["usage"]["completion_tokens"]
                    # a content chunk carries text, or (a model without a tokenizer, e.g. random
                    # weights) token ids with empty text; the final chunk has a finish_reason
                    if any(c.get("text") or c.get("finish_reason") is None for c in ev.get("choices", [])):
                        chunks.append(time.perf_counter())
    except Exception as e:  # network failure counts as a failed request
        err = f"{type(e).__name__}: {e}"
    t1 = time.perf_counter()
    return dict(ok=err is None and bool(chunks), error=err, start=t0, end=t1, chunks=chunks,
                tokens=ntok if ntok is not None else len(chunks), prompt_len=len(prompt))


def thread_cpu(pid: int) -> dict:
    """{tid: CPU seconds} of a process's threads (Linux /proc); {} elsewhere or once it is gone."""
    out, base = {}, f"/proc/{pid}/task"
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    for tid in os.listdir(base) if os.path.isdir(base) else []:
        try:
            s = open(f"{base}/{tid}/stat").read()
        except OSError:
            continue
        f = s[s.rindex(")") + 2:].split()
        out[int(tid)] = (int(f[11]) + int(f[12])) / tick
    return out


def cpu_delta(a: dict, b: dict, main_tid: int, top: int = 6) -> list:
    """The `top` threads by CPU seconds between two thread_cpu snapshots (main: the process's first
    thread, which runs the server's event loop)."""
    rows = sorted(((b[t] - a.get(t, 0.0), t) for t in b), reverse=True)[:top]
    return [dict(tid=t, main=t == main_tid, cpu_s=round(d, 3)) for d, t in rows]


def pct(xs, q):
    import numpy as np

    return float(np.percentile(xs, q)) * 1e3 if len(xs) else None


def summarize(results, duration: float) -> dict:
    ok = [r for r in results if r["ok"]]
    ttft = [r["chunks"][0] - r["start"] for r in ok]
    tpot = [(r["end"] - r["chunks"][0]) / (r["tokens"] - 1) for r in ok if r["tokens"] > 1]
    itl = [b - a for r in ok for a, b in zip(r["chunks"], r["chunks"][1:])]
    out_tok = sum(r["tokens"] for r in ok)
    return dict(completed=len(ok), failed=len(results) - len(ok), duration_s=duration,
                request_throughput=len(ok) / duration if duration > 0 else None,
                output_throughput=out_tok / duration if duration > 0 else None,
                total_input_tokens=sum(r["prompt_len"] for r in ok), total_output_tokens=out_tok,
                ttft_ms_p50=pct(ttft, 50), ttft_ms_p99=pct(ttft, 99), tpot_ms_p50=pct(tpot, 50),
                tpot_ms_p99=pct(tpot, 99), itl_ms_p50=pct(itl, 50), itl_ms_p99=pct(itl, 99),
                errors=sorted({r["error"] for r in results if r["error"]})[:5])


def gauge(client_sync, base, name: str) -> float | None:
    """One `jvllm:` gauge from /metrics; None when the server has no such gauge (another server,
    an older build) or /metrics does not answer."""
    try:
        for line in client_sync.get(base + "/metrics").text.splitlines():
            if line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
    except Exception:
        return None
    return None


def compiles(client_sync, base) -> float | None:
    return gauge(client_sync, base, "jvllm:compiles_after_warmup")


def wait_warm(client_sync, base, timeout: float) -> float:
    """Wait until the server's background warm-up has compiled every program (`jvllm:warmup_pending`
    0, or no such gauge: a server that compiles before it is healthy); requests measured before
    that would wait for compiles and share the CPU with them. Returns the seconds waited."""
    t0 = time.perf_counter()
    while gauge(client_sync, base, "jvllm:warmup_pending"):
        if time.perf_counter() - t0 > timeout:
            raise TimeoutError(f"the server's warm-up still compiled after {timeout:.0f}s (--warmup-timeout)")
        time.sleep(0.5)
    return time.perf_counter() - t0


async def run_rate(base, model, prompts, outs, rate, seed, headers, max_conc):
    import httpx

    times = arrival_times(len(prompts), rate, seed)
    limits = httpx.Limits(max_connections=max_conc or len(prompts) + 8, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=30.0), limits=limits) as client:
        t0 = time.perf_counter()
        res = await asyncio.gather(*[one_request(client, base + "/v1/completions", model, p, o, t0, d, headers)
                                     for p, o, d in zip(prompts, outs, times)])
        return res, time.perf_counter() - t0


def start_server(model: str, serve_args: str, log_path: str):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    cmd = [sys.executable, "-m", "jvllm.cli", "serve", model, "--port", str(port), "--disable-access-log",
           *shlex.split(serve_args)]
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{port}"


def wait_health(base: str, proc=None, timeout: float = 600.0):
    import httpx

    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was healthy")
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return
        except Exception:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{base}/health did not answer within {timeout}s")


def plot(path: str, rows: list[dict]):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = [r for r in rows if r["completed"]]
    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    x = [r["request_throughput"] for r in rows]
    for key, style in (("ttft_ms_p50", "o-"), ("ttft_ms_p99", "o--")):
        ax[0].plot(x, [r[key] for r in rows], style, label=key)
    for key, style in (("tpot_ms_p50", "s-"), ("tpot_ms_p99", "s--"), ("itl_ms_p99", "^:")):
        ax[1].plot(x, [r[key] for r in rows], style, label=key)
    for a, t in zip(ax, ("time to first token", "time per output token")):
        a.set_xlabel("achieved request throughput (req/s)")
        a.set_ylabel("ms")
        a.set_title(t)
        a.grid(alpha=0.3)
        a.legend()
    for r, xx in zip(rows, x):
        ax[0].annotate(str(r["request_rate"]), (xx, r["ttft_ms_p50"]), fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", nargs="?", default=None, help="start `jvllm serve MODEL` (unless --base-url)")
    ap.add_argument("--base-url", default=None, help="a running server, e.g. http://127.0.0.1:8000")
    ap.add_argument("--serve-args", default="", help="extra flags for the server this script starts")
    ap.add_argument("--api-key", default=os.environ.get("JVLLM_API_KEY"))
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--input-len", type=int, nargs=2, default=(64, 1024), metavar=("MIN", "MAX"))
    ap.add_argument("--output-len", type=int, nargs=2, default=(32, 512), metavar=("MIN", "MAX"))
    ap.add_argument("--request-rates", default="1,2,4,8,inf", help="comma-separated req/s; inf = burst")
    ap.add_argument("--max-concurrency", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup-timeout", type=float, default=600.0,
                    help="seconds to wait for the server's background warm-up before the first rate")
    ap.add_argument("--output-json", default="benchmarks/results/serve_bench.json")
    ap.add_argument("--plot", default=None, help="PNG path (default: next to the JSON)")
    a = ap.parse_args(argv)
    import httpx

    if (a.base_url is None) == (a.model is None):
        ap.error("give exactly one of MODEL (start a server) or --base-url")
    proc = None
    base = a.base_url.rstrip("/") if a.base_url else None
    startup = {}
    t_launch = time.perf_counter()
    try:
        if base is None:
            out_dir = os.path.dirname(os.path.abspath(a.output_json))
            os.makedirs(out_dir, exist_ok=True)
            proc, base = start_server(a.model, a.serve_args, os.path.join(out_dir, "serve_bench_server.log"))
            wait_health(base, proc)
            startup["process_start_to_health_s"] = time.perf_counter() - t_launch
        else:
            wait_health(base, timeout=60)
        headers = {"Authorization": f"Bearer {a.api_key}"} if a.api_key else {}
        sync = httpx.Client(timeout=30, headers=headers)
        card = sync.get(base + "/v1/models").json()["data"][0]
        server_version = sync.get(base + "/version").json()
        model, vocab, max_len = card["id"], card.get("vocab_size") or 128256, card["max_model_len"]
        if a.input_len[1] + a.output_len[1] > max_len:
            sys.exit(f"--input-len max {a.input_len[1]} + --output-len max {a.output_len[1]} exceeds the "
                     f"server's max_model_len {max_len}: shorten them")
        prompts, outs = build_workload(a.num_prompts, tuple(a.input_len), tuple(a.output_len), vocab, a.seed)
        asyncio.run(run_rate(base, model, prompts[:1], [4], math.inf, a.seed, headers, None))  # warm-up
        if proc is not None:
            startup["process_start_to_first_request_done_s"] = time.perf_counter() - t_launch
        startup["warmup_wait_s"] = wait_warm(sync, base, a.warmup_timeout)
        if proc is not None:
            startup["process_start_to_warm_s"] = time.perf_counter() - t_launch
            print(f"server: healthy {startup['process_start_to_health_s']:.1f}s, first request done "
                  f"{startup['process_start_to_first_request_done_s']:.1f}s, warm-up done "
                  f"{startup['process_start_to_warm_s']:.1f}s after launch", flush=True)
        c0 = compiles(sync, base)
        rows = []
        for k, tok in enumerate(a.request_rates.split(","), 1):
            rate = float(tok)
            prompts = build_workload(a.num_prompts, tuple(a.input_len), tuple(a.output_len), vocab, a.seed, k)[0]
            srv0, cli0 = thread_cpu(proc.pid) if proc is not None else {}, time.process_time()
            res, dur = asyncio.run(run_rate(base, model, prompts, outs, rate, a.seed, headers, a.max_concurrency))
            row = dict(request_rate=tok.strip(), **summarize(res, dur), client_cpu_s=round(time.process_time() - cli0, 3))
            if proc is not None:  # where the server's CPU went: event loop (main), engine thread, XLA's
                row["server_threads_cpu_s"] = cpu_delta(srv0, thread_cpu(proc.pid), proc.pid)
            rows.append(row)
            print(f"rate {row['request_rate']:>5}: {row['completed']}/{len(res)} ok, "
                  f"{row['request_throughput']:.2f} req/s, {row['output_throughput']:.1f} tok/s, "
                  f"TTFT p50/p99 {row['ttft_ms_p50']:.1f}/{row['ttft_ms_p99']:.1f} ms, "
                  f"TPOT p50/p99 {row['tpot_ms_p50'] or 0:.1f}/{row['tpot_ms_p99'] or 0:.1f} ms, "
                  f"ITL p50/p99 {row['itl_ms_p50'] or 0:.1f}/{row['itl_ms_p99'] or 0:.1f} ms", flush=True)
        c1 = compiles(sync, base)
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    import numpy

    result = dict(
        benchmark="S1", config=dict(num_prompts=a.num_prompts, input_len=list(a.input_len),
                                    output_len=list(a.output_len), request_rates=a.request_rates, seed=a.seed,
                                    max_concurrency=a.max_concurrency, model=model, max_model_len=max_len,
                                    vocab_size=vocab, serve_args=a.serve_args, base_url=a.base_url),
        versions=dict(python=platform.python_version(), numpy=numpy.__version__, httpx=httpx.__version__,
                      server=server_version),
        device=server_version.get("devices"), host=platform.node(),
        compiles_after_warmup=dict(before=c0, after=c1), server_startup=startup, results=rows,
        time=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    os.makedirs(os.path.dirname(os.path.abspath(a.output_json)), exist_ok=True)
    png = a.plot or os.path.splitext(a.output_json)[0] + ".png"
    result["plot"] = plot(png, rows)
    with open(a.output_json, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {a.output_json}" + (f" and {result['plot']}" if result["plot"] else ""))
    return result


if __name__ == "__main__":
    main()
