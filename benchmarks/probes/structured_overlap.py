"""How much per-step host time of constrained decoding the async loop hides behind the device.

A batch of requests (a share of them under structured_w1.py's JSON schema, greedy with
ignore_eos, so both runs make the same tokens) runs twice on one engine: through the async loop,
where a step with constrained rows is dispatched late (its forward first; the step before is read,
the grammars advance, the masks are filled, then its sampler is enqueued), and through the sync
loop (swapped in for the run), where all of that host work happens with the device idle.

    python benchmarks/probes/structured_overlap.py [--model smollm2] [--num-prompts 8] \\
        [--output-len 64] [--fraction 1.0] [--out probe.json]

JSON, per loop: wall seconds, steps, ms per step, output tok/s, the host's mask fill per step
(`grammar_mask_s`), host and device-wait seconds per step; for the async loop also
`hidden_host_ms_per_step`: the host time spent reading the step before and building this step's
sampling inputs while this step's forward was already enqueued (`overlap_host_seconds` over
`num_late_steps`), and `late_steps`. `same_tokens`: both loops gave the same tokens.
A model without a tokenizer (random:...) compiles its grammars against SmolLM2's (`--tokenizer`).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, ROOT)  # the repository root: benchmarks/, tests/
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

KEYS = ("num_steps", "host_seconds", "device_wait_seconds", "overlap_host_seconds", "num_late_steps",
        "grammar_mask_s", "late_sampling_s", "num_generation_tokens")


def run(llm, prompts, params) -> tuple[dict, list]:
    e = llm.llm_engine
    s0 = e.get_stats()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    s1 = e.get_stats()
    d = {k: s1[k] - s0[k] for k in KEYS}
    steps = max(d["num_steps"], 1)
    res = dict(wall_s=dt, steps=d["num_steps"], ms_per_step=1e3 * dt / steps,
               output_tok_s=d["num_generation_tokens"] / dt,
               grammar_mask_ms_per_step=1e3 * d["grammar_mask_s"] / steps,
               host_ms_per_step=1e3 * d["host_seconds"] / steps,
               device_wait_ms_per_step=1e3 * d["device_wait_seconds"] / steps,
               late_steps=d["num_late_steps"], compiles=s1["compiles_after_warmup"] - s0["compiles_after_warmup"])
    if d["num_late_steps"]:
        res["hidden_host_ms_per_step"] = 1e3 * d["overlap_host_seconds"] / d["num_late_steps"]
    return res, [o.outputs[0].token_ids for o in outs]


def main(argv=None):
    from jvllm import LLM, SamplingParams, StructuredOutputsParams
    from jvllm.bench import versions
    from jvllm.engine.loop import AsyncLoop, make_loop
    from structured_w1 import SCHEMA, tokenizer

    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--fraction", type=float, default=1.0, help="share of requests under the schema")
    p.add_argument("--repeats", type=int, default=2, help="runs of each loop, alternating; the best is kept")
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if not 0.0 < a.fraction <= 1.0:
        raise SystemExit(f"--fraction must be in (0, 1], got {a.fraction}")
    llm = LLM(a.model, dtype=a.dtype, max_model_len=512, max_num_batched_tokens=64, max_num_seqs=a.num_prompts,
              token_buckets=(8, 16, 32, 64), use_tqdm_on_load=False)
    e = llm.llm_engine
    if not isinstance(e.loop, AsyncLoop):
        raise SystemExit(f"the engine's loop is {type(e.loop).__name__}; this probe needs the async loop")
    e.wait_for_warmup()
    if e.tokenizer is None:
        e.inputs.use_grammar_tokenizer(tokenizer(a.tokenizer))
    so = SamplingParams(max_tokens=a.output_len, ignore_eos=True, temperature=0.0,
                        structured_outputs=StructuredOutputsParams(json=SCHEMA))
    plain = SamplingParams(max_tokens=a.output_len, ignore_eos=True, temperature=0.0)
    k = max(1, round(1 / a.fraction))
    params = [so if i % k == 0 else plain for i in range(a.num_prompts)]
    prompts = [f"Record {i} of the inventory, as JSON:" for i in range(a.num_prompts)]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # the grammar's token trie, outside the runs
    async_loop, sync_loop = e.loop, make_loop(e, False, 1)
    best, toks = {}, {}
    for _ in range(a.repeats):
        for name, loop in (("async", async_loop), ("sync", sync_loop)):
            e.loop = loop
            r, toks[name] = run(llm, prompts, params)
            if name not in best or r["wall_s"] < best[name]["wall_s"]:
                best[name] = r
    e.loop = async_loop
    res = dict(probe="structured_overlap", model=a.model, dtype=a.dtype, num_prompts=a.num_prompts,
               output_len=a.output_len, constrained_requests=sum(q is so for q in params), repeats=a.repeats,
               async_loop=best["async"], sync_loop=best["sync"], same_tokens=toks["async"] == toks["sync"],
               speedup=best["sync"]["wall_s"] / best["async"]["wall_s"], **versions())
    print(json.dumps(res, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    llm.shutdown()


if __name__ == "__main__":
    main()
