"""S1's workload replayed without HTTP, to split serving latency between the engine, the server's
engine thread and the HTTP layer (issue 25 item 3).

Modes (each at every --request-rates value, the seeded workload and arrivals of serve_bench.py,
every run with prompts of its own, as serve_bench's rates have, so none hits the prefix cache):
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


STAT_KEYS = ("num_steps", "host_seconds", "device_wait_seconds", "overlap_host_seconds", "num_bucket_cuts")


def stats_delta(a: dict, b: dict) -> dict:
    return {k: round(b.get(k, 0) - a.get(k, 0), 4) for k in STAT_KEYS if k in b}


def replay_engine(eng, prompts, outs, times, params_for, steps=None):
    """`steps`, a list: gets (wall seconds, rows with tokens, rows with their first token, requests
    added just before) per step."""
    t0 = time.perf_counter()
    res = [dict(ok=False, error=None, start=t0 + d, end=None, chunks=[], tokens=0, prompt_len=len(p))
           for p, d in zip(prompts, times)]
    order, nxt = sorted(range(len(prompts)), key=lambda i: times[i]), 0
    while nxt < len(order) or eng.has_unfinished_requests():
        now = time.perf_counter()
        added = 0
        while nxt < len(order) and t0 + times[order[nxt]] <= now:
            i = order[nxt]
            eng.add_request(f"r{i}", {"prompt_token_ids": prompts[i]}, params_for(outs[i]))
            nxt, added = nxt + 1, added + 1
        if not eng.has_unfinished_requests():
            time.sleep(max(0.0, t0 + times[order[nxt]] - time.perf_counter()))
            continue
        ts = time.perf_counter()
        step_out = eng.step()
        t = time.perf_counter()
        rows = firsts = 0
        for o in step_out:
            r = res[int(o.request_id[1:])]
            k = len(o.outputs[0].token_ids) if o.outputs else 0
            rows += bool(k)
            firsts += bool(k and not r["chunks"])
            if k:
                r["chunks"].append(t)
                r["tokens"] += k
            if o.finished:
                r["end"], r["ok"] = t, bool(r["chunks"])
        if steps is not None:
            steps.append((t - ts, rows, firsts, added))
    return res, time.perf_counter() - t0


def step_summary(steps: list) -> dict:
    """Step wall times (ms) overall and for steady steps (no request added before, none got its
    first token: decode-only, as far as the caller can tell), with the rows they served."""
    import numpy as np

    def pcts(rows):
        if not rows:
            return None
        dt = np.array([r[0] for r in rows]) * 1e3
        return dict(n=len(rows), ms_p10=round(float(np.percentile(dt, 10)), 3), ms_p50=round(float(np.percentile(dt, 50)), 3),
                    ms_p90=round(float(np.percentile(dt, 90)), 3), ms_mean=round(float(dt.mean()), 3),
                    rows_mean=round(float(np.mean([r[1] for r in rows])), 2))

    return dict(all=pcts(steps), steady=pcts([r for r in steps if not r[2] and not r[3]]),
                with_first_tokens=pcts([r for r in steps if r[2]]))


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
    ap.add_argument("--fit-chunks-to-buckets", action="store_true", help="the engine option of that name")
    ap.add_argument("--cprofile-rate", default=None, help="after the runs, the engine mode at this rate under cProfile: "
                    "the top functions (host time, inflated by the profiler) into the JSON")
    ap.add_argument("--output-json", default="serve_replay.json")
    a = ap.parse_args(argv)
    if a.switch_interval is not None:
        sys.setswitchinterval(a.switch_interval)

    from jvllm.engine.engine import EngineConfig, LLMEngine
    from jvllm.sampling_params import RequestOutputKind, SamplingParams
    from jvllm.server.async_engine import AsyncEngine

    eng = LLMEngine(EngineConfig(model=a.model, max_model_len=a.max_model_len, dtype=a.dtype,
                                 fit_chunks_to_buckets=a.fit_chunks_to_buckets))
    vocab = eng.model_config.vocab_size if hasattr(eng, "model_config") else 32000
    prompts, outs = serve_bench.build_workload(a.num_prompts, tuple(a.input_len), tuple(a.output_len), vocab, a.seed)

    def params_for(n):
        return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, output_kind=RequestOutputKind.DELTA)

    eng.add_request("warm", {"prompt_token_ids": prompts[0][:16]}, params_for(4))
    while eng.has_unfinished_requests():
        eng.step()
    t_w = time.perf_counter()
    eng.wait_for_warmup()
    results = dict(benchmark="serve_replay", model=a.model, config=vars(a), warmup_wait_s=time.perf_counter() - t_w,
                   runs=[])
    variant = 0
    for mode in a.modes.split(","):
        for rate_s in a.request_rates.split(","):
            variant += 1
            prompts = serve_bench.build_workload(a.num_prompts, tuple(a.input_len), tuple(a.output_len), vocab, a.seed,
                                                 variant)[0]
            times = serve_bench.arrival_times(len(prompts), float(rate_s), a.seed)
            s0, c0 = dict(eng.get_stats()), serve_bench.thread_cpu(os.getpid())
            steps = []
            if mode == "engine":
                res, dur = replay_engine(eng, prompts, outs, times, params_for, steps)
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
            if steps:
                row["steps"] = step_summary(steps)
            results["runs"].append(row)
            print(f"{mode:6s} rate {rate_s:>4s}: TTFT p50/p99 {row['ttft_ms_p50']:.1f}/{row['ttft_ms_p99']:.1f} ms, "
                  f"TPOT p50/p99 {row['tpot_ms_p50']:.2f}/{row['tpot_ms_p99']:.2f} ms, ITL p50/p99 "
                  f"{row['itl_ms_p50']:.2f}/{row['itl_ms_p99']:.2f} ms, {row['engine']}, steps {row.get('steps')}, "
                  f"threads {row['threads'][:3]}", flush=True)
    if a.cprofile_rate is not None:
        import cProfile
        import pstats

        prompts = serve_bench.build_workload(a.num_prompts, tuple(a.input_len), tuple(a.output_len), vocab, a.seed,
                                             variant + 1)[0]
        times = serve_bench.arrival_times(len(prompts), float(a.cprofile_rate), a.seed)
        prof = cProfile.Profile()
        prof.enable()
        replay_engine(eng, prompts, outs, times, params_for)
        prof.disable()
        st = pstats.Stats(prof)
        rows = [dict(function=f"{os.path.basename(fn)}:{line}({name})", calls=nc, tottime_s=round(tt, 4),
                     cumtime_s=round(ct, 4)) for (fn, line, name), (cc, nc, tt, ct, _) in st.stats.items()]
        results["cprofile"] = dict(rate=a.cprofile_rate, top_tottime=sorted(rows, key=lambda r: -r["tottime_s"])[:30],
                                   top_cumtime=sorted(rows, key=lambda r: -r["cumtime_s"])[:40])
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
