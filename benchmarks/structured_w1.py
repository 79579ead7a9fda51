"""W1 with a fraction of the requests under a JSON schema, against unconstrained W1 in the same
process (one engine, one compile): output tok/s of both, their ratio, the schema compile time and
the host's mask time per step. Issue 22's GPU figure:

    python benchmarks/structured_w1.py --model random:llama3-8b --dtype bfloat16 --max-model-len 4096 \\
        --output-json $OUT/structured_w1.json

Random weights have no tokenizer: grammars are compiled against `--tokenizer` (an HF tokenizer
folder; default SmolLM2's, read from the built-in GGUF), whose 49,152 ids lie inside Llama-3's
vocabulary (the masks are Llama-3 wide; the ids SmolLM2 lacks are never allowed). W1 is greedy
with ignore_eos: a constrained row whose document is complete can only draw EOS, which it ignores,
so every request makes output-len tokens in both runs. A step with constrained rows is dispatched
late by the async loop (its forward first, its masks filled and its sampler enqueued once the step
before is read): the mask fill overlaps the forward; what is left of its cost is being measured
(`hidden_host_ms_per_step`: the host time spent while the forward ran).
"""
from __future__ import annotations

import argparse
import json
import time

# open-ended, so that a random model's documents rarely end before output-len
SCHEMA = {"type": "array", "items": {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0, "maximum": 100000},
    "name": {"type": "string", "maxLength": 24},
    "kind": {"enum": ["a", "b", "c"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 4}},
    "required": ["id", "name", "kind", "tags"], "additionalProperties": False}}


def tokenizer(path: str | None):
    from transformers import AutoTokenizer

    if path:
        return AutoTokenizer.from_pretrained(path)
    import os
    import sys

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root: tests/
    from jvllm.converters.gguf import gguf_tokenizer
    from tests.helpers import smollm2_gguf_path

    return gguf_tokenizer(smollm2_gguf_path())


def main(argv=None):
    from jvllm import SamplingParams, StructuredOutputsParams
    from jvllm.bench import build_llm, cap_input_len, versions, w1_prompts

    p = argparse.ArgumentParser()
    p.add_argument("--model", default="random:llama3-8b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--fraction", type=float, default=0.5, help="share of requests under the schema")
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--output-json", default=None)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--token-buckets", default=None, help="comma-separated, as for jvllm bench (fewer programs to warm)")
    a = p.parse_args(argv)
    if not 0.0 < a.fraction <= 1.0:
        raise SystemExit(f"--fraction must be in (0, 1], got {a.fraction}")
    shape = dict(max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
                 token_buckets=[int(b) for b in a.token_buckets.split(",")] if a.token_buckets else None)
    # no prefix cache: both runs send the same prompts, and the second would find them cached
    llm, init = build_llm(a.model, dict(dtype=a.dtype, max_model_len=a.max_model_len, enable_prefix_caching=False,
                                        **{k: v for k, v in shape.items() if v is not None}))
    e = llm.llm_engine
    e.wait_for_warmup()  # the background warm-up's compiles stay out of both runs
    tok = tokenizer(a.tokenizer)
    if e.tokenizer is None:
        e.inputs.use_grammar_tokenizer(tok)
    vocab = e.model_config.vocab_size
    lens, note = cap_input_len((64, 1024), a.output_len, e.sched_config.max_model_len)
    prompts = [{"prompt_token_ids": q} for q in w1_prompts(a.num_prompts, lens, vocab)]
    plain = SamplingParams(max_tokens=a.output_len, ignore_eos=True, temperature=0.0)
    so = SamplingParams(max_tokens=a.output_len, ignore_eos=True, temperature=0.0,
                        structured_outputs=StructuredOutputsParams(json=SCHEMA))
    k = max(1, round(1 / a.fraction))
    params = [so if i % k == 0 else plain for i in range(a.num_prompts)]
    t = time.perf_counter()
    e.inputs._grammar(so)  # tokenizer trie + first compile, outside the timed runs
    first_compile_s = time.perf_counter() - t
    t = time.perf_counter()
    for _ in range(10):
        e.inputs._grammar(so)
    compile_s = (time.perf_counter() - t) / 10
    warm = [{"prompt_token_ids": q} for q in w1_prompts(8, lens, vocab, seed=12345)]
    llm.generate(warm, [so, plain] * 4, use_tqdm=False)  # the masked samplers' first calls

    def run(ps):
        s0 = dict(e.get_stats())
        t0 = time.perf_counter()
        outs = llm.generate(prompts, ps, use_tqdm=False)
        dt = time.perf_counter() - t0
        s1 = e.get_stats()
        n = sum(len(o.outputs[0].token_ids) for o in outs)
        steps = s1["num_steps"] - s0["num_steps"]
        return dict(elapsed_s=dt, output_tokens=n, output_tok_s=n / dt, num_steps=steps,
                    grammar_mask_ms_per_step=1e3 * (s1["grammar_mask_s"] - s0["grammar_mask_s"]) / max(steps, 1),
                    late_steps=s1["num_late_steps"] - s0["num_late_steps"],
                    hidden_host_ms_per_step=1e3 * (s1["overlap_host_seconds"] - s0["overlap_host_seconds"])
                    / max(s1["num_late_steps"] - s0["num_late_steps"], 1),
                    errors=sum(o.outputs[0].finish_reason == "error" for o in outs),
                    compiles=s1["compiles_after_warmup"] - s0["compiles_after_warmup"]), outs

    base, _ = run(plain)
    mixed, outs = run(params)
    n_so = sum(1 for q in params if q is so)
    res = dict(workload="W1 with a share of requests under a JSON schema", model=a.model, dtype=a.dtype,
               num_prompts=a.num_prompts, engine_shape=shape, output_len=a.output_len, constrained_requests=n_so, input_len=list(lens),
               input_len_note=note, unconstrained=base, mixed=mixed, ratio=mixed["output_tok_s"] / base["output_tok_s"],
               schema_first_compile_s=first_compile_s, schema_compile_ms=1e3 * compile_s, init=init,
               sample_constrained_output_ids=outs[0].outputs[0].token_ids[:40], **versions())
    print(json.dumps({k: res[k] for k in ("unconstrained", "mixed", "ratio", "schema_compile_ms")}, indent=1))
    if a.output_json:
        with open(a.output_json, "w") as f:
            json.dump(res, f, indent=1, default=str)


if __name__ == "__main__":
    main()
