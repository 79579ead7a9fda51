"""Issue 23's device figures for the research API: `LLM.update_weights` from device arrays already
in the engine's sharding (used in place) and from host numpy (copied: GB/s), each call timed to
the swapped arrays being ready, and the compile count across the calls (must not move); `sleep` /
`wake_up` seconds and bytes freed at levels 1 and 2.

    python benchmarks/research_figures.py --model random:llama3-8b --out /tmp/out/research.json
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np


def _ready(llm):
    import jax

    jax.block_until_ready(list(llm.llm_engine.runner.stages[0].leaves))


def measure_update(llm, repeats: int = 3) -> dict:
    """{'device_ms': [...], 'host_s': [...], 'host_gb_s': [...], 'bytes': n, 'compiles': delta}."""
    import jax

    from jvllm.compilation import compile_count
    from jvllm.worker.weights import live_params

    live = live_params(llm.llm_engine.runner)
    nbytes = sum(a.nbytes for a in live.values())
    copies = {k: jax.device_put(a, a.sharding, donate=False, may_alias=False) for k, a in live.items()}
    jax.block_until_ready(list(copies.values()))
    host = {k: np.asarray(a) for k, a in live.items()}
    c0 = compile_count()
    out = dict(bytes=nbytes, device_ms=[], host_s=[], host_gb_s=[])
    for _ in range(repeats):
        t = time.perf_counter()
        llm.update_weights(copies)
        _ready(llm)
        out["device_ms"].append((time.perf_counter() - t) * 1e3)
        t = time.perf_counter()
        llm.update_weights(host)
        _ready(llm)
        dt = time.perf_counter() - t
        out["host_s"].append(dt)
        out["host_gb_s"].append(nbytes / dt / 1e9)
    llm.update_weights(live)
    out["compiles"] = compile_count() - c0
    return out


def _in_use() -> int | None:
    import jax

    stats = jax.devices()[0].memory_stats()  # None on CPU
    return stats.get("bytes_in_use") if stats else None


def measure_sleep(llm) -> dict:
    """Per level: sleep / wake_up seconds, the bytes sleep reports freed and the device's
    bytes_in_use before, asleep and after (None where the backend has no memory stats)."""
    out = {}
    for level in (1, 2):
        before = _in_use()
        t = time.perf_counter()
        freed = llm.sleep(level)
        sleep_s = time.perf_counter() - t
        asleep = _in_use()
        t = time.perf_counter()
        llm.wake_up()
        _ready(llm)
        out[f"level{level}"] = dict(sleep_s=sleep_s, wake_s=time.perf_counter() - t, freed_bytes=freed,
                                    in_use_before=before, in_use_asleep=asleep, in_use_after=_in_use())
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:llama3-8b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    from jvllm import LLM

    llm = LLM(a.model, dtype=a.dtype, max_model_len=a.max_model_len, token_buckets=(16, 512),
              background_compile=False, use_tqdm_on_load=False, enable_sleep_mode=True)
    import jax

    from jvllm.bench import versions

    res = dict(model=a.model, dtype=a.dtype, device=[d.device_kind for d in jax.devices()], versions=versions(),
               update_weights=measure_update(llm, a.repeats), sleep=measure_sleep(llm))
    print(json.dumps(res, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
