"""Where the host's time goes in a W1-like run: cProfile around `LLM.generate` of N requests,
summarised per function (self time and cumulative time, per engine step) into JSON. The device
programs run asynchronously, so on any backend the profile shows the Python and dispatch work that
must stay under the device time per step for the engine not to be host-bound (PP=2 W1 on 2 H200s:
about 5 ms of host work per micro-batch step against 5.8 ms of device work per stage,
h200x2_w1_pp2mp_9382a11.json).

    [jvllm launch --nproc 2 --] python benchmarks/host_profile.py --model random:CONFIG.json \
        [--num-prompts 256] [--input-len 64,128] [--output-len 64] [--out host.json] [engine flags]

With several processes each writes its own JSON (suffix .p<process index>). A small model (e.g.
32 layers of width 128) keeps device time low on CPU; the host work per step depends on the
number of requests, layers and programs, not on the width (benchmarks/configs/*-tiny.json: the
layer count and parameter tree of llama3-8b and gemma3-4b at tiny widths).

`--launch`: no workload; the host time of one call (device idle before it, median of `--calls`)
of the B1 decode step program, of a trivial program taking the same arguments (params, KV
donated, packed inputs, prev ids: what dispatching that many arrays costs), of the same trivial
program taking the model's unpacked leaves (what `param_pack` saves), of a trivial two-argument
program (the fixed cost) and of the greedy sampler. On CPU the step call also runs the step (the
CPU client executes small programs in the calling thread); on GPUs it only launches it.
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def summarise(prof: cProfile.Profile, steps: int, top: int = 40) -> dict:
    st = pstats.Stats(prof)
    rows = []
    for (fn, line, name), (cc, nc, tt, ct, _callers) in st.stats.items():
        rows.append(dict(function=f"{os.path.relpath(fn) if fn.startswith('/') else fn}:{line}({name})",
                         calls=nc, self_ms_per_step=1e3 * tt / steps, cum_ms_per_step=1e3 * ct / steps))
    by_self = sorted(rows, key=lambda r: -r["self_ms_per_step"])[:top]
    by_cum = sorted(rows, key=lambda r: -r["cum_ms_per_step"])[:top]
    return dict(top_self=by_self, top_cumulative=by_cum)


def _median_call_ms(f, calls: int) -> float:
    import statistics

    import jax

    ts = []
    for _ in range(calls):
        t = time.perf_counter()
        out = f()
        ts.append(time.perf_counter() - t)
        jax.block_until_ready(out)
    return 1e3 * statistics.median(ts)


def launch_probe(llm, calls: int) -> dict:
    """Host ms per call of the B1 decode step and of trivial programs of its argument tree."""
    import jax
    import numpy as np

    r = llm.llm_engine.runner
    st = r.stages[0]
    T = min(t for t in r.layout.token_buckets if r.layout.has_decode_variant(t))
    packed = np.zeros(r.layout.packed_size(T, True), np.int32)
    exe = r.programs.get("step", (0, T, True))

    def call(prog, params):
        def f():
            out = prog(params, st.kv, packed, r.no_prev)
            st.kv = out[0]
            return out
        return f

    def trivial(params):
        return jax.jit(lambda p, kv, pk, x: (kv, x[:1]), donate_argnums=(1,)).lower(
            params, st.kv, packed, r.no_prev).compile()

    two = jax.jit(lambda pk, x: x[:1]).lower(packed, r.no_prev).compile()
    h = jax.numpy.zeros((r.layout.seq_bucket(T), r.cfg.hidden_size), r.dtype)
    greedy = r.programs.get("greedy", r.layout.seq_bucket(T))
    return dict(bucket=T, num_param_leaves=len(st.leaves), num_param_args=len(st.params()),
                num_kv_arrays=len(jax.tree_util.tree_leaves(st.kv)),
                step_call_ms=_median_call_ms(call(exe, st.params()), calls),
                trivial_same_args_ms=_median_call_ms(call(trivial(st.params()), st.params()), calls),
                trivial_unpacked_leaves_ms=_median_call_ms(call(trivial(st.leaves), st.leaves), calls),
                trivial_two_args_ms=_median_call_ms(lambda: two(packed, r.no_prev), calls),
                greedy_call_ms=_median_call_ms(lambda: greedy(r.head_w, h), calls))


def main(argv=None):
    from jvllm import bench
    from jvllm.cli import add_engine_args, engine_kwargs

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--input-len", type=bench.parse_len_range, default=bench.W1_INPUT_LEN)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--out", default="host_profile.json")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--no-cprofile", action="store_true", help="engine timers only (cProfile inflates per-call costs)")
    ap.add_argument("--launch", action="store_true", help="the B1 launch probe instead of the workload (see above)")
    ap.add_argument("--calls", type=int, default=200, help="--launch: calls per program")
    add_engine_args(ap)
    a = ap.parse_args(argv)
    llm, startup = bench.build_llm(a.model, engine_kwargs(a))
    eng = llm.llm_engine
    if a.launch:
        eng.wait_for_warmup()
        res = dict(model=a.model, engine=engine_kwargs(a), versions=bench.versions(), backend=_backend(),
                   **launch_probe(llm, a.calls))
        bench.write_json(a.out, res)
        print(", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in res.items()
                        if k not in ("engine", "versions")), "->", a.out)
        return
    vocab = eng.model_config.vocab_size
    warm = [{"prompt_token_ids": p} for p in bench.w1_prompts(4, a.input_len, vocab, seed=12345)]
    llm.generate(warm, bench.sampling_params(8), use_tqdm=False)
    prompts = [{"prompt_token_ids": p} for p in bench.w1_prompts(a.num_prompts, a.input_len, vocab)]
    s0 = llm.get_stats()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    if not a.no_cprofile:
        prof.enable()
    llm.generate(prompts, bench.sampling_params(a.output_len), use_tqdm=False)
    prof.disable()
    dt = time.perf_counter() - t0
    s1 = llm.get_stats()
    steps = max(1, s1["num_steps"] - s0["num_steps"])
    import jax

    res = dict(model=a.model, engine=engine_kwargs(a), versions=bench.versions(), num_prompts=a.num_prompts,
               input_len=list(a.input_len), output_len=a.output_len, steps=steps, elapsed_s=dt,
               ms_per_step=1e3 * dt / steps, **bench.host_share(s0, s1),
               **({} if a.no_cprofile else summarise(prof, steps, a.top)))
    out = a.out if jax.process_count() == 1 else f"{os.path.splitext(a.out)[0]}.p{jax.process_index()}.json"
    bench.write_json(out, res)
    print(f"{steps} steps, {res['ms_per_step']:.2f} ms/step, host {res['host_ms_per_step']:.2f} ms/step -> {out}")
    print("  " + ", ".join(f"{k.removeprefix('host_').removesuffix('_ms_per_step')} {v:.3f}" for k, v in res.items()
                           if k.startswith("host_") and k.endswith("_ms_per_step")))
    for r in res.get("top_self", [])[:25]:
        print(f"  {r['self_ms_per_step']:8.3f} {r['cum_ms_per_step']:8.3f} {r['calls']:7d}  {r['function']}")
    llm.shutdown() if hasattr(llm, "shutdown") else None


def _backend() -> str:
    import jax

    return f"{jax.default_backend()} ({jax.devices()[0].device_kind})"


if __name__ == "__main__":
    main()
