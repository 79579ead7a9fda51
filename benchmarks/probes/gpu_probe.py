"""First look on a GPU: init/compile time, B1 decode speed and a short W1 slice for random:llama3-8b.
Writes $OUT/gpu_probe.json. Usage: python benchmarks/probes/gpu_probe.py [NREQ] [OUTN]"""
import json
import os
import sys
import time

import numpy as np

t_start = time.perf_counter()
import jax  # noqa: E402

from jvllm import LLM, SamplingParams  # noqa: E402

NREQ = int(sys.argv[1]) if len(sys.argv) > 1 else 64
OUTN = int(sys.argv[2]) if len(sys.argv) > 2 else 128
out = dict(jax=jax.__version__, devices=[d.device_kind for d in jax.devices()], nreq=NREQ, outn=OUTN)


def dump():
    print(json.dumps(out), flush=True)
    os.makedirs(os.environ.get("OUT", "/tmp/out"), exist_ok=True)
    json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp/out"), "gpu_probe.json"), "w"), indent=1)


t0 = time.perf_counter()
kw = dict(dtype="bfloat16", max_model_len=4096, max_num_batched_tokens=2048, max_num_seqs=256, use_tqdm_on_load=False)
kw.update(json.loads(os.environ.get("JVLLM_KW", "{}")))
out["engine_kwargs"] = kw
llm = LLM("random:llama3-8b", **kw)
eng = llm.llm_engine
out.update(init_s=time.perf_counter() - t0, load_s=eng.load_seconds, warmup_s=eng.warmup_seconds,
           num_blocks=eng.get_stats()["num_blocks"], buckets=list(eng.runner.token_buckets))
dump()
rng = np.random.default_rng(0)
# B1
p = rng.integers(100, 128000, 512).tolist()
sp = SamplingParams(max_tokens=256, temperature=0, ignore_eos=True)
llm.generate({"prompt_token_ids": p}, SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
t = time.perf_counter()
r = llm.generate({"prompt_token_ids": p}, sp, use_tqdm=False)[0]
dt = time.perf_counter() - t
m = r.metrics
decode = (m.last_token_time - m.first_token_time) / 255
out.update(b1_tok_s=256 / dt, b1_decode_ms=decode * 1e3, b1_ttft_ms=(m.first_token_time - m.arrival_time) * 1e3)
dump()
# P1 (a fresh prompt for the timed run: the warm-up prompt's blocks are in the prefix cache)
p2 = rng.integers(100, 128000, 2048).tolist()
llm.generate({"prompt_token_ids": p2}, SamplingParams(max_tokens=1), use_tqdm=False)
p2 = rng.integers(100, 128000, 2048).tolist()
t = time.perf_counter()
llm.generate({"prompt_token_ids": p2}, SamplingParams(max_tokens=1), use_tqdm=False)
out.update(p1_tok_s=2048 / (time.perf_counter() - t))
dump()
# W1 slice
lens = rng.integers(64, 1025, NREQ)
prompts = [{"prompt_token_ids": rng.integers(100, 128000, int(l)).tolist()} for l in lens]
t = time.perf_counter()
outs = llm.generate(prompts, SamplingParams(max_tokens=OUTN, temperature=0, ignore_eos=True), use_tqdm=False)
dt = time.perf_counter() - t
n = sum(len(o.outputs[0].token_ids) for o in outs)
out.update(w1_out_tok_s=n / dt, w1_s=dt, stats=llm.get_stats(), total_s=time.perf_counter() - t_start)
dump()
