"""`--cold-start`: process start -> first token in child processes, empty then warm caches.

The children run `python -m jvllm.bench --cold-child SPEC` (SPEC: JSON of model and engine
kwargs) and print one `JVLLM_COLD_START {json}` line."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

from jvllm.bench.workloads import GREEDY, one_prompt


def cold_child(spec_json: str):
    """Child process: construct the engine and produce one token; print a JSON line."""
    from jvllm.bench.run import build_llm

    t_start = time.time()  # after interpreter start-up and `import jvllm` (run as -m jvllm.bench)
    spec = json.loads(spec_json)
    t0 = time.perf_counter()
    llm, st = build_llm(spec["model"], spec["engine"])
    vocab = llm.llm_engine.model_config.vocab_size
    llm.generate([{"prompt_token_ids": one_prompt(16, vocab, seed=10_000)}], GREEDY.params(1), use_tqdm=False)
    out = dict(child_start_time=t_start, first_token_time=time.time(),
               construct_start_to_first_token_s=time.perf_counter() - t0, **st)
    print("JVLLM_COLD_START " + json.dumps(out), flush=True)


def run_cold_start(model: str, engine_kwargs: dict, cache_dir: str | None = None) -> dict:
    """Two child processes sharing a fresh compilation cache dir: empty cache, then warm cache.
    Must run before this process initialises an accelerator (the children need its memory)."""
    own = cache_dir is None
    cache_dir = cache_dir or tempfile.mkdtemp(prefix="jvllm-xla-cache-")
    kw = dict(engine_kwargs, compilation_cache_dir=cache_dir)
    spec = json.dumps(dict(model=model, engine=kw))
    res = dict(cache_dir=cache_dir)
    for label in ("empty_cache", "warm_cache"):
        t = time.time()
        p = subprocess.run([sys.executable, "-m", "jvllm.bench", "--cold-child", spec], capture_output=True, text=True,
                           check=False)
        line = [ln for ln in p.stdout.splitlines() if ln.startswith("JVLLM_COLD_START ")]
        if p.returncode != 0 or not line:
            res[label] = dict(error=f"rc={p.returncode}", stderr_tail=p.stderr[-2000:])
            continue
        d = json.loads(line[-1].split(" ", 1)[1])
        d["process_start_to_first_token_s"] = d["first_token_time"] - t
        d["interpreter_and_import_s"] = d["child_start_time"] - t
        res[label] = d
    if own:
        import shutil

        res["cache_files"] = sum(len(f) for _, _, f in os.walk(cache_dir))
        shutil.rmtree(cache_dir, ignore_errors=True)
    return res
