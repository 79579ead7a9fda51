"""Where a decode step's time goes: a JAX profiler trace (CUPTI on GPUs) of N engine steps of B1
(one request) or W1 (256 requests, once all are decoding; `w1_prefill`: W1's first steps after
two warm ones, the prompt chunks that fill its prefill phase), summarised per kernel and per host
function into JSON, so design questions (small kernels around the matmuls at batch 1, attention
share at batch 256, what the host blocks on in a step call) are settled by a profile.

    [jvllm launch --nproc 2 --] python benchmarks/profile_steps.py --workload b1|w1|w1_prefill|copy --model random:llama3-8b --dtype bfloat16 \
        [--steps 20] [--out $OUT/profile_b1.json] [--keep-trace] [engine flags, as for jvllm bench]

`copy`: B1 on spec_workload.py's "oproj" weights with a prompt that holds its own greedy
continuation (every --corrupt-every-th copied token changed), so that an engine with
--speculative-config ngram speculates as in spec_b1.py's headline case; without it, the plain
steps of the same request.

JSON: per device track, busy time per step (the union of its kernels' intervals) and the top
kernels (total / per-step ms, calls, share of busy time); for the host's Python thread and the
runtime's threads, the top events by total time; wall time per step. --keep-trace copies the
Perfetto trace (.json.gz, open in ui.perfetto.dev) next to the JSON.
"""
from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import shutil
import sys
import tempfile
import time


def _merge(ivs):
    """Sorted, disjoint union of (start, end) intervals."""
    out = []
    for s, t in sorted(ivs):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], t)
        else:
            out.append([s, t])
    return out


def _intersect(a, b):
    """Intersection of two merged interval lists."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        s, t = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if s < t:
            out.append([s, t])
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def summarize(trace: dict, steps: int, top: int = 40) -> dict:
    """Per track (device stream or host thread): busy time per step (union of its events), the
    top events by time. With kernels on several devices (TP, PP): `devices` gives each device's
    busy time per step and the time all of them are busy at once (pipeline stages that overlap
    raise it; stages that take turns leave it near 0)."""
    ev = trace["traceEvents"] if isinstance(trace, dict) else trace
    pname, tname = {}, {}
    for e in ev:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            pname[e["pid"]] = e["args"]["name"]
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            tname[(e["pid"], e.get("tid"))] = e["args"]["name"]
    tracks = collections.defaultdict(list)
    for e in ev:  # the profiler's own start/stop (and the `with` around it) are not step time
        if e.get("ph") == "X" and "dur" in e and not any(m in e.get("name", "") for m in ("profiler.py", "contextlib.py")):
            tracks[(e["pid"], e.get("tid"))].append(e)
    out = dict(steps=steps, device_tracks={}, host_tracks={})
    per_device = collections.defaultdict(list)
    for key, es in tracks.items():
        proc, thr = pname.get(key[0], str(key[0])), tname.get(key, str(key[1]))
        is_dev = any(s in proc.lower() for s in ("gpu", "device:", "/device")) and "host" not in proc.lower()
        by = collections.defaultdict(lambda: [0.0, 0])
        for e in es:
            b = by[e["name"]]
            b[0] += e["dur"]
            b[1] += 1
        merged = _merge((e["ts"], e["ts"] + e["dur"]) for e in es)  # nested host events counted once
        busy = sum(t - s for s, t in merged)
        span = (merged[-1][1] - merged[0][0]) if merged else 0.0
        if is_dev:
            per_device[proc].extend(merged)
        rows = sorted(by.items(), key=lambda kv: -kv[1][0])[:top]
        entry = dict(process=proc, thread=thr, events=len(es), busy_ms_per_step=busy / 1e3 / steps,
                     span_ms=span / 1e3,
                     top=[dict(name=n[:160], total_ms=d / 1e3, ms_per_step=d / 1e3 / steps, calls=c,
                               calls_per_step=c / steps, share_of_busy=(d / busy if busy else None) if is_dev else None)
                          for n, (d, c) in rows])
        (out["device_tracks"] if is_dev else out["host_tracks"])[f"{proc} | {thr}"] = entry
    busy = {d: _merge(v) for d, v in per_device.items()}
    if len(busy) > 1:
        both = None
        for v in busy.values():
            both = v if both is None else _intersect(both, v)
        out["devices"] = dict(busy_ms_per_step={d: sum(t - s for s, t in v) / 1e3 / steps for d, v in busy.items()},
                              all_busy_ms_per_step=sum(t - s for s, t in both) / 1e3 / steps)
    # keep the host tracks that matter: the busiest 6
    ht = sorted(out["host_tracks"].items(), key=lambda kv: -kv[1]["busy_ms_per_step"])[:6]
    out["host_tracks"] = dict(ht)
    return out


def main(argv=None):
    from jvllm.bench import build_llm, one_prompt, sampling_params, versions, w1_prompts
    from jvllm.bench.run import settle
    from jvllm.cli import add_engine_args, engine_kwargs

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", choices=("b1", "w1", "w1_prefill", "copy"), default="b1")
    ap.add_argument("--corrupt-every", type=int, default=6, help="copy: J (spec_workload.make_case)")
    ap.add_argument("--model", default="random:llama3-8b")
    add_engine_args(ap)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=512, help="B1 prompt length (W1: 64..1024 as in bench)")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "profile.json"))
    ap.add_argument("--keep-trace", action="store_true")
    ap.add_argument("--no-python-trace", action="store_true",
                    help="no Python function events (they slow the host several-fold: use for host-bound runs "
                         "such as pipeline stages, where a slower host changes the device timeline)")
    a = ap.parse_args(argv)
    ekw = {k: v for k, v in engine_kwargs(a).items() if v is not None}
    import jax

    llm, st = build_llm(a.model, ekw)
    settle(llm, st)  # the background warm-up's compiles would be in the trace and block step calls
    eng = llm.llm_engine
    vocab = eng.model_config.vocab_size
    big = a.steps * 4 + 64
    if a.workload == "copy":
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from spec_b1 import continuations
        from spec_workload import apply, make_case

        apply(llm, "oproj")
        seed = one_prompt(64, vocab, seed=7)
        cont = continuations(llm, [seed], big + 8, want_gaps=False)[0][0]
        eng.add_request("p0", {"prompt_token_ids": make_case(seed, cont, big, a.corrupt_every, vocab).prompt},
                        sampling_params(big))
        warm = 8
    elif a.workload == "b1":
        eng.add_request("p0", {"prompt_token_ids": one_prompt(a.input_len, vocab, seed=7)}, sampling_params(big))
        warm = 8
    else:
        for i, p in enumerate(w1_prompts(a.num_prompts, (64, 1024), vocab)):
            eng.add_request(f"w{i}", {"prompt_token_ids": p}, sampling_params(big + 200))
        warm = 2 if a.workload == "w1_prefill" else 0
    for _ in range(warm):
        eng.step()
    if a.workload == "w1":  # until every request decodes (no prompt tokens left), then a few more
        while eng.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in eng.scheduler.running):
            eng.step()
        for _ in range(4):
            eng.step()
    d = tempfile.mkdtemp(prefix="jvllm_prof_")
    s0 = llm.get_stats()
    opts = jax.profiler.ProfileOptions()
    if a.no_python_trace:
        opts.python_tracer_level = 0
    t_wall = time.time()
    with jax.profiler.trace(d, create_perfetto_trace=True, profiler_options=opts):
        t = time.perf_counter()
        for _ in range(a.steps):
            eng.step()
        eng.drain()
        wall = time.perf_counter() - t
    s1 = llm.get_stats()
    paths = glob.glob(os.path.join(d, "**", "perfetto_trace.json.gz"), recursive=True)
    if not paths:
        raise SystemExit(f"no perfetto trace under {d}")
    trace = json.load(gzip.open(paths[0]))
    res = dict(workload=a.workload, model=a.model, engine=ekw, versions=versions(), startup=st,
               wall_ms_per_step=wall * 1e3 / a.steps, batch=len(eng.scheduler.running),
               engine_stats_delta={k: s1[k] - s0[k] for k in s1 if isinstance(s1.get(k), (int, float))
                                   and isinstance(s0.get(k), (int, float))},
               **summarize(trace, a.steps))
    out = a.out
    if jax.process_count() > 1:  # under jvllm launch each process profiles its own devices: a file each
        res["process_index"] = jax.process_index()
        res["trace_start_unix_s"] = t_wall  # to line the processes' timelines up
        if jax.process_index():
            out = f"{os.path.splitext(a.out)[0]}.p{jax.process_index()}.json"
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    json.dump(res, open(out, "w"), indent=1, default=str)
    if a.keep_trace:
        shutil.copy(paths[0], os.path.splitext(out)[0] + ".perfetto.json.gz")
    print(f"{a.workload}: {res['wall_ms_per_step']:.2f} ms/step wall, batch {res['batch']}")
    if "devices" in res:
        print(f"  devices busy ms/step {res['devices']['busy_ms_per_step']}, all at once "
              f"{res['devices']['all_busy_ms_per_step']:.2f}")
    for k, v in res["device_tracks"].items():
        print(f"  {k}: busy {v['busy_ms_per_step']:.2f} ms/step, {v['events']} events")
        for r in v["top"][:12]:
            print(f"    {r['ms_per_step']:7.3f} ms/step {r['calls_per_step']:6.1f} calls  {r['name'][:90]}")
    for k, v in res["host_tracks"].items():
        print(f"  host {k}: busy {v['busy_ms_per_step']:.2f} ms/step")
        for r in v["top"][:8]:
            print(f"    {r['ms_per_step']:7.3f} ms/step {r['calls_per_step']:6.1f} calls  {r['name'][:90]}")
    llm.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
