"""Start-up with an empty cache, a warm JAX persistent cache only, and jvllm's executable cache.

    python benchmarks/warm_start.py [--model smollm2] [--max-model-len 512] [--out PATH]

Each configuration runs in a fresh child process against one fresh temporary cache directory
(in order: empty -> fills both caches; warm with JVLLM_EXECUTABLE_CACHE=0 -> JAX's persistent
cache only; warm -> jvllm's executable cache too; both trace and lower each program to compute its
key, jvllm's cache then skips XLA's cache look-up and deserialisation path). The engine compiles in
the background by default, so these are seconds to the first tokens with the rest still
compiling. Figures: seconds to construct the engine, seconds to the first generated tokens,
compile count, executable-cache loads, and the generated ids (must be equal in all three).
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
t0 = time.perf_counter()
from jvllm import LLM, SamplingParams
from jvllm import compile as jc
llm = LLM(sys.argv[1], max_model_len=int(sys.argv[2]), compilation_cache_dir=sys.argv[3], use_tqdm_on_load=False)
t1 = time.perf_counter()
out = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
t2 = time.perf_counter()
print(json.dumps(dict(construct_s=t1 - t0, first_tokens_s=t2 - t0, load_s=llm.llm_engine.load_seconds,
                      warmup_compile_s=llm.llm_engine.warmup_seconds, compiles=jc.compile_count(),
                      executable_cache=jc.executable_cache_stats(), ids=out[0].outputs[0].token_ids)))
'''


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--out", default="benchmarks/results/warm_start.json")
    a = ap.parse_args()
    import jax

    res = dict(model=a.model, max_model_len=a.max_model_len, jax=jax.__version__, python=platform.python_version(),
               backend=os.environ.get("JAX_PLATFORMS") or jax.default_backend(), cpus=os.cpu_count(),
               time=time.strftime("%Y-%m-%dT%H:%M:%S%z"), runs={})
    with tempfile.TemporaryDirectory() as d:
        for name, exe_cache in (("empty_cache", "1"), ("warm_jax_cache_only", "0"), ("warm_executable_cache", "1")):
            env = dict(os.environ, JVLLM_EXECUTABLE_CACHE=exe_cache)
            p = subprocess.run([sys.executable, "-c", CHILD, a.model, str(a.max_model_len), d], env=env,
                               capture_output=True, text=True, check=False)
            line = [x for x in p.stdout.splitlines() if x.startswith("{")]
            res["runs"][name] = json.loads(line[-1]) if line else dict(error=p.stderr[-2000:])
            print(name, json.dumps({k: v for k, v in res["runs"][name].items() if k != "ids"}), flush=True)
    ids = [r.get("ids") for r in res["runs"].values()]
    res["same_tokens"] = all(i == ids[0] for i in ids)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print("same tokens:", res["same_tokens"], "->", a.out)


if __name__ == "__main__":
    main()
