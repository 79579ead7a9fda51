"""S1's workload replayed without HTTP, to split serving latency between the engine, the server's
engine thread and the HTTP layer (issue 25 item 3).

Modes (each at every --request-rates value, same seeded workload and arrivals as serve_bench.py):
  engine  one thread: add the requests whose arrival time has passed, `LLMEngine.step()`, stamp
          every request that got tokens; the floor any server on this engine can reach
  async   the server's AsyncEngine (engine thread + asyncio consumers, as `jvllm serve` runs it),
          stamps taken by the consumers on the event loop: adds the thread hand-off and the GIL,
          not HTTP
Per mode and rate: TTFT / TPOT / ITL p50 / p99 (serve_bench.summarize), the engine's step count and
host / device-wait seconds, and the CPU seconds of the process's busiest threads (/proc), so that
an engine thread starved of the GIL shows as wall time its own CPU time does not explain.

    python benchmarks/probes/serve_replay.py random:llama3-8b --modes engine,async --output-json out.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import serve_bench  # noqa: E402


STAT_KEYS = ("num_steps", "host_seconds", "device_wait_seconds", "overlap_host_seconds")


def stats_delta(a: dict, b: dict) -> dict:
    return {k: round(b.get(k, 0) - a.get(k, 0), 4) for k in STAT_KEYS if k in b}


def replay_engine(eng, prompts, outs, times, params_for):
    t0 = time.perf_counter()
    res = [dict(ok=False, error=None, start=t0 + d, end=None, chunks=[], tokens=0, prompt_len=len(p))
           for p, d in zip(prompts, times)]
    order, nxt = sorted(range(len(prompts)), key=lambda i: times[i]), 0
    while nxt < len(order) or eng.has_unfinished_requests():
        now = time.perf_counter()
        while nxt < len(order) and t0 + times[order[nxt]] <= now:
            i = order[nxt]
            eng.add_request(f"r{i}", {"prompt_token_ids": prompts[i]}, params_for(outs[i]))
            nxt += 1
        if not eng.has_unfinished_requests():
            time.sleep(max(0.0, t0 + times[order[nxt]] - time.perf_counter()))
            continue
        step_out = eng.step()
        t = time.perf_counter()
        for o in step_out:
            r = res[int(o.request_id[1:])]
            k = len(o.outputs[0].token_ids) if o.outputs else 0
            if k:
                r["chunks"].append(t)
                r["tokens"] += k
            if o.finished:
                r["end"], r["ok"] = t, bool(r["chunks"])
    return res, time.perf_counter() - t0


async def replay_async(aeng, prompts, outs, times, params_for):
    t0 = time.perf_counter()

    async def one(i):
        r = dict(ok=False, error=None, start=t0 + times[i], end=None, chunks=[], tokens=0, prompt_len=len(prompts[i]))
        await asyncio.sleep(max(0.0, t0 + times[i] - time.perf_counter()))
        sub = await aeng.submit([(f"a{i}", {"prompt_token_ids": prompts[i]}, params_for(outs[i]))])
        try:
            async for _, o in sub:
                k = len(o.outputs[0].token_ids) if o.outputs else 0
                if k:
                    r["chunks"].append(time.perf_counter())
                    r["tokens"] += k
        finally:
            sub.close()
        r["end"], r["ok"] = time.perf_counter(), bool(r["chunks"])
        return r

    res = await asyncio.gather(*[one(i) for i in range(len(prompts))])
    return res, time.perf_counter() - t0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--modes", default="engine,async")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, nargs=2, default=(64, 1024))
    ap.add_argument("--output-len", type=int, nargs=2, default=(32, 512))
    ap.add_argument("--request-rates", default="4,8,16,inf")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--switch-interval", type=float, default=None, help="sys.setswitchinterval for the run")
    ap.add_argument("--output-json", default="serve_replay.json")
    a = ap.parse_args(argv)
    if a.switch_interval is not None:
        sys.setswitchinterval(a.switch_interval)

    from jvllm.engine.engine import EngineConfig, LLMEngine
    from jvllm.sampling_params import RequestOutputKind, SamplingParams
    from jvllm.server.async_engine import AsyncEngine

    eng = LLMEngine(EngineConfig(model=a.model, max_model_len=a.max_model_len, dtype=a.dtype))
    vocab = eng.model_config.vocab_size if hasattr(eng, "model_config") else 32000
    prompts, outs = serve_bench.build_workload(a.num_prompts, tuple(a.input_len), tuple(a.output_len), vocab, a.seed)

    def params_for(n):
        return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, output_kind=RequestOutputKind.DELTA)

    eng.add_request("warm", {"prompt_token_ids": prompts[0][:16]}, params_for(4))
    while eng.has_unfinished_requests():
        eng.step()
    t_w = time.perf_counter()
    while eng.get_stats().get("warmup_pending"):
        time.sleep(0.5)
    results = dict(benchmark="serve_replay", model=a.model, config=vars(a), warmup_wait_s=time.perf_counter() - t_w,
                   runs=[])
    for mode in a.modes.split(","):
        for rate_s in a.request_rates.split(","):
            times = serve_bench.arrival_times(len(prompts), float(rate_s), a.seed)
            s0, c0 = dict(eng.get_stats()), serve_bench.thread_cpu(os.getpid())
            if mode == "engine":
                res, dur = replay_engine(eng, prompts, outs, times, params_for)
            elif mode == "async":
                async def go():
                    aeng = AsyncEngine(eng)
                    aeng.start()
                    try:
                        return await replay_async(aeng, prompts, outs, times, params_for)
                    finally:
                        await aeng.shutdown()
                res, dur = asyncio.run(go())
            else:
                raise SystemExit(f"--modes: unknown mode {mode!r} (engine, async)")
            c1 = serve_bench.thread_cpu(os.getpid())
            row = dict(mode=mode, request_rate=rate_s, **serve_bench.summarize(res, dur),
                       engine=stats_delta(s0, eng.get_stats()), threads=serve_bench.cpu_delta(c0, c1, os.getpid()))
            results["runs"].append(row)
            print(f"{mode:6s} rate {rate_s:>4s}: TTFT p50/p99 {row['ttft_ms_p50']:.1f}/{row['ttft_ms_p99']:.1f} ms, "
                  f"TPOT p50/p99 {row['tpot_ms_p50']:.2f}/{row['tpot_ms_p99']:.2f} ms, ITL p50/p99 "
                  f"{row['itl_ms_p50']:.2f}/{row['itl_ms_p99']:.2f} ms, {row['engine']}, {row['threads']}", flush=True)
    try:
        import jax
        results["versions"] = dict(jax=jax.__version__, python=sys.version.split()[0])
        results["device"] = [getattr(d, "device_kind", str(d)) for d in jax.devices()]
    except Exception:
        pass
    with open(a.output_json, "w") as f:
        json.dump(results, f, indent=1)
    print("wrote", a.output_json)


if __name__ == "__main__":
    main()
