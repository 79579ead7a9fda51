"""`jvllm bench`: the offline workloads of BENCHMARKS.md (W1 throughput, B1 latency, P1 prefill).

    workloads.py   what W1 / B1 / P1 are (prompts, sampling, CLI defaults), no device
    env.py         versions, commit, devices
    ceilings.py    copy bandwidth and matmul rate, measured in the same run
    facts.py       parameter bytes, KV bytes per token, the XLA report of every program
    run.py         build the engine, first token, then each workload on it
    coldstart.py   `--cold-start`: child processes with an empty, then a warm cache
    memory.py      the memory table
    report.py      the JSON file and the printed summary
    cli.py         the parser (`register`) and one run from its flags (`run_benchmark`)

The names below are what scripts under benchmarks/ import. Monkeypatch a function in the module
that defines it (e.g. `jvllm.bench.run.build_llm`): callers look it up there.
"""
from jvllm.bench.ceilings import measure_copy_bandwidth, measure_matmul_rate
from jvllm.bench.cli import main, register, run_benchmark
from jvllm.bench.env import device_info, git_commit, versions
from jvllm.bench.facts import kv_bytes_per_token, param_stats, xla_report
from jvllm.bench.memory import memory_report
from jvllm.bench.report import summary_lines, write_json
from jvllm.bench.run import build_llm, first_token, host_share, run_latency, run_prefill, run_throughput, settle
from jvllm.bench.workloads import (GREEDY, W1_INPUT_LEN, WORKLOADS, Sampling, Workload, cap_input_len, one_prompt,
                                   parse_len_range, sampling_params, w1_prompts)

__all__ = ["GREEDY", "W1_INPUT_LEN", "WORKLOADS", "Sampling", "Workload", "build_llm", "cap_input_len", "device_info",
           "first_token", "git_commit", "host_share", "kv_bytes_per_token", "main", "measure_copy_bandwidth",
           "measure_matmul_rate", "memory_report", "one_prompt", "param_stats", "parse_len_range", "register",
           "run_benchmark", "run_latency", "run_prefill", "run_throughput", "sampling_params", "settle",
           "summary_lines", "versions", "w1_prompts", "write_json"]
