"""`jvllm bench throughput | latency | prefill | all`: the parser, and one run from its flags.

    cold start     every run reports construction (load + compile) and first-token seconds;
                   `--cold-start` also runs two child processes (empty, then warm compilation cache
                   in a fresh temp dir) and reports process start -> first token for each.

The ceilings (bandwidth, matmul) are measured before the engine exists so that their compiles do
not count against `compiles_after_warmup`. Every run writes JSON (versions, device, config, every
figure, per-program XLA report summary) to --output-json, default $OUT/ or ./bench_results/ as
bench_<workload>_<model>.json.
"""
from __future__ import annotations

import dataclasses

import argparse
import sys
import time

from jvllm.bench import ceilings, coldstart, facts, memory, report, run
from jvllm.bench.workloads import W1_INPUT_LEN, WORKLOADS, Sampling, parse_len_range


def _engine_kwargs(name: str, a) -> dict:
    """LLM(...) kwargs from the engine flags; P1 gets its prompt in one step unless told otherwise."""
    from jvllm.cli import engine_kwargs

    ekw = {k: v for k, v in engine_kwargs(a).items() if v is not None}
    ekw["use_tqdm_on_load"] = bool(getattr(a, "progress", False))
    if name in ("prefill", "all"):
        plen = a.prefill_len if name == "all" else a.input_len
        if a.max_model_len is not None and a.max_model_len <= plen:
            raise SystemExit(f"P1 prefill of {plen} tokens needs --max-model-len > {plen} (got {a.max_model_len})")
        if a.max_num_batched_tokens is None:
            ekw["max_num_batched_tokens"] = plen
    return ekw


def _resolved(llm) -> dict:
    e = llm.llm_engine
    return dict(dtype=str(e.dtype.__name__ if hasattr(e.dtype, "__name__") else e.dtype),
                max_model_len=e.sched_config.max_model_len, max_num_batched_tokens=e.sched_config.max_num_batched_tokens,
                max_num_seqs=e.sched_config.max_num_seqs, token_buckets=list(e.runner.token_buckets),
                num_blocks=e.runner.num_blocks, block_size=e.runner.block_size,
                vocab_size=e.model_config.vocab_size, **facts.param_stats(llm))


def run_benchmark(name: str, a) -> dict:
    """Run one of throughput / latency / prefill / all from parsed CLI args; returns the JSON dict.
    With `all`, a workload that fails leaves its error in `errors` and the others' figures stand."""
    from jvllm.bench.env import device_info, versions

    sampling = Sampling(temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, min_p=a.min_p)
    ekw = _engine_kwargs(name, a)
    workloads = tuple(w.name for w in WORKLOADS) if name == "all" else (name,)
    result = dict(benchmark=name, timestamp=time.strftime("%Y-%m-%dT%H:%M:%S%z"), versions=versions(),
                  config=dict(model=a.model, engine=ekw, sampling=dataclasses.asdict(sampling),
                              argv=sys.argv[1:]))
    if a.cold_start:  # before this process touches the accelerator
        result["cold_start"] = coldstart.run_cold_start(a.model, ekw)
    from jvllm.memory.device import claim_device_memory

    claim_device_memory(ekw.get("gpu_memory_utilization", 0.9))  # before the ceilings initialize the backend
    t_backend = time.perf_counter()
    result["device"] = device_info()
    result["device"]["backend_init_s"] = time.perf_counter() - t_backend
    ceil = ceilings.measure("latency" in workloads, "prefill" in workloads, a.copy_bytes, a.matmul_n, a.dtype)
    if ceil:
        result["ceilings"] = ceil
    t0 = time.perf_counter()
    llm, st = run.build_llm(a.model, ekw)
    vocab = llm.llm_engine.model_config.vocab_size
    st["first_token_s"] = run.first_token(llm, vocab, t0, sampling=sampling)  # the background warm-up may still run
    st["first_token_after_construct_s"] = st["first_token_s"] - st["construct_s"]
    run.settle(llm, st)
    st["other_init_s"] = st["init_s"] - st["load_s"] - st["warmup_compile_s"]  # sizing, KV alloc, probes
    result["startup"] = st
    result["config"]["resolved"] = _resolved(llm)
    every = name == "all"
    jobs = dict(
        throughput=lambda: run.run_throughput(llm, a.num_prompts, a.w1_input_len if every else a.input_len,
                                              a.output_len, a.warmup_requests, sampling),
        latency=lambda: run.run_latency(llm, a.b1_input_len if every else a.input_len,
                                        a.b1_output_len if every else a.output_len, a.num_iters, a.num_iters_warmup,
                                        ceil.get("copy_bandwidth_Bps"), sampling),
        prefill=lambda: run.run_prefill(llm, a.prefill_len if every else a.input_len, a.num_iters,
                                        a.num_iters_warmup, ceil.get("matmul_flops_per_s"), sampling))
    res, errors = {}, {}
    try:
        for key in workloads:
            try:
                res[key] = jobs[key]()
            except Exception as e:  # keep the other workloads' figures; the error goes into the JSON
                if not every:
                    raise
                import traceback

                errors[key] = "".join(traceback.format_exception_only(type(e), e)).strip()[-2000:]
                print(f"bench {key} failed: {errors[key]}", file=sys.stderr)
        result["engine_stats"] = llm.get_stats()
        result["compiles_after_warmup"] = result["engine_stats"]["compiles_after_warmup"]
        result["memory"] = memory.memory_report(llm)
        result["results"] = res if every else res[name]
        if errors:
            result["errors"] = errors
        if not a.no_xla_report:
            result["xla_programs"] = facts.xla_report(llm)
    finally:
        llm.shutdown()
    return result


def cmd_bench(a):
    name = a.bench_cmd
    result = run_benchmark(name, a)
    import jax

    if jax.process_index() != 0:  # multi-process run: every process ran the same steps; process 0 reports
        print(f"process {jax.process_index()}: done (process 0 writes the JSON)")
        return
    path = a.output_json or report.default_json_path(name, a.model)
    report.write_json(path, result)
    for line in report.summary_lines(result):
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
    p.add_argument("--min-p", type=float, default=0.0)
    p.set_defaults(func=cmd_bench)


def register(subparsers):
    b = subparsers.add_parser("bench", help="benchmarks: W1 throughput, B1 latency, P1 prefill (BENCHMARKS.md)")
    sub = b.add_subparsers(dest="bench_cmd", required=True)
    for w in WORKLOADS:
        _add_common(sub.add_parser(w.name, help=w.help), input_len_default=w.input_len, output_len_default=w.output_len,
                    input_len_type=parse_len_range if isinstance(w.input_len, tuple) else int)
    al = sub.add_parser("all", help="W1 + B1 + P1 on one engine (one compile)")
    _add_common(al, input_len_default=None, output_len_default=256)
    al.add_argument("--w1-input-len", type=parse_len_range, default=W1_INPUT_LEN)
    al.add_argument("--b1-input-len", type=int, default=512)
    al.add_argument("--b1-output-len", type=int, default=256)
    al.add_argument("--prefill-len", type=int, default=2048)
    return b


def main(argv=None):
    """`python -m jvllm.bench ...`: the `jvllm bench` subcommands, plus the cold-start child."""
    ap = argparse.ArgumentParser(prog="python -m jvllm.bench", add_help=False)
    ap.add_argument("--cold-child", default=None, help=argparse.SUPPRESS)
    known, rest = ap.parse_known_args(argv)
    if known.cold_child is not None:
        coldstart.cold_child(known.cold_child)
        return
    from jvllm.cli import main as cli_main

    cli_main(["bench", *rest])
