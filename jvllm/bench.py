"""`jvllm bench throughput | latency | prefill | all`: the offline workloads of BENCHMARKS.md.

    W1 throughput  N requests at t=0, W1 prompts (numpy default_rng(0)), output-len tokens each,
                   greedy, EOS ignored. Figure: output tokens/s from first submission to last token.
    B1 latency     one prompt of input-len tokens, output-len tokens. Figures: tokens/s, ms per
                   decode step, MBU = (weight bytes + KV bytes read per step) / step time / copy
                   bandwidth, the bandwidth measured in the same run (jitted x + 1 on a large
                   array, read + write counted).
    P1 prefill     one prompt of input-len tokens, max_tokens=1. Figures: tokens/s and
                   MFU = 2 x params x tokens / time / matmul rate (jnp.dot on an N x N matrix in the
                   model dtype, measured in the same run).
    cold start     every run reports construction (load + compile) and first-token seconds;
                   `--cold-start` also runs two child processes (empty, then warm compilation cache
                   in a fresh temp dir) and reports process start -> first token for each.

Compile and warm-up never fall inside a timed window: the engine compiles the first request's
programs when it is constructed and the rest in the background, and the bench waits for those
(`settle`) after the first token and before any workload; the ceilings (bandwidth, matmul) are measured before the engine exists so that
their compiles do not count against `compiles_after_warmup`.

Every run writes JSON (versions, device, config, every figure, per-program XLA report summary) to
--output-json, default $OUT/ or ./bench_results/ as bench_<workload>.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time

W1_INPUT_LEN = (64, 1024)

# --------------------------------------------------------------------------- workload


def w1_prompts(n: int, input_len: tuple[int, int] = W1_INPUT_LEN, vocab: int = 128256, seed: int = 0) -> list[list[int]]:
    """W1 prompts: `rng = default_rng(seed); lens = rng.integers(lo, hi + 1, n)`, then per length
    `rng.integers(100, 128000, l)`. Ids >= vocab are taken mod vocab (small-vocab models) so the
    prompts stay distinct: clipping would turn them into runs of one id that the prefix cache shares."""
    import numpy as np

    lo, hi = input_len
    rng = np.random.default_rng(seed)
    lens = rng.integers(lo, hi + 1, n)
    out = []
    for length in lens:
        ids = rng.integers(100, 128000, int(length))
        if vocab < 128000:
            ids = ids % vocab
        out.append(ids.tolist())
    return out


def cap_input_len(input_len: tuple[int, int], output_len: int, max_model_len: int) -> tuple[tuple[int, int], str | None]:
    """W1's prompt length range cut so that a prompt and its `output_len` tokens fit in
    `max_model_len` (a short-context model), and the line that says so (None when nothing was cut).
    Raises ValueError when `output_len` alone leaves no room for a prompt of one token."""
    lo, hi = input_len
    room = max_model_len - output_len
    if room < 1:
        raise ValueError(f"--output-len {output_len} leaves no room for a prompt: max_model_len is {max_model_len}; "
                         f"lower --output-len below {max_model_len}")
    if hi <= room:
        return (lo, hi), None
    capped = (min(lo, room), room)
    return capped, (f"W1: prompt lengths {lo}..{hi} capped to {capped[0]}..{capped[1]} so that prompt + "
                    f"{output_len} output tokens fit max_model_len {max_model_len}")


def _one_prompt(length: int, vocab: int, seed: int) -> list[int]:
    return w1_prompts(1, (length, length), vocab, seed)[0]


# --------------------------------------------------------------------------- environment


def git_commit() -> dict:
    """The jvllm checkout's commit (None where there is no git metadata, e.g. a copied tree;
    JVLLM_GIT_COMMIT overrides)."""
    here = os.path.dirname(os.path.abspath(__file__))
    if os.environ.get("JVLLM_GIT_COMMIT"):
        return dict(commit=os.environ["JVLLM_GIT_COMMIT"], dirty=None)
    out = dict(commit=None, dirty=None)
    try:
        p = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10, check=False)
        sha = p.stdout.strip()
        if p.returncode == 0 and re.fullmatch(r"[0-9a-f]{40}", sha):
            out["commit"] = sha
            st = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                                capture_output=True, text=True, timeout=10, check=False)
            out["dirty"] = bool(st.stdout.strip()) if st.returncode == 0 else None
    except Exception:
        pass
    return out


def versions() -> dict:
    from importlib import metadata

    v = {"python": platform.python_version()}
    for name in ("jvllm", "jax", "jaxlib", "flax", "transformers", "numpy", "torch"):
        try:
            v[name] = metadata.version(name)
        except Exception:
            v[name] = None
    v["jvllm_git"] = git_commit()
    return v


def device_info() -> dict:
    import jax

    devs = jax.devices()
    d = devs[0]
    return dict(platform=d.platform, device_kind=getattr(d, "device_kind", None), count=len(devs),
                process_count=jax.process_count(), local_count=jax.local_device_count(),
                backend=jax.default_backend(), host=platform.node(), host_cpus=os.cpu_count(),
                machine=platform.machine())


def _jnp_dtype(name: str):
    from jvllm.worker.worker import resolve_dtype

    return resolve_dtype(name)


# --------------------------------------------------------------------------- ceilings


def _median_time(fn, *args, trials: int = 7, calls: int = 10) -> float:
    """Seconds per call: median over `trials` of `calls` back-to-back calls then one sync (so the
    host round trip of a sync is spread over many calls), after a warm-up."""
    import jax

    for _ in range(3):
        jax.block_until_ready(fn(*args))  # compile, first run, clocks up
    ts = []
    for _ in range(trials):
        t = time.perf_counter()
        outs = [fn(*args) for _ in range(calls)]
        jax.block_until_ready(outs)
        ts.append((time.perf_counter() - t) / calls)
        del outs
    return statistics.median(ts)


def measure_copy_bandwidth(nbytes: int | None = None) -> dict:
    """Device copy bandwidth (read + write) from a jitted `x + 1` over a large array."""
    import jax
    import jax.numpy as jnp

    on_acc = jax.default_backend() != "cpu"
    nbytes = nbytes or (2 * 2**30 if on_acc else 256 * 2**20)
    n = nbytes // 4
    x = jnp.ones((n,), jnp.float32)
    f = jax.jit(lambda a: a + 1.0)
    dt = _median_time(f, x, calls=10 if on_acc else 2)
    x.delete()
    return dict(copy_bytes=n * 4, copy_seconds=dt, copy_bandwidth_Bps=2 * n * 4 / dt, counts="read + write")


def measure_matmul_rate(n: int | None = None, dtype="float32") -> dict:
    """FLOP/s of jnp.dot on an n x n matrix in `dtype` (8192 on an accelerator, 2048 on a CPU)."""
    import jax
    import jax.numpy as jnp

    on_acc = jax.default_backend() != "cpu"
    n = n or (8192 if on_acc else 2048)
    dt_ = jnp.dtype(dtype)
    a = jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.float32).astype(dt_)
    b = jax.random.normal(jax.random.PRNGKey(1), (n, n), jnp.float32).astype(dt_)
    f = jax.jit(lambda x, y: jnp.dot(x, y))
    dt = _median_time(f, a, b, calls=10 if on_acc else 1, trials=7 if on_acc else 3)
    a.delete(), b.delete()
    return dict(matmul_n=n, matmul_dtype=str(dt_), matmul_seconds=dt, matmul_flops_per_s=2 * n**3 / dt)


# --------------------------------------------------------------------------- engine facts


def param_stats(llm) -> dict:
    """Unique parameter arrays of the runner (state leaves + head, tied head counted once)."""
    import jax

    r = llm.llm_engine.runner
    states = [st.state for st in getattr(r, "stages", None) or []] or [r.state]  # pipeline stages, or one
    seen, nbytes, count = set(), 0, 0
    for a in jax.tree_util.tree_leaves(states) + [r.head_w]:
        if not hasattr(a, "nbytes") or id(a) in seen:
            continue
        seen.add(id(a))
        nbytes += int(a.nbytes)
        count += int(a.size)
    out = dict(weight_bytes=nbytes, num_params=count)
    mc = getattr(llm.llm_engine, "model_config", None)
    if getattr(mc, "moe", None) is not None:  # one decode token reads top_k of the experts
        m = mc.moe
        sparse = sum(m.is_sparse(i) for i in range(mc.num_layers))
        experts = sparse * 3 * mc.hidden_size * m.expert_size * m.num_experts * r.head_w.dtype.itemsize
        out["active_weight_bytes"] = nbytes - experts + experts * m.top_k // m.num_experts
    return out


def kv_bytes_per_token(llm) -> int:
    from jvllm.memory.kv_cache import bytes_per_block

    e = getattr(llm.llm_engine, "replicas", [llm.llm_engine])[0]
    return bytes_per_block(e.model_config, e.worker.kv_dtype, 1)  # every layer, every KV head


def _prog_name(kind, key) -> str:
    if kind == "sample" and isinstance(key, tuple) and len(key) == 2:
        return f"sample[R={key[0]}{',extras' if key[1] else ''}]"
    if kind == "greedy":
        return f"sample[R={key},greedy]"
    if kind == "step" and isinstance(key, tuple) and len(key) == 3:  # (pipeline stage, T, decode-only)
        return f"step[stage={key[0]},T={key[1]}{',decode' if key[2] else ''}]"
    return f"{kind}[T={key}]" if isinstance(key, int) else f"{kind}{list(key) if isinstance(key, tuple) else [key]}"


_FUSION_OP = re.compile(r"^\s*(?:ROOT\s+)?%\S+\s*=\s*.*?\bfusion\(", re.MULTILINE)


def fusion_ops(exe) -> int | None:
    """Fusion instructions in the optimized HLO (`%x = ... fusion(...)`, any backend's naming)."""
    try:
        return len(_FUSION_OP.findall(exe.as_text()))
    except Exception:
        return None


def xla_report(llm) -> dict:
    """jvllm.compile.program_report for every compiled program (plus `fusion_ops`, counted here from
    the HLO text by op rather than by name), and per-kind maxima."""
    from jvllm.compilation import program_report

    progs, summary = {}, {}
    t0 = time.perf_counter()
    e0 = getattr(llm.llm_engine, "replicas", [llm.llm_engine])[0]
    for (kind, key), exe in sorted(e0.worker.compiled_programs().items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
        rep = program_report(exe)
        rep["fusion_ops"] = fusion_ops(exe)
        progs[_prog_name(kind, key)] = rep
        s = summary.setdefault(kind, dict(programs=0))
        s["programs"] += 1
        for f in ("fusions", "fusion_ops", "hlo_instructions", "flops", "bytes_accessed"):
            if rep.get(f) is not None:
                s[f"max_{f}"] = max(s.get(f"max_{f}", 0), rep[f])
        if "temp_bytes" in rep:
            s["max_temp_bytes"] = max(s.get("max_temp_bytes", 0), rep["temp_bytes"])
    return dict(summary=summary, programs=progs, report_seconds=time.perf_counter() - t0)


def build_llm(model: str, engine_kwargs: dict):
    from jvllm import LLM

    kw = dict(engine_kwargs)
    kw.setdefault("use_tqdm_on_load", False)
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
    st["warmup_background_s"] = llm.llm_engine.wait_for_warmup()
    st["warmup_wait_s"] = time.perf_counter() - t


# W1 / B1 are greedy by definition; --temperature / --top-p / --top-k run the same workloads with
# sampling (the general sampler program instead of the argmax-only one)
_SAMPLING = dict(temperature=0.0, top_p=1.0, top_k=-1)


def _sp(max_tokens: int):
    from jvllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **_SAMPLING)


def first_token(llm, vocab: int, t_construct_start: float, length: int = 16) -> float:
    """Seconds from `t_construct_start` (perf_counter) to the first token of one short request."""
    llm.generate([{"prompt_token_ids": _one_prompt(length, vocab, seed=10_000)}], _sp(1), use_tqdm=False)
    return time.perf_counter() - t_construct_start


def _stepwise(llm, prompt: list[int], max_tokens: int, rid: str) -> tuple[list[float], list[int]]:
    """Drive the engine step by step for one request: (seconds per step, output tokens after each)."""
    eng = llm.llm_engine
    eng.add_request(rid, {"prompt_token_ids": prompt}, _sp(max_tokens))
    seq = eng.groups[rid].seqs[0]
    times, ntok = [], []
    while eng.has_unfinished_requests():
        t = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t)
        ntok.append(seq.num_output_tokens)
    return times, ntok


def _host_share(s0: dict, s1: dict) -> dict:
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


def _spec_delta(s0: dict, s1: dict) -> dict:
    """Speculative decoding between two get_stats() (empty without a speculative_config)."""
    if "spec_num_drafts" not in s1:
        return {}
    d = {k: s1[k] - s0[k] for k in ("spec_num_drafts", "spec_num_draft_tokens", "spec_num_accepted_tokens")}
    n, acc = d["spec_num_draft_tokens"], d["spec_num_accepted_tokens"]
    return dict(d, spec_acceptance_rate=acc / n if n else 0.0,
                spec_mean_accepted_length=1 + acc / d["spec_num_drafts"] if d["spec_num_drafts"] else 1.0)


def _pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else None


# --------------------------------------------------------------------------- workloads


def run_throughput(llm, num_prompts: int = 256, input_len=W1_INPUT_LEN, output_len: int = 256,
                   warmup_requests: int = 4) -> dict:
    from jvllm.compilation import compile_count

    vocab = llm.llm_engine.model_config.vocab_size
    asked = tuple(input_len)
    input_len, note = cap_input_len(asked, output_len, llm.llm_engine.sched_config.max_model_len)
    if note:
        print(note, file=sys.stderr)
    prompts = [{"prompt_token_ids": p} for p in w1_prompts(num_prompts, input_len, vocab)]
    if warmup_requests:  # different seed: no prefix-cache hits on the measured prompts
        warm = [{"prompt_token_ids": p} for p in w1_prompts(warmup_requests, input_len, vocab, seed=12345)]
        llm.generate(warm, _sp(8), use_tqdm=False)
    s0 = llm.get_stats()
    c0 = compile_count()
    t0, t0_wall = time.perf_counter(), time.time()
    outs = llm.generate(prompts, _sp(output_len), use_tqdm=False)
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
                num_steps=steps, mean_step_ms=1e3 * dt / max(steps, 1), **_host_share(s0, s1),
                prefill_phase_s=prefill_s, decode_phase_s=dt - prefill_s if prefill_s is not None else None,
                num_preemptions=s1["num_preemptions"] - s0["num_preemptions"],
                compiles_in_window=c1 - c0, compiles_after_warmup=s1["compiles_after_warmup"], **_spec_delta(s0, s1),
                all_finished_by_length=all(o.outputs[0].finish_reason == "length" for o in outs))


def run_latency(llm, input_len: int = 512, output_len: int = 256, num_iters: int = 3, num_iters_warmup: int = 1,
                copy_bandwidth_Bps: float | None = None) -> dict:
    vocab = llm.llm_engine.model_config.vocab_size
    iters = []
    for i in range(num_iters_warmup + num_iters):
        s0 = llm.get_stats()
        times, ntok = _stepwise(llm, _one_prompt(input_len, vocab, seed=100 + i), output_len, f"b1-{i}")
        s1 = llm.get_stats()
        share = dict(_host_share(s0, s1), **_spec_delta(s0, s1))
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
    # decode step j (1..output_len-1) attends input_len + j tokens
    mean_ctx = input_len + output_len / 2
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
                matmul_flops_per_s: float | None = None) -> dict:
    vocab = llm.llm_engine.model_config.vocab_size
    iters = []
    for i in range(num_iters_warmup + num_iters):
        times, _ = _stepwise(llm, _one_prompt(input_len, vocab, seed=200 + i), 1, f"p1-{i}")
        if i >= num_iters_warmup:
            iters.append(dict(prefill_s=sum(times), steps=len(times), tok_s=input_len / sum(times)))
    best = sorted(iters, key=lambda d: d["tok_s"])[len(iters) // 2]
    ps = param_stats(llm)
    out = dict(input_len=input_len, num_iters=num_iters, iterations=iters, prefill_s=best["prefill_s"],
               steps=best["steps"], tok_s=best["tok_s"], **ps,
               mfu_definition="2 x num_params x tokens / prefill seconds / measured matmul rate")
    if matmul_flops_per_s:
        out["achieved_flops_per_s"] = 2 * ps["num_params"] * best["tok_s"]
        out["mfu"] = out["achieved_flops_per_s"] / matmul_flops_per_s
    return out


# --------------------------------------------------------------------------- cold start


def _cold_child(spec_json: str):
    """Child process: construct the engine and produce one token; print a JSON line."""
    t_start = time.time()  # after interpreter start-up and `import jvllm` (run as -m jvllm.bench)
    spec = json.loads(spec_json)
    t0 = time.perf_counter()
    llm, st = build_llm(spec["model"], spec["engine"])
    vocab = llm.llm_engine.model_config.vocab_size
    llm.generate([{"prompt_token_ids": _one_prompt(16, vocab, seed=10_000)}], _sp(1), use_tqdm=False)
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


# --------------------------------------------------------------------------- driver


def _default_json_path(name: str, model: str) -> str:
    d = os.environ.get("JVLLM_BENCH_DIR") or os.environ.get("OUT") or os.path.join(os.getcwd(), "bench_results")
    tag = model.replace("random:", "random-").replace("/", "_").replace(":", "-")
    return os.path.join(d, f"bench_{name}_{tag}.json")


def write_json(path: str, data: dict):
    os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=1, default=str)


def _parse_len_range(s: str) -> tuple[int, int]:
    parts = [int(x) for x in str(s).replace(":", ",").split(",") if x.strip()]
    if len(parts) == 1:
        return parts[0], parts[0]
    if len(parts) != 2 or parts[0] > parts[1] or parts[0] < 1:
        raise argparse.ArgumentTypeError(f"--input-len wants LO,HI with 1 <= LO <= HI, got {s!r}")
    return parts[0], parts[1]


def run_benchmark(name: str, a) -> dict:
    """Run one of throughput / latency / prefill / all from parsed CLI args; returns the JSON dict."""
    from jvllm.cli import engine_kwargs

    ekw = engine_kwargs(a)
    _SAMPLING.update(temperature=a.temperature, top_p=a.top_p, top_k=a.top_k)
    ekw = {k: v for k, v in ekw.items() if v is not None}
    ekw["use_tqdm_on_load"] = bool(getattr(a, "progress", False))
    workloads = ("throughput", "latency", "prefill") if name == "all" else (name,)
    if "prefill" in workloads and a.max_model_len is not None:
        plen = a.prefill_len if name == "all" else a.input_len
        if a.max_model_len <= plen:
            raise SystemExit(f"P1 prefill of {plen} tokens needs --max-model-len > {plen} (got {a.max_model_len})")
    if "prefill" in workloads and a.max_num_batched_tokens is None:
        ekw["max_num_batched_tokens"] = a.prefill_len if name == "all" else a.input_len  # P1 in one step
    result = dict(benchmark=name, timestamp=time.strftime("%Y-%m-%dT%H:%M:%S%z"), versions=versions(),
                  config=dict(model=a.model, engine=ekw, sampling=dict(_SAMPLING), argv=sys.argv[1:]))
    if a.cold_start:  # before this process touches the accelerator
        result["cold_start"] = run_cold_start(a.model, ekw)
    from jvllm.memory.device import claim_device_memory

    claim_device_memory(ekw.get("gpu_memory_utilization", 0.9))  # before the ceilings initialize the backend
    import jax

    t_backend = time.perf_counter()
    result["device"] = device_info()
    result["device"]["backend_init_s"] = time.perf_counter() - t_backend
    ceil = {}
    if "latency" in workloads:
        ceil.update(measure_copy_bandwidth(a.copy_bytes))
    if "prefill" in workloads:
        ceil.update(measure_matmul_rate(a.matmul_n, _jnp_dtype(a.dtype)))
    if ceil:
        ceil["platform"] = jax.default_backend()
        if jax.default_backend() == "cpu":
            ceil["note"] = "CPU ceilings: host memory bandwidth / host matmul rate, not a GPU roofline"
        result["ceilings"] = ceil
    t0 = time.perf_counter()
    llm, st = build_llm(a.model, ekw)
    vocab = llm.llm_engine.model_config.vocab_size
    st["first_token_s"] = first_token(llm, vocab, t0)  # while the background warm-up may still run
    st["first_token_after_construct_s"] = st["first_token_s"] - st["construct_s"]
    settle(llm, st)
    st["other_init_s"] = st["init_s"] - st["load_s"] - st["warmup_compile_s"]  # sizing, KV alloc, probes
    result["startup"] = st
    e = llm.llm_engine
    result["config"]["resolved"] = dict(
        dtype=str(e.dtype.__name__ if hasattr(e.dtype, "__name__") else e.dtype),
        max_model_len=e.sched_config.max_model_len, max_num_batched_tokens=e.sched_config.max_num_batched_tokens,
        max_num_seqs=e.sched_config.max_num_seqs, token_buckets=list(e.runner.token_buckets),
        num_blocks=e.runner.num_blocks, block_size=e.runner.block_size, vocab_size=vocab,
        **param_stats(llm))
    res, errors = {}, {}

    def attempt(key, fn, *args):
        try:
            res[key] = fn(*args)
        except Exception as e:  # keep the other workloads' figures; the error goes into the JSON
            if name != "all":
                raise
            import traceback

            errors[key] = "".join(traceback.format_exception_only(type(e), e)).strip()[-2000:]
            print(f"bench {key} failed: {errors[key]}", file=sys.stderr)

    try:
        if "throughput" in workloads:
            attempt("throughput", run_throughput, llm, a.num_prompts,
                    a.input_len if name != "all" else a.w1_input_len, a.output_len, a.warmup_requests)
        if "latency" in workloads:
            attempt("latency", run_latency, llm, a.input_len if name != "all" else a.b1_input_len,
                    a.output_len if name != "all" else a.b1_output_len, a.num_iters, a.num_iters_warmup,
                    ceil.get("copy_bandwidth_Bps"))
        if "prefill" in workloads:
            attempt("prefill", run_prefill, llm, a.input_len if name != "all" else a.prefill_len, a.num_iters,
                    a.num_iters_warmup, ceil.get("matmul_flops_per_s"))
        result["engine_stats"] = llm.get_stats()
        result["compiles_after_warmup"] = result["engine_stats"]["compiles_after_warmup"]
        result["memory"] = memory_report(llm)
        result["results"] = res if name == "all" else res[name]
        if errors:
            result["errors"] = errors
        if not a.no_xla_report:
            result["xla_programs"] = xla_report(llm)
    finally:
        llm.shutdown()
    return result


def memory_report(llm) -> dict:
    """Device memory after the runs: the allocator's peak and current use (None on backends
    without allocator stats, e.g. CPU), the weights and the KV pool. `per_device` lists every
    device with stats, in a multi-process run every process's (gathered: all processes call this)."""
    import jax
    import numpy as np

    from jvllm.memory.sizing import device_memory_stats

    eng = getattr(llm.llm_engine, "replicas", [llm.llm_engine])[0]
    stats = device_memory_stats() or {}
    keys = ("peak_bytes_in_use", "bytes_in_use", "bytes_limit")
    rows = []  # this process's devices: [peak, in use, limit], -1 where the backend has no stats
    for d in jax.local_devices():
        try:
            ms = d.memory_stats() or {}
        except Exception:
            ms = {}
        rows.append([int(ms.get(k) if ms.get(k) is not None else -1) for k in keys])
    table = np.asarray(rows, np.int64)[None]
    if jax.process_count() > 1:  # every process's GPUs, not only process 0's (a collective: all call it)
        from jax.experimental import multihost_utils

        # as bytes: without jax_enable_x64 an int64 array is gathered as int32 (an 80 GiB peak came
        # back as 0 on 2 H200s, build 479b533), while uint8 travels as it is
        raw = np.asarray(multihost_utils.process_allgather(table[0].view(np.uint8)))
        table = raw.reshape(raw.shape[0], -1).view(np.int64).reshape(raw.shape[0], len(rows), len(keys))
    per_device = [dict(device=f"process {p} local device {i}" if jax.process_count() > 1 else str(jax.local_devices()[i]),
                       **{k: (int(v) if v >= 0 else None) for k, v in zip(keys, row)})
                  for p, proc in enumerate(table) for i, row in enumerate(proc) if (row >= 0).any()]
    kv = sum(a.nbytes for pair in eng.runner.kv for a in pair)
    from jvllm.memory.device import claimed_fraction

    return dict(peak_bytes_in_use=stats.get("peak_bytes_in_use"), bytes_in_use=stats.get("bytes_in_use"),
                bytes_limit=stats.get("bytes_limit"), pool_bytes=stats.get("pool_bytes"),
                allocator_fraction_set_by_jvllm=claimed_fraction(), per_device=per_device,
                weight_bytes=param_stats(llm)["weight_bytes"], kv_pool_bytes_global=kv,
                kv_blocks=eng.runner.num_blocks, block_size=eng.runner.block_size,
                kv_cache_dtype=str(eng.runner.kv_dtype), kv_tokens=(eng.runner.num_blocks - 1) * eng.runner.block_size)


def _parts(v: dict) -> str:
    return ", ".join(f"{k.removeprefix('host_').removesuffix('_ms_per_step')} {x:.2f}" for k, x in v.items()
                     if k.startswith("host_") and k.endswith("_ms_per_step") and k != "host_ms_per_step")


def summary_lines(result: dict) -> list[str]:
    r = result.get("results", {})
    items = r.items() if result["benchmark"] == "all" else [(result["benchmark"], r)]
    dev = result.get("device", {})
    lines = [(f"jvllm bench {result['benchmark']}: {result['config']['model']} on {dev.get('device_kind')} "
              f"x{dev.get('count')} ({dev.get('platform')})")]
    st = result.get("startup", {})
    if st:
        parts = ", ".join(f"{k.removesuffix('_s')} {v:.1f}s" for k, v in (st.get("init_parts") or {}).items())
        bg = f" (+{st['warmup_background_s']:.1f}s in the background)" if st.get("warmup_background_s") else ""
        lines.append(f"  startup: load {st['load_s']:.1f}s, compile {st['warmup_compile_s']:.1f}s{bg}, "
                     f"first token {st['first_token_s']:.1f}s after construction start"
                     + (f" (other: {parts})" if parts else ""))
    for k, v in items:
        if k == "throughput":
            lines.append(f"  W1: {v['output_tok_s']:.1f} output tok/s, {v['total_tok_s']:.1f} total tok/s, "
                         f"{v['num_requests']} req in {v['elapsed_s']:.2f}s, preemptions {v['num_preemptions']}, "
                         f"compiles_after_warmup {v['compiles_after_warmup']}, {v['num_steps']} steps of "
                         f"{v['mean_step_ms']:.1f} ms, host {v['host_ms_per_step']:.2f} ms/step ({v['host_share']:.0%}: {_parts(v)})"
                         + (f", until every first token {v['prefill_phase_s']:.2f}s, then {v['decode_phase_s']:.2f}s of decodes"
                            if v.get("prefill_phase_s") is not None else ""))
        elif k == "latency":
            mbu = f", MBU {v['mbu']:.1%}" if "mbu" in v else ""
            lines.append(f"  B1: {v['tok_s']:.1f} tok/s, {v['step_ms']:.2f} ms/step, TTFT {v['ttft_s'] * 1e3:.1f} ms{mbu}, "
                         f"host {v['host_ms_per_step']:.2f} ms/step ({v['host_share']:.0%}: {_parts(v.get('host_parts', {}))})")
        elif k == "prefill":
            mfu = f", MFU {v['mfu']:.1%}" if "mfu" in v else ""
            lines.append(f"  P1: {v['tok_s']:.1f} tok/s ({v['input_len']} tokens in {v['prefill_s'] * 1e3:.1f} ms){mfu}")
    mem = result.get("memory") or {}
    if mem.get("peak_bytes_in_use"):
        lines.append(f"  memory: peak {mem['peak_bytes_in_use'] / 2**30:.1f} GiB of {mem['bytes_limit'] / 2**30:.1f} GiB "
                     f"(weights {mem['weight_bytes'] / 2**30:.1f} GiB, KV pool {mem['kv_pool_bytes_global'] / 2**30:.1f} GiB "
                     f"= {mem.get('kv_tokens')} tokens of {mem.get('kv_cache_dtype')}, "
                     f"all devices together); per device peak: "
                     + ", ".join(f"{d['peak_bytes_in_use'] / 2**30:.1f}" for d in mem.get("per_device", [])
                                 if d.get("peak_bytes_in_use")) + " GiB")
    for lab, c in result.get("cold_start", {}).items():
        if isinstance(c, dict) and "process_start_to_first_token_s" in c:
            lines.append(f"  cold start ({lab}): {c['process_start_to_first_token_s']:.1f}s process start -> first token "
                         f"(compile {c['warmup_compile_s']:.1f}s)")
    if "ceilings" in result:
        c = result["ceilings"]
        parts = []
        if "copy_bandwidth_Bps" in c:
            parts.append(f"copy {c['copy_bandwidth_Bps'] / 1e9:.1f} GB/s")
        if "matmul_flops_per_s" in c:
            parts.append(f"{c['matmul_dtype']} matmul {c['matmul_flops_per_s'] / 1e12:.2f} TFLOP/s")
        lines.append(f"  ceilings ({c['platform']}): " + ", ".join(parts))
    return lines


def cmd_bench(a):
    name = a.bench_cmd
    result = run_benchmark(name, a)
    import jax

    if jax.process_index() != 0:  # multi-process run: every process ran the same steps; process 0 reports
        print(f"process {jax.process_index()}: done (process 0 writes the JSON)")
        return
    path = a.output_json or _default_json_path(name, a.model)
    write_json(path, result)
    for line in summary_lines(result):
        print(line)
    print(f"  JSON: {path}")
    if result.get("compiles_after_warmup"):
        print(f"  WARNING: {result['compiles_after_warmup']} XLA compile(s) after warm-up", file=sys.stderr)


def _add_common(p, *, input_len_default, output_len_default, input_len_type=int):
    from jvllm.cli import add_engine_args

    p.add_argument("--model", default="smollm2", help="smollm2 | HF/GGUF/Orbax path | random:llama3-8b | random:tiny ...")
    add_engine_args(p)
    p.add_argument("--input-len", type=input_len_type, default=input_len_default)
    p.add_argument("--output-len", type=int, default=output_len_default)
    p.add_argument("--output-json", default=None, help="result file (default $OUT/ or ./bench_results/)")
    p.add_argument("--cold-start", action="store_true",
                   help="also time two child processes: empty vs warm compilation cache (temp dir)")
    p.add_argument("--no-xla-report", action="store_true", help="skip the per-program XLA report")
    p.add_argument("--progress", action="store_true", help="show the compile progress bar")
    p.add_argument("--num-iters", type=int, default=3, help="measured iterations (latency / prefill)")
    p.add_argument("--num-iters-warmup", type=int, default=1)
    p.add_argument("--copy-bytes", type=int, default=None, help="bandwidth probe size (default 2 GiB GPU, 256 MiB CPU)")
    p.add_argument("--matmul-n", type=int, default=None, help="matmul probe size (default 8192 GPU, 2048 CPU)")
    p.add_argument("--num-prompts", type=int, default=256, help="W1 requests (throughput)")
    p.add_argument("--warmup-requests", type=int, default=4, help="short untimed requests before W1")
    p.add_argument("--temperature", type=float, default=0.0, help="W1/B1 sampling (default greedy, as defined)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.set_defaults(func=cmd_bench)


def register(subparsers):
    b = subparsers.add_parser("bench", help="benchmarks: W1 throughput, B1 latency, P1 prefill (BENCHMARKS.md)")
    sub = b.add_subparsers(dest="bench_cmd", required=True)
    t = sub.add_parser("throughput", help="W1: N requests at t=0, output tokens/s")
    _add_common(t, input_len_default=W1_INPUT_LEN, output_len_default=256, input_len_type=_parse_len_range)
    lat = sub.add_parser("latency", help="B1: one prompt, decode tokens/s, ms/step, MBU")
    _add_common(lat, input_len_default=512, output_len_default=256)
    pf = sub.add_parser("prefill", help="P1: one long prompt, prefill tokens/s, MFU")
    _add_common(pf, input_len_default=2048, output_len_default=1)
    al = sub.add_parser("all", help="W1 + B1 + P1 on one engine (one compile)")
    _add_common(al, input_len_default=None, output_len_default=256)
    al.add_argument("--w1-input-len", type=_parse_len_range, default=W1_INPUT_LEN)
    al.add_argument("--b1-input-len", type=int, default=512)
    al.add_argument("--b1-output-len", type=int, default=256)
    al.add_argument("--prefill-len", type=int, default=2048)
    return b


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m jvllm.bench", add_help=False)
    ap.add_argument("--cold-child", default=None, help=argparse.SUPPRESS)
    known, rest = ap.parse_known_args(argv)
    if known.cold_child is not None:
        _cold_child(known.cold_child)
        return
    from jvllm.cli import main as cli_main

    cli_main(["bench", *rest])


if __name__ == "__main__":
    main()
