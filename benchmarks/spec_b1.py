"""Issue 24's GPU figures: B1 (one request, decode tokens/s) with speculative decoding against plain
B1 in the same call, on a workload whose acceptance is known before it runs, and a batch-size sweep
(decode tokens/s plain vs n-gram at B requests) for `disable_by_batch_size`.

Workload (`spec_workload.py`): the weights are changed after construction through
`LLM.update_weights` so that greedy decoding is t -> f(t): "oproj" zeroes every o_proj (the issue's
design), "robust" also zeroes every down_proj and makes the head a permuted copy of the embedding
(f a permutation with a large logit margin, immune to bf16 rounding differences between programs).
The step's programs and the bytes it reads are unchanged. A B1 prompt is seed P + its own greedy
continuation C + P's last token, so the target's output is exactly C (`plain_matches_expected`);
`--corrupt-every J` replaces every J-th copied token; by default J is the one whose host-simulated
n-gram acceptance is the smallest >= --target-acceptance (chosen before any speculative engine
starts). Each workload runs at that J ("headline") and at the exact copy ("full").

Engines, one at a time (each shut down before the next; every engine gets the same weights):
plain, n-gram k, and with --draft the draft = target upper bound (draft weights transformed too).
The plain and n-gram engines run every workload's B1 and the --sweep (on the last workload).
Writes one JSON (--output-json), saved after every engine.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from spec_workload import WORKLOADS, apply, make_case, pick_corruption  # noqa: E402

WORKLOAD_NOTE = {
    "oproj": "o_proj zeroed in every layer (greedy decoding is t -> f(t)); prompt = seed + its greedy continuation "
             "(every J-th copied token corrupted) + the seed's last token",
    "robust": "o_proj and down_proj zeroed in every layer, LM head = scaled embedding with a permuted vocabulary "
              "(t -> perm(t), large logit margin); prompt = seed + its greedy continuation (every J-th copied "
              "token corrupted) + the seed's last token",
}


def _spec_delta(s0: dict, s1: dict) -> dict:
    if "spec_num_drafts" not in s1:
        return {}
    n = s1["spec_num_draft_tokens"] - s0["spec_num_draft_tokens"]
    a = s1["spec_num_accepted_tokens"] - s0["spec_num_accepted_tokens"]
    d = s1["spec_num_drafts"] - s0["spec_num_drafts"]
    return dict(acceptance=a / n if n else 0.0, mean_accepted_length=1 + a / d if d else 1.0, num_drafts=d)


def run_batch(llm, prompts: list[list[int]], output_len: int, rid: str) -> dict:
    """All prompts at once, greedy: decode tokens/s from the step where every request has its
    first token to the end (tokens emitted in that window over its seconds), and the outputs."""
    from jvllm import SamplingParams

    eng = llm.llm_engine
    sp = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    seqs = []
    for i, p in enumerate(prompts):
        eng.add_request(f"{rid}-{i}", {"prompt_token_ids": p}, sp)
        seqs.append(eng.groups[f"{rid}-{i}"].seqs[0])
    s0 = eng.get_stats()
    t0 = n0 = None
    st0 = s0
    while eng.has_unfinished_requests():
        eng.step()
        if t0 is None and all(s.num_output_tokens >= 1 for s in seqs):
            t0, n0, st0 = time.perf_counter(), sum(s.num_output_tokens for s in seqs), eng.get_stats()
    dt = time.perf_counter() - t0
    s1 = eng.get_stats()
    n = sum(s.num_output_tokens for s in seqs) - n0
    return dict(decode_tok_s=n / dt, decode_s=dt, decode_tokens=n, decode_steps=s1["num_steps"] - st0["num_steps"],
                **({"ahead_steps": s1["num_ahead_steps"] - st0["num_ahead_steps"]} if "num_ahead_steps" in s1 else {}),
                outputs=[list(s.output_token_ids) for s in seqs], **_spec_delta(s0, s1))


def b1(llm, prompt, output_len: int, iters: int, rid: str) -> dict:
    """Median over `iters` runs (after one warm-up run) of one request's decode tokens/s."""
    runs = [run_batch(llm, [prompt], output_len, f"{rid}-{i}") for i in range(iters + 1)][1:]
    out = runs[-1]["outputs"][0]
    res = dict(decode_tok_s=statistics.median(r["decode_tok_s"] for r in runs),
               runs=[{k: v for k, v in r.items() if k != "outputs"} for r in runs], output_token_ids=out)
    if "acceptance" in runs[0]:
        res["acceptance"] = statistics.mean(r["acceptance"] for r in runs)
        res["mean_accepted_length"] = statistics.mean(r["mean_accepted_length"] for r in runs)
    return res


def continuations(llm, seeds, n: int, want_gaps: bool) -> tuple[list[list[int]], list[float]]:
    """Greedy continuations of `seeds` (the first alone: batch 1 as in B1, the rest in one batch);
    with `want_gaps`, the first one's smallest top-2 logprob gap."""
    from jvllm import SamplingParams

    sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=2 if want_gaps else None)
    first = llm.generate([{"prompt_token_ids": seeds[0]}], sp, use_tqdm=False)[0].outputs[0]
    gaps = []
    if want_gaps:
        for e in first.logprobs:
            lp = sorted((v.logprob for v in e.values()), reverse=True)
            gaps.append(lp[0] - lp[1] if len(lp) > 1 else float("inf"))
    rest = []
    if len(seeds) > 1:
        sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        rest = [list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": s} for s in seeds[1:]], sp,
                                                                     use_tqdm=False)]
    return [list(first.token_ids)] + rest, gaps


def run_engine(llm, name: str, plan: dict, a, out: dict, plain_ids: dict):
    """Every workload's B1 cases (and the sweep, when `plan` has one) on one engine. The plain
    engine (first) fills `plain_ids` {(workload, case): output ids}; later ones compare with it."""
    plain = out.get("plain") if name != "plain" else None
    res = out.setdefault(name, {})
    for wl, cases in plan["cases"].items():
        apply(llm, wl)
        r = res.setdefault(wl, {})
        for kind, case in cases.items():
            if name == "draft_equals_target" and kind != "headline":
                continue
            x = b1(llm, case.prompt, a.output_len, a.iters, f"{name}-{wl}-{kind}")
            ids = x.pop("output_token_ids")
            x["matches_expected"] = ids == case.expected
            if plain is not None:
                p = plain[wl][kind]
                x["speedup_vs_plain"] = x["decode_tok_s"] / p["decode_tok_s"]
                x["output_identical_to_plain"] = ids == plain_ids[(wl, kind)]
            else:
                plain_ids[(wl, kind)] = ids
            r[kind] = x
            print(f"[{name}] {wl}/{kind}: B1 {x['decode_tok_s']:.1f} tok/s"
                  + (f" = {x['speedup_vs_plain']:.2f}x plain, acceptance {x.get('acceptance', 0):.3f}"
                     if plain is not None else f", matches expected {x['matches_expected']}"), flush=True)
    if plan.get("sweep") and name != "draft_equals_target":
        apply(llm, plan["sweep_workload"])
        rows = res.setdefault("sweep", [])
        for B in a.sweep:
            prompts = [c.prompt for c in plan["sweep"][:B]]
            runs = [run_batch(llm, prompts, a.sweep_output_len, f"{name}-sw{B}-{i}") for i in range(a.sweep_iters)]
            x = dict(batch=B, decode_tok_s=statistics.median(r["decode_tok_s"] for r in runs),
                     runs=[{k: v for k, v in r.items() if k != "outputs"} for r in runs])
            x["matches_expected"] = sum(o == c.expected[:a.sweep_output_len]
                                        for o, c in zip(runs[-1]["outputs"], plan["sweep"][:B]))
            if "acceptance" in runs[-1]:
                x["acceptance"] = statistics.mean(r["acceptance"] for r in runs)
            if plain is not None:
                x["speedup_vs_plain"] = x["decode_tok_s"] / plain["sweep"][len(rows)]["decode_tok_s"]
            rows.append(x)
            print(f"[{name}] sweep B={B}: {x['decode_tok_s']:.1f} tok/s"
                  + (f" = {x['speedup_vs_plain']:.2f}x plain, acceptance {x.get('acceptance', 0):.3f}"
                     if plain is not None else ""), flush=True)
    res["compiles_after_warmup"] = llm.llm_engine.get_stats()["compiles_after_warmup"]


def plan_workloads(llm, a, out: dict) -> dict:
    """Continuations with the plain engine, corruption levels, cases (host-simulated acceptance)."""
    vocab = llm.llm_engine.model_config.vocab_size
    n_seeds = max([1] + (a.sweep or []))
    rng = np.random.default_rng(a.seed)
    seeds = [[int(x) for x in rng.integers(10, vocab - 10, a.seed_len)] for _ in range(n_seeds)]
    n_c = max(a.output_len, a.sweep_output_len) + a.k + 1
    plan = dict(cases={}, sweep=None)
    for i, wl in enumerate(a.workloads):
        apply(llm, wl)
        last = i == len(a.workloads) - 1
        conts, gaps = continuations(llm, seeds if last and a.sweep else seeds[:1], n_c, want_gaps=True)
        lo, hi = a.lookup_min, a.lookup_max
        if a.corrupt_every is None:
            J, sim = pick_corruption(seeds[0], conts[0], a.output_len, vocab, a.k, lo, hi, a.target_acceptance)
        else:
            J = a.corrupt_every
        cases = {"headline": make_case(seeds[0], conts[0], a.output_len, J, vocab),
                 "full": make_case(seeds[0], conts[0], a.output_len, None, vocab)}
        plan["cases"][wl] = cases
        w = out.setdefault("workloads", {}).setdefault(wl, {})
        w.update(workload=WORKLOAD_NOTE[wl], corrupt_every=J, prompt_len=len(cases["headline"].prompt),
                 min_top2_logprob_gap=min(gaps[:a.output_len]),
                 simulated={k: dict(zip(("acceptance", "steps"), c.simulate(a.k, lo, hi))) for k, c in cases.items()})
        print(f"[plan] {wl}: J={J}, simulated {w['simulated']}, min top-2 gap {w['min_top2_logprob_gap']:.4f}",
              flush=True)
        if last and a.sweep:
            plan["sweep"] = [make_case(s, c, a.sweep_output_len, J, vocab) for s, c in zip(seeds, conts)]
            plan["sweep_workload"] = wl
            out["sweep"] = dict(workload=wl, corrupt_every=J, batches=a.sweep, output_len=a.sweep_output_len,
                                simulated_acceptance=statistics.mean(c.simulate(a.k, lo, hi)[0] for c in plan["sweep"]))
    return plan


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="random:llama3-8b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--token-buckets", default=None, help="comma list (default: powers of two 8 .. max-num-batched-tokens)")
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma list of {WORKLOADS}")
    ap.add_argument("--seed-len", type=int, default=64, help="random seed prompt tokens")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--lookup-min", type=int, default=2)
    ap.add_argument("--lookup-max", type=int, default=4)
    ap.add_argument("--corrupt-every", type=int, default=None, help="J (default: chosen by --target-acceptance)")
    ap.add_argument("--target-acceptance", type=float, default=0.70)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--sweep", default="", help="batch sizes, e.g. 1,2,4,8,16,32 (empty: no sweep)")
    ap.add_argument("--sweep-output-len", type=int, default=128)
    ap.add_argument("--sweep-iters", type=int, default=1)
    ap.add_argument("--draft", action="store_true", help="also the draft = target upper bound")
    ap.add_argument("--output-json", required=True)
    a = ap.parse_args(argv)
    a.workloads = [w for w in a.workloads.split(",") if w]
    bad = [w for w in a.workloads if w not in WORKLOADS]
    if bad or not a.workloads:
        ap.error(f"--workloads {bad or a.workloads}: use names from {list(WORKLOADS)}")
    a.sweep = [int(x) for x in a.sweep.split(",") if x]
    if a.sweep and max(a.sweep) > a.max_num_seqs:
        ap.error(f"--sweep batch {max(a.sweep)} exceeds --max-num-seqs {a.max_num_seqs}")
    from jvllm import LLM
    from jvllm.bench import env as bench_env

    kw = dict(dtype=a.dtype, max_model_len=a.max_model_len, max_num_seqs=a.max_num_seqs,
              max_num_batched_tokens=a.max_num_batched_tokens, use_tqdm_on_load=False)
    if a.token_buckets:
        kw["token_buckets"] = tuple(int(x) for x in a.token_buckets.split(","))
    ngram = {"method": "ngram", "num_speculative_tokens": a.k, "prompt_lookup_max": a.lookup_max,
             "prompt_lookup_min": a.lookup_min}
    out = dict(model=a.model, dtype=a.dtype, output_len=a.output_len, k=a.k, prompt_lookup_min=a.lookup_min,
               prompt_lookup_max=a.lookup_max, target_acceptance=a.target_acceptance, iters=a.iters,
               engine_args={k: v for k, v in kw.items() if k != "use_tqdm_on_load"},
               versions=bench_env.versions())

    def save():
        with open(a.output_json, "w") as f:
            json.dump(out, f, indent=1, default=str)

    engines = [("plain", None), ("ngram", ngram)]
    if a.draft:
        engines.append(("draft_equals_target", {"model": a.model, "num_speculative_tokens": a.k}))
    plan, plain_ids = None, {}
    for name, cfg in engines:
        t = time.perf_counter()
        llm = LLM(a.model, **kw) if cfg is None else LLM(a.model, speculative_config=cfg, **kw)
        out.setdefault("init_s", {})[name] = time.perf_counter() - t
        out.setdefault("device", bench_env.device_info())
        try:
            if plan is None:
                plan = plan_workloads(llm, a, out)  # compiles on demand while the warm-up runs
            out.setdefault("warmup_wait_s", {})[name] = llm.llm_engine.wait_for_warmup()
            if cfg is not None:
                out.setdefault("speculative_config", {})[name] = cfg
            run_engine(llm, name, plan, a, out, plain_ids)
        finally:
            llm.shutdown()
            save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
