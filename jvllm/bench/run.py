"""Running the workloads on a built engine: construction and first token, then W1 / B1 / P1.

Compile and warm-up never fall inside a timed window: the engine compiles the first request's
programs when it is constructed and the rest in the background, and the caller waits for those
(`settle`) after the first token and before any workload."""
from __future__ import annotations

import statistics
import sys
import time

from jvllm.bench.facts import kv_bytes_per_token, param_stats
from jvllm.bench.workloads import GREEDY, W1_INPUT_LEN, Sampling, cap_input_len, one_prompt, w1_prompts


def build_llm(model: str, engine_kwargs: dict):
    """(LLM, start-up seconds: construct, init, load, warm-up compile and init's parts)."""
    from jvllm import LLM

    kw = dict(engine_kwargs)
    kw.setdefault("use_tqdm_on_load", False)
    kw.setdefault("warmup", "all")  # measured windows compile nothing, whatever JVLLM_WARMUP says
    t0 = time.perf_counter()
    llm = LLM(model, **kw)
    construct = time.perf_counter() - t0
    e = llm.llm_engine
    e0 = getattr(e, "replicas", [e])[0]  # data parallel: replica 0's split
    return llm, dict(construct_s=construct, init_s=e.init_seconds, load_s=e.load_seconds, warmup_compile_s=e.warmup_seconds,
                     init_parts=dict(getattr(e0, "init_parts", {})))


def settle(llm, st: dict) -> None:
    """Wait for the engine's background warm-up (nothing is timed, nor compiles counted, before
    every program is in); records its seconds and how long this wait took in `st`."""
    t = time.perf_counter()
    while True:  # a line every 30 s: a long background compile is never silent
        try:
            st["warmup_background_s"] = llm.llm_engine.wait_for_warmup(30.0)
            break
        except TimeoutError:
            print(f"jvllm bench: waiting for the background warm-up ({time.perf_counter() - t:.0f} s)",
                  file=sys.stderr, flush=True)
    st["warmup_wait_s"] = time.perf_counter() - t


def first_token(llm, vocab: int, t_construct_start: float, length: int = 16, sampling: Sampling = GREEDY) -> float:
    """Seconds from `t_construct_start` (perf_counter) to the first token of one short request."""
    llm.generate([{"prompt_token_ids": one_prompt(length, vocab, seed=10_000)}], sampling.params(1), use_tqdm=False)
    return time.perf_counter() - t_construct_start


def stepwise(llm, prompt: list[int], max_tokens: int, rid: str, sampling: Sampling = GREEDY) -> tuple[list[float], list[int]]:
    """Drive the engine step by step for one request: (seconds per step, output tokens after each)."""
    eng = llm.llm_engine
    eng.add_request(rid, {"prompt_token_ids": prompt}, sampling.params(max_tokens))
    seq = eng.groups[rid].seqs[0]
    times, ntok = [], []
    while eng.has_unfinished_requests():
        t = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t)
        ntok.append(seq.num_output_tokens)
    return times, ntok


def spec_delta(s0: dict, s1: dict) -> dict:
    """Speculative decoding between two get_stats() (empty without a speculative_config)."""
    if "spec_num_drafts" not in s1:
        return {}
    d = {k: s1[k] - s0[k] for k in ("spec_num_drafts", "spec_num_draft_tokens", "spec_num_accepted_tokens")}
    n, acc = d["spec_num_draft_tokens"], d["spec_num_accepted_tokens"]
    return dict(d, spec_acceptance_rate=acc / n if n else 0.0,
                spec_mean_accepted_length=1 + acc / d["spec_num_drafts"] if d["spec_num_drafts"] else 1.0)


def host_share(s0: dict, s1: dict) -> dict:
    """Engine time split between host work (schedule, inputs, dispatch, post-processing: the
    device idles unless a step is queued) and waiting for the device, between two get_stats().
    `step_call_put` (moving a step's host inputs onto a mesh's devices) is part of `step_call`."""
    host = s1["host_seconds"] - s0["host_seconds"]
    parts = {f"host_{k.removesuffix('_s')}_ms_per_step": 1e3 * (s1[k] - s0[k]) / max(1, s1["num_steps"] - s0["num_steps"])
             for k in ("prepare_s", "step_call_s", "step_call_put_s", "sample_inputs_s", "sample_call_s") if k in s1}
    wait = s1["device_wait_seconds"] - s0["device_wait_seconds"]
    steps = max(1, s1["num_steps"] - s0["num_steps"])
    return dict(host_ms_per_step=1e3 * host / steps, device_wait_ms_per_step=1e3 * wait / steps,
                host_share=host / (host + wait) if host + wait > 0 else None, **parts)


def _pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else None


def run_throughput(llm, num_prompts: int = 256, input_len=W1_INPUT_LEN, output_len: int = 256,
                   warmup_requests: int = 4, sampling: Sampling = GREEDY) -> dict:
    """W1: every prompt submitted at once; output tokens/s over the whole window, and the window
    split at the moment the last request got its first token."""
    from jvllm.compilation import compile_count

    vocab = llm.llm_engine.model_config.vocab_size
    asked = tuple(input_len)
    input_len, note = cap_input_len(asked, output_len, llm.llm_engine.sched_config.max_model_len)
    if note:
        print(note, file=sys.stderr)
    prompts = [{"prompt_token_ids": p} for p in w1_prompts(num_prompts, input_len, vocab)]
    if warmup_requests:  # different seed: no prefix-cache hits on the measured prompts
        warm = [{"prompt_token_ids": p} for p in w1_prompts(warmup_requests, input_len, vocab, seed=12345)]
        llm.generate(warm, sampling.params(8), use_tqdm=False)
    s0 = llm.get_stats()
    c0 = compile_count()
    t0, t0_wall = time.perf_counter(), time.time()
    outs = llm.generate(prompts, sampling.params(output_len), use_tqdm=False)
    dt = time.perf_counter() - t0
    # the phases: until every request has its first token (all prompts computed, decodes riding
    # along in the same steps), then decode-only steps; first_token_time is the wall clock at which
    # the engine read that token back (with async scheduling, about one step after the device)
    firsts = [o.metrics.first_token_time for o in outs if o.metrics and o.metrics.first_token_time]
    prefill_s = min(dt, max(firsts) - t0_wall) if len(firsts) == len(outs) and firsts else None
    c1 = compile_count()
    s1 = llm.get_stats()
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    n_in = sum(len(p["prompt_token_ids"]) for p in prompts)
    steps = s1["num_steps"] - s0["num_steps"]
    return dict(num_requests=num_prompts, input_len=list(input_len), output_len=output_len,
                input_len_asked=list(asked), input_len_note=note,
                prompt_tokens=n_in, output_tokens=n_out, elapsed_s=dt,
                output_tok_s=n_out / dt, total_tok_s=(n_in + n_out) / dt, requests_per_s=num_prompts / dt,
                num_steps=steps, mean_step_ms=1e3 * dt / max(steps, 1), **host_share(s0, s1),
                prefill_phase_s=prefill_s, decode_phase_s=dt - prefill_s if prefill_s is not None else None,
                num_preemptions=s1["num_preemptions"] - s0["num_preemptions"],
                compiles_in_window=c1 - c0, compiles_after_warmup=s1["compiles_after_warmup"], **spec_delta(s0, s1),
                all_finished_by_length=all(o.outputs[0].finish_reason == "length" for o in outs))


def run_latency(llm, input_len: int = 512, output_len: int = 256, num_iters: int = 3, num_iters_warmup: int = 1,
                copy_bandwidth_Bps: float | None = None, sampling: Sampling = GREEDY) -> dict:
    """B1: one request stepped alone; the median iteration's decode figures, and MBU =
    (weight bytes + KV bytes read per step) / step time / copy bandwidth when the bandwidth is given."""
    vocab = llm.llm_engine.model_config.vocab_size
    iters = []
    for i in range(num_iters_warmup + num_iters):
        s0 = llm.get_stats()
        times, ntok = stepwise(llm, one_prompt(input_len, vocab, seed=100 + i), output_len, f"b1-{i}", sampling)
        s1 = llm.get_stats()
        share = dict(host_share(s0, s1), **spec_delta(s0, s1))
        k = ntok.index(1)  # the step that produced the first token (after any prefill chunks)
        dec = times[k + 1:]
        it = dict(ttft_s=sum(times[:k + 1]), prefill_steps=k + 1, decode_steps=len(dec),
                  total_s=sum(times), output_tokens=ntok[-1])
        if dec:
            it.update(decode_s=sum(dec), step_ms_mean=1e3 * statistics.fmean(dec),
                      step_ms_median=1e3 * statistics.median(dec), step_ms_p90=1e3 * _pct(dec, 0.9),
                      step_ms_min=1e3 * min(dec), decode_tok_s=(ntok[-1] - ntok[k]) / sum(dec))  # tokens: a speculative step emits several
        it["e2e_tok_s"] = ntok[-1] / sum(times)
        it.update(share)
        if i >= num_iters_warmup:
            iters.append(it)
    best = sorted(iters, key=lambda d: d.get("decode_tok_s", 0))[len(iters) // 2]  # median iteration
    ps = param_stats(llm)
    kvpt = kv_bytes_per_token(llm)
    mean_ctx = input_len + output_len / 2  # decode step j (1..output_len-1) attends input_len + j tokens
    # mixture of experts: the weights one token reads (its top_k experts), B1's floor
    step_bytes = ps.get("active_weight_bytes", ps["weight_bytes"]) + kvpt * mean_ctx
    out = dict(input_len=input_len, output_len=output_len, num_iters=num_iters, iterations=iters,
               tok_s=best.get("decode_tok_s"), e2e_tok_s=best["e2e_tok_s"], step_ms=best.get("step_ms_mean"),
               step_ms_median=best.get("step_ms_median"), ttft_s=best["ttft_s"], host_share=best["host_share"],
               host_ms_per_step=best["host_ms_per_step"],
               host_parts={k: v for k, v in best.items() if k.startswith("host_") and k != "host_share"}, **ps,
               **{k: v for k, v in best.items() if k.startswith("spec_")},
               kv_bytes_per_token=kvpt, mean_context=mean_ctx, bytes_per_step=step_bytes,
               mbu_definition="(weight_bytes (MoE: active_weight_bytes) + kv_bytes_per_token x mean_context) / "
                              "mean decode step / copy bandwidth")
    if copy_bandwidth_Bps and best.get("step_ms_mean"):
        out["achieved_Bps"] = step_bytes / (best["step_ms_mean"] / 1e3)
        out["mbu"] = out["achieved_Bps"] / copy_bandwidth_Bps
        out["roofline_step_ms"] = 1e3 * step_bytes / copy_bandwidth_Bps
    return out


def run_prefill(llm, input_len: int = 2048, num_iters: int = 3, num_iters_warmup: int = 1,
                matmul_flops_per_s: float | None = None, sampling: Sampling = GREEDY) -> dict:
    """P1: one prompt, one output token; the median iteration's prefill tokens/s, and MFU =
    2 x params (MoE: active_params) x tokens / time / matmul rate when the rate is given."""
    vocab = llm.llm_engine.model_config.vocab_size
    iters = []
    for i in range(num_iters_warmup + num_iters):
        times, _ = stepwise(llm, one_prompt(input_len, vocab, seed=200 + i), 1, f"p1-{i}", sampling)
        if i >= num_iters_warmup:
            iters.append(dict(prefill_s=sum(times), steps=len(times), tok_s=input_len / sum(times)))
    best = sorted(iters, key=lambda d: d["tok_s"])[len(iters) // 2]
    ps = param_stats(llm)
    out = dict(input_len=input_len, num_iters=num_iters, iterations=iters, prefill_s=best["prefill_s"],
               steps=best["steps"], tok_s=best["tok_s"], **ps,
               mfu_definition="2 x num_params (MoE: active_params) x tokens / prefill seconds / measured matmul rate")
    if matmul_flops_per_s:
        out["achieved_flops_per_s"] = 2 * ps.get("active_params", ps["num_params"]) * best["tok_s"]
        out["mfu"] = out["achieved_flops_per_s"] / matmul_flops_per_s
    return out
