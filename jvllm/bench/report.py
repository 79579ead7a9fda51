"""A bench result as a file and as lines: the JSON path and writer, the printed summary."""
from __future__ import annotations

import json
import os


def default_json_path(name: str, model: str) -> str:
    """$JVLLM_BENCH_DIR, else $OUT, else ./bench_results/, as bench_<workload>_<model>.json."""
    d = os.environ.get("JVLLM_BENCH_DIR") or os.environ.get("OUT") or os.path.join(os.getcwd(), "bench_results")
    tag = model.replace("random:", "random-").replace("/", "_").replace(":", "-")
    return os.path.join(d, f"bench_{name}_{tag}.json")


def write_json(path: str, data: dict):
    """Write `data` as indented JSON (values JSON cannot hold as their str), creating the folder."""
    os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=1, default=str)


def _parts(v: dict) -> str:
    return ", ".join(f"{k.removeprefix('host_').removesuffix('_ms_per_step')} {x:.2f}" for k, x in v.items()
                     if k.startswith("host_") and k.endswith("_ms_per_step") and k != "host_ms_per_step")


def _startup_line(st: dict) -> str:
    parts = ", ".join(f"{k.removesuffix('_s')} {v:.1f}s" for k, v in (st.get("init_parts") or {}).items())
    bg = f" (+{st['warmup_background_s']:.1f}s in the background)" if st.get("warmup_background_s") else ""
    return (f"  startup: load {st['load_s']:.1f}s, compile {st['warmup_compile_s']:.1f}s{bg}, "
            f"first token {st['first_token_s']:.1f}s after construction start" + (f" (other: {parts})" if parts else ""))


def _workload_line(k: str, v: dict) -> str | None:
    if k == "throughput":
        return (f"  W1: {v['output_tok_s']:.1f} output tok/s, {v['total_tok_s']:.1f} total tok/s, "
                f"{v['num_requests']} req in {v['elapsed_s']:.2f}s, preemptions {v['num_preemptions']}, "
                f"compiles_after_warmup {v['compiles_after_warmup']}, {v['num_steps']} steps of "
                f"{v['mean_step_ms']:.1f} ms, host {v['host_ms_per_step']:.2f} ms/step ({v['host_share']:.0%}: {_parts(v)})"
                + (f", until every first token {v['prefill_phase_s']:.2f}s, then {v['decode_phase_s']:.2f}s of decodes"
                   if v.get("prefill_phase_s") is not None else ""))
    if k == "latency":
        mbu = f", MBU {v['mbu']:.1%}" if "mbu" in v else ""
        return (f"  B1: {v['tok_s']:.1f} tok/s, {v['step_ms']:.2f} ms/step, TTFT {v['ttft_s'] * 1e3:.1f} ms{mbu}, "
                f"host {v['host_ms_per_step']:.2f} ms/step ({v['host_share']:.0%}: {_parts(v.get('host_parts', {}))})")
    if k == "prefill":
        mfu = f", MFU {v['mfu']:.1%}" if "mfu" in v else ""
        return f"  P1: {v['tok_s']:.1f} tok/s ({v['input_len']} tokens in {v['prefill_s'] * 1e3:.1f} ms){mfu}"
    return None


def _memory_line(mem: dict) -> str:
    return (f"  memory: peak {mem['peak_bytes_in_use'] / 2**30:.1f} GiB of {mem['bytes_limit'] / 2**30:.1f} GiB "
            f"(weights {mem['weight_bytes'] / 2**30:.1f} GiB, KV pool {mem['kv_pool_bytes_global'] / 2**30:.1f} GiB "
            f"= {mem.get('kv_tokens')} tokens of {mem.get('kv_cache_dtype')}, "
            f"all devices together); per device peak: "
            + ", ".join(f"{d['peak_bytes_in_use'] / 2**30:.1f}" for d in mem.get("per_device", [])
                        if d.get("peak_bytes_in_use")) + " GiB")


def summary_lines(result: dict) -> list[str]:
    """The printed summary of one bench result: device, start-up, one line per workload, memory,
    cold start, ceilings."""
    r = result.get("results", {})
    items = r.items() if result["benchmark"] == "all" else [(result["benchmark"], r)]
    dev = result.get("device", {})
    lines = [(f"jvllm bench {result['benchmark']}: {result['config']['model']} on {dev.get('device_kind')} "
              f"x{dev.get('count')} ({dev.get('platform')})")]
    if result.get("startup"):
        lines.append(_startup_line(result["startup"]))
    lines += [line for k, v in items if (line := _workload_line(k, v)) is not None]
    mem = result.get("memory") or {}
    if mem.get("peak_bytes_in_use"):
        lines.append(_memory_line(mem))
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
