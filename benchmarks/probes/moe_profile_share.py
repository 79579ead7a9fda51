"""Share of a mixture-of-experts decode step spent in the grouped matmuls and in routing, from a
JAX profiler trace (CUPTI on GPUs) of N engine steps of B1 (one request) or W1 (256 requests, once
all decode).

    python benchmarks/probes/moe_profile_share.py --workload b1|w1 --model random:qwen3-30b-a3b \
        --dtype bfloat16 [--steps 20] [--out $OUT/moe_share_b1.json] [engine flags, as for jvllm bench]

How kernels are attributed: jvllm.ops.grouped_matmul runs the expert matmuls under the named scope
GMM_SCOPE and the routing (router, top-k, sort, gathers, combine) under ROUTING_SCOPE; the scopes
end up in the `op_name` metadata of the optimized HLO. Each device event of the trace names its
HLO module and instruction (`hlo_module`, `hlo_op` args); the instruction's op_name in the engine's
compiled programs gives its class (command buffers are off for the run: each kernel its own event,
so the step is somewhat slower than in the engine). A fusion carries the op_name of its root, so a fusion that
merges routing with neighbouring work counts where its root is (a bound, not an exact split).

JSON: per class (grouped_matmul, routing, other) ms per step and share of all device kernel time,
the top kernels of each class, wall ms per step, batch.
"""
from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import sys
import tempfile
import time

_MODULE = re.compile(r"^HloModule\s+([^\s,]+)", re.MULTILINE)
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*?metadata=\{[^}]*?op_name=\"([^\"]*)\"", re.MULTILINE)


def op_names(hlo_texts) -> dict:
    """{(module, instruction): op_name} from optimized HLO texts."""
    out = {}
    for text in hlo_texts:
        m = _MODULE.search(text)
        mod = m.group(1) if m else ""
        for name, op in _INSTR.findall(text):
            out[(mod, name)] = op
    return out


def classify(op_name: str | None) -> str:
    from jvllm.ops.grouped_matmul import GMM_SCOPE, ROUTING_SCOPE

    if op_name and GMM_SCOPE in op_name:
        return "grouped_matmul"
    if op_name and ROUTING_SCOPE in op_name:
        return "routing"
    return "other"


def attribute(trace: dict, names: dict, steps: int) -> dict:
    """Device kernel time per class from a trace's complete events that name an HLO op."""
    tot = collections.Counter()
    per = collections.defaultdict(collections.Counter)
    unmatched = 0
    for e in trace.get("traceEvents", []):
        args = e.get("args") or {}
        if e.get("ph") != "X" or "hlo_op" not in args:
            continue
        key = (args.get("hlo_module", ""), args["hlo_op"])
        op = names.get(key)
        if op is None:  # module names in traces may carry a suffix or prefix: match by instruction
            op = next((v for (m, n), v in names.items() if n == key[1] and (m in key[0] or key[0] in m)), None)
            unmatched += op is None
        c = classify(op)
        dur = float(e.get("dur", 0.0))
        tot[c] += dur
        per[c][args["hlo_op"]] += dur
    all_us = sum(tot.values()) or 1.0
    return dict(
        classes={c: dict(ms_per_step=tot[c] / 1e3 / steps, share=tot[c] / all_us) for c in
                 ("grouped_matmul", "routing", "other")},
        top={c: [dict(op=k, ms_per_step=v / 1e3 / steps) for k, v in per[c].most_common(8)] for c in per},
        kernel_ms_per_step=all_us / 1e3 / steps, events_without_op_name=unmatched)


def main(argv=None):
    # XLA GPU runs a step's kernels as one command buffer (a CUDA graph), which a trace shows as a
    # single `command_buffer_N` event naming no HLO instruction: this probe turns command buffers
    # off, so each kernel is its own event
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_gpu_enable_command_buffer" not in flags:
        os.environ["XLA_FLAGS"] = (flags + " --xla_gpu_enable_command_buffer=").strip()
    import jax

    from jvllm.bench import build_llm, one_prompt, sampling_params, w1_prompts
    from jvllm.cli import add_engine_args, engine_kwargs

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", choices=("b1", "w1"), default="b1")
    ap.add_argument("--model", default="random:qwen3-30b-a3b")
    add_engine_args(ap)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--w1-input-len", default="64,1024", help="W1 prompt lengths lo,hi")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "moe_share.json"))
    a = ap.parse_args(argv)
    ekw = {k: v for k, v in engine_kwargs(a).items() if v is not None}
    llm, _ = build_llm(a.model, ekw)
    eng = llm.llm_engine
    eng.wait_for_warmup()  # every program compiled (background compile), so the map below is complete
    vocab = eng.model_config.vocab_size
    big = a.steps * 4 + 64
    if a.workload == "b1":
        eng.add_request("p0", {"prompt_token_ids": one_prompt(a.input_len, vocab, seed=7)}, sampling_params(big))
        for _ in range(8):
            eng.step()
    else:
        lo, hi = (int(v) for v in a.w1_input_len.split(","))
        for i, p in enumerate(w1_prompts(a.num_prompts, (lo, hi), vocab)):
            eng.add_request(f"w{i}", {"prompt_token_ids": p}, sampling_params(big + 200))
        while eng.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in eng.scheduler.running):
            eng.step()
        for _ in range(4):
            eng.step()
    d = tempfile.mkdtemp(prefix="jvllm_moe_prof_")
    opts = jax.profiler.ProfileOptions()
    opts.python_tracer_level = 0
    with jax.profiler.trace(d, profiler_options=opts):
        t = time.perf_counter()
        for _ in range(a.steps):
            eng.step()
        eng.drain()
        wall = time.perf_counter() - t
    paths = glob.glob(os.path.join(d, "**", "*.trace.json.gz"), recursive=True)
    if not paths:
        raise SystemExit(f"no trace under {d}")
    trace = json.load(gzip.open(paths[0]))
    names = op_names(exe.as_text() for exe in eng.worker.compiled_programs().values())
    res = dict(workload=a.workload, model=a.model, engine=ekw, moe=str(eng.model_config.moe),
               wall_ms_per_step=wall * 1e3 / a.steps, batch=len(eng.scheduler.running),
               **attribute(trace, names, a.steps))
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    json.dump(res, open(a.out, "w"), indent=1, default=str)
    print(f"{a.workload}: {res['wall_ms_per_step']:.2f} ms/step wall, batch {res['batch']}, kernels "
          f"{res['kernel_ms_per_step']:.2f} ms/step: " + ", ".join(
              f"{c} {v['ms_per_step']:.3f} ms ({100 * v['share']:.1f}%)" for c, v in res["classes"].items()))
    llm.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
