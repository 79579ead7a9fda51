"""Issue 24's real-model acceptance on CPU: SmolLM2 (the built-in `smollm2`, float32) with n-gram
k = 4 (prompt_lookup 2..4) on input-grounded prompts (repeat / edit / copy a given text, the prompts
of tests/test_spec_smollm2.py): per prompt the B1 decode tokens/s plain vs n-gram (median of
--iters runs after one warm-up run, the same `run_batch` as spec_b1.py), the acceptance rate and
mean accepted length, whether the outputs are identical, and the acceptance with all prompts in
one batch. Writes one JSON (--output-json). A CPU shared with other work makes the speeds noisy;
the acceptance does not depend on timing.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from spec_b1 import b1, run_batch  # noqa: E402
from test_spec_smollm2 import NGRAM, PROMPTS  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--output-len", type=int, default=48)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--output-json", required=True)
    a = ap.parse_args(argv)
    import jax

    from jvllm import LLM

    kw = dict(dtype="float32", max_model_len=512, max_num_batched_tokens=64, max_num_seqs=8,
              token_buckets=(8, 16, 32, 64), use_tqdm_on_load=False)
    out = dict(model="smollm2", dtype="float32", platform=jax.devices()[0].platform, cpu=platform.processor() or None,
               cpu_count=os.cpu_count(), speculative_config=NGRAM, output_len=a.output_len, iters=a.iters,
               workload="input-grounded prompts (tests/test_spec_smollm2.py): repeat, rewrite, copy a given text")
    res, ids = {}, {}
    for name, cfg in (("plain", None), ("ngram", NGRAM)):
        llm = LLM("smollm2", **kw) if cfg is None else LLM("smollm2", speculative_config=cfg, **kw)
        try:
            llm.llm_engine.wait_for_warmup()
            tok = llm.get_tokenizer()
            prompts = [tok.encode(p) for p in PROMPTS]
            rows = []
            for i, p in enumerate(prompts):
                r = b1(llm, p, a.output_len, a.iters, f"{name}-{i}")
                got = r.pop("output_token_ids")
                if name == "plain":
                    ids[i] = got
                else:
                    r["speedup_vs_plain"] = r["decode_tok_s"] / res["plain"]["b1"][i]["decode_tok_s"]
                    r["output_identical_to_plain"] = got == ids[i]
                rows.append(dict(r, prompt_tokens=len(p)))
                print(f"[{name}] prompt {i}: B1 {r['decode_tok_s']:.1f} tok/s"
                      + (f" = {r['speedup_vs_plain']:.2f}x, acceptance {r['acceptance']:.3f}" if cfg else ""), flush=True)
            batch = run_batch(llm, prompts, a.output_len, f"{name}-batch")
            batch.pop("outputs")
            res[name] = dict(b1=rows, batch=batch)
        finally:
            llm.shutdown()
    ng = res["ngram"]["b1"]
    out.update(res)
    out["summary"] = dict(
        b1_plain_tok_s=statistics.median(r["decode_tok_s"] for r in res["plain"]["b1"]),
        b1_ngram_tok_s=statistics.median(r["decode_tok_s"] for r in ng),
        b1_speedup_median=statistics.median(r["speedup_vs_plain"] for r in ng),
        b1_acceptance_mean=statistics.mean(r["acceptance"] for r in ng),
        b1_mean_accepted_length=statistics.mean(r["mean_accepted_length"] for r in ng),
        batch_acceptance=res["ngram"]["batch"].get("acceptance"),
        all_identical=all(r["output_identical_to_plain"] for r in ng))
    print(json.dumps(out["summary"]), flush=True)
    with open(a.output_json, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
