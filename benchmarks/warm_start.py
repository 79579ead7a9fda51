"""Start-up with an empty cache, a warm JAX persistent cache only, and jvllm's executable cache.

    python benchmarks/warm_start.py [--model smollm2] [--max-model-len 512] [--dtype auto] [--out PATH]
        [--build before=/tmp/site_before --build after=/tmp/site_after] [--runs empty_cache,...] [--no-fill]

Each configuration runs in a fresh child process against one fresh temporary cache directory
per build (in order: empty -> fills both caches; warm with JVLLM_EXECUTABLE_CACHE=0 -> JAX's
persistent cache only, every program traced and lowered; warm -> jvllm's executable cache too,
keyed by program fingerprints where the build has them, so nothing is traced or lowered). The
engine compiles in the background by default, so these are seconds to the first tokens with the
rest still compiling; the empty-cache run then waits for that background warm-up to end before
it exits, so that both caches hold every program (a run that exited at its first tokens would
leave the programs still compiling out of the cache, and the warm runs would lower and compile
them again in the background, beside the request they time). On CPU jvllm leaves JAX's cache
off, so there the JAX-cache-only run is a second empty start: pass `--runs
empty_cache,warm_executable_cache`. `--no-fill` measures exactly that case, a new user's first
start that ends at its first tokens. Figures: process start to the
first 8 generated tokens (imports included), to the end of construction, `LLM(...)` to the
first tokens (`llm_to_first_tokens_s`, wall; `llm_to_first_token_s` to the first one, as the
engine's step loop hands it over) and the process's CPU seconds over that span
(`llm_cpu_s`, all threads; a loaded machine inflates them far less than wall time), compile
count, programs lowered, executable-cache loads, and the generated ids (must be equal in every
run).

`--build LABEL=SITE` (repeatable) runs each configuration once per build, builds interleaved so
that they share the machine's load: SITE is a folder put first on the child's PYTHONPATH (e.g.
`pip install --no-deps --target SITE <tree>`), empty for the installed jvllm. Children run from a
temporary folder, so the working directory's tree is never imported by accident.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

CHILD = r'''
import json, os, sys, time
t_start = float(sys.argv[4])
fill = sys.argv[5] == "fill"
t0 = time.perf_counter()
import jvllm
from jvllm import LLM, SamplingParams
import jvllm.compilation as jc
t_import = time.perf_counter()
c_import = time.process_time()
llm = LLM(sys.argv[1], max_model_len=int(sys.argv[2]), compilation_cache_dir=sys.argv[3], use_tqdm_on_load=False,
          dtype=sys.argv[6])
t1 = time.perf_counter()
eng = llm.llm_engine  # the engine's own loop, to see when the first token reaches the host
eng.add_request("warm", {"prompt_token_ids": [5, 6, 7, 8]}, SamplingParams(max_tokens=8, temperature=0.0))
t_tok, out = None, None
while out is None:
    for o in eng.step():
        if t_tok is None and o.outputs and o.outputs[0].token_ids:
            t_tok = time.perf_counter()
        if o.finished:
            out = o
t2, t_end, c_end = time.perf_counter(), time.time(), time.process_time()
from jvllm.bench import device_info  # after the timed span: its import is not start-up
lowered = jc.lowering_count() if hasattr(jc, "lowering_count") else None
print(json.dumps(dict(process_start_to_first_tokens_s=t_end - t_start, cpu_s=c_end,
                      import_s=t_import - t0, llm_to_first_tokens_s=t2 - t_import,
                      llm_to_first_token_s=t_tok - t_import,
                      llm_cpu_s=c_end - c_import,
                      construct_s=t1 - t0, first_tokens_s=t2 - t0, load_s=llm.llm_engine.load_seconds,
                      warmup_compile_s=llm.llm_engine.warmup_seconds,
                      init_parts=dict(getattr(llm.llm_engine.worker, "init_parts", {})), compiles=jc.compile_count(),
                      tokenizer_thread_s=getattr(llm.llm_engine.worker, "tokenizer_seconds", None),
                      programs_lowered=lowered, executable_cache=jc.executable_cache_stats(),
                      device=device_info(),
                      jvllm_file=jvllm.__file__, ids=out.outputs[0].token_ids)), flush=True)
if fill:  # let the background warm-up put every program into the caches (not timed)
    t3 = time.perf_counter()
    llm.llm_engine.wait_for_warmup()
    print("filled", time.perf_counter() - t3, jc.compile_count(), flush=True)
os._exit(0)  # a warm run's background warm-up may still be loading: its seconds are not start-up
'''


RUNS = {"empty_cache": "1", "warm_jax_cache_only": "0", "warm_executable_cache": "1"}  # -> JVLLM_EXECUTABLE_CACHE


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--out", default="benchmarks/results/warm_start.json")
    ap.add_argument("--runs", default="empty_cache,warm_jax_cache_only,warm_executable_cache",
                    help="which of the three runs, comma-separated, in that order")
    ap.add_argument("--no-fill", action="store_true",
                    help="the empty-cache run exits at its first tokens instead of waiting for the background "
                         "warm-up (a new user's first start; the warm runs then find only what it stored)")
    ap.add_argument("--build", action="append", default=[], metavar="LABEL=SITE",
                    help="a build to run (repeatable): SITE first on PYTHONPATH, empty = the installed jvllm")
    a = ap.parse_args()
    builds = {}
    for spec in a.build or ["current="]:
        label, sep, site = spec.partition("=")
        if not sep or not label:
            ap.error(f"--build wants LABEL=SITE, got {spec!r}")
        if site and not os.path.isdir(os.path.join(site, "jvllm")):
            ap.error(f"--build {spec!r}: {site} holds no jvllm package")
        builds[label] = os.path.abspath(site) if site else ""
    runs = [r for r in a.runs.split(",") if r]
    bad = [r for r in runs if r not in RUNS]
    if bad:
        ap.error(f"--runs: unknown {bad}; choose from {list(RUNS)}")
    import jax  # the version only: the parent never initializes a backend (on a GPU it would claim the memory)

    res = dict(device=None, no_fill=a.no_fill, model=a.model, max_model_len=a.max_model_len, dtype=a.dtype, jax=jax.__version__, python=platform.python_version(),
               backend=os.environ.get("JAX_PLATFORMS"), cpus=os.cpu_count(),
               time=time.strftime("%Y-%m-%dT%H:%M:%S%z"), builds=builds, runs={b: {} for b in builds})
    with tempfile.TemporaryDirectory() as d:
        for name in (r for r in RUNS if r in runs):
            exe_cache = RUNS[name]
            for label, site in builds.items():
                env = dict(os.environ, JVLLM_EXECUTABLE_CACHE=exe_cache)
                if site:
                    env["PYTHONPATH"] = os.pathsep.join(x for x in (site, os.environ.get("PYTHONPATH")) if x)
                cache = os.path.join(d, "cache_" + label)
                fill = "fill" if name == "empty_cache" and not a.no_fill else "no"
                p = subprocess.run([sys.executable, "-c", CHILD, a.model, str(a.max_model_len), cache, repr(time.time()),
                                    fill, a.dtype],
                                   env=env, cwd=d, capture_output=True, text=True, check=False)
                line = [x for x in p.stdout.splitlines() if x.startswith("{")]
                run = json.loads(line[0]) if line else dict(error=p.stderr[-2000:])
                if run.get("device"):
                    res["device"] = run.pop("device")
                    res["backend"] = res["backend"] or res["device"]["backend"]
                filled = [x for x in p.stdout.splitlines() if x.startswith("filled ")]
                if filled:
                    secs, compiles = filled[0].split()[1:]
                    run.update(background_warmup_s=float(secs), compiles_when_filled=int(compiles))
                res["runs"][label][name] = run
                print(label, name, json.dumps({k: v for k, v in run.items() if k not in ("ids", "init_parts")}),
                      flush=True)
    ids = [r.get("ids") for runs in res["runs"].values() for r in runs.values()]
    res["same_tokens"] = all(i == ids[0] for i in ids)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print("same tokens:", res["same_tokens"], "->", a.out)


if __name__ == "__main__":
    main()
