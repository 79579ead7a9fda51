"""What each result JSON records about itself: device, versions, commit, and its headline figures.

    python benchmarks/index.py [FILE.json ...]      # default: every JSON under benchmarks/results/

Prints one row per JSON: file | device | versions | commit | headline figures. It is the raw
material of benchmarks/results/INDEX.md (one line per figure the READMEs cite), which a person
writes and checks; `tests/test_bench_scripts.py` checks that INDEX.md's device, versions and commit
columns agree with what `describe` reads from each JSON.

The JSONs come from several harnesses over time, so their shapes differ: `jvllm bench` (versions,
device, results per workload), `profile_steps.py`, `serve_bench.py`, the probes, the kernel
benchmarks, and summaries that hold several bench JSONs under one key each. A commit the JSON does
not record (or records as `HEAD`) is taken from the file name's 7-hex-digit suffix and marked
`(name)`; one recorded nowhere is `?`. Likewise a device the JSON does not name is read from the
file name's `h200_` / `h100_` / `h200x2_` prefix and marked `(name)`; versions it does not record are `?`.
"""
from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import re
import sys

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
WORKLOADS = ("throughput", "latency", "prefill")


@dataclasses.dataclass(frozen=True)
class Described:
    """What one result JSON says about where and with what it was measured."""
    file: str
    device: str      # e.g. "1x NVIDIA H200", "2x NVIDIA H200", "cpu (2 cores)", "?"
    versions: str    # e.g. "jax 0.11.2", "jax 0.10.2, torch 2.13.0+cpu", "?"
    commit: str      # 7 hex digits (+ the run's note of uncommitted changes, e.g. "a78ae13+agree_min"),
                     # "abc1234 (name)" when only the file name carries it, or "?"
    figures: tuple[str, ...]


def _bench_like(d: dict) -> dict | None:
    """The first `jvllm bench`-shaped JSON in d (d itself, or one value of a summary)."""
    if "versions" in d and (isinstance(d.get("results"), dict) or "device_tracks" in d):
        return d
    for v in d.values():
        if isinstance(v, dict) and "versions" in v and isinstance(v.get("results"), dict):
            return v
    return None


def _device(d: dict, b: dict | None, name: str) -> str:
    src = b if b is not None else d
    dev = src.get("device")
    if isinstance(dev, dict) and dev.get("device_kind"):
        kind = dev["device_kind"]
        if dev.get("platform") == "cpu":
            return f"cpu ({dev.get('host_cpus', '?')} cores)"
        return f"{dev.get('count', '?')}x {kind}"
    if isinstance(dev, str):
        return f"1x {dev}" if dev.startswith("NVIDIA") else dev
    if isinstance(dev, list) and dev:
        return f"{len(dev)}x {dev[0]}"
    server = (src.get("versions") or {}).get("server") if isinstance(src.get("versions"), dict) else None
    if server and server.get("devices"):
        return f"{len(server['devices'])}x {server['devices'][0]}"
    if src.get("backend") == "cpu":
        return f"cpu ({src.get('cpus', '?')} cores)"
    if "device_tracks" in src:  # a profile: the device names only; the kind from the file name
        gpus = {k.split(" | ")[0] for k in src["device_tracks"] if "GPU" in k}
        if gpus and name.startswith(("h200", "h100")):
            return f"{len(gpus)}x NVIDIA {name[:4].upper()} (name)"
    if name.startswith("h200x2_"):
        return "nvidia-h200-x2 (name)"
    if name.startswith(("h200_", "h100_")):
        return f"NVIDIA {name[:4].upper()} (name)"
    return "?"


def _versions(d: dict, b: dict | None) -> str:
    v = (b if b is not None else d).get("versions")
    if isinstance(v, dict):
        jax = v.get("jax") or (v.get("server") or {}).get("jax")
        parts = [f"jax {jax}"] if jax else []
        if v.get("transformers") and str(v.get("torch", "")).endswith("+cpu"):
            parts.append(f"torch {v['torch']}, transformers {v['transformers']}")
        return ", ".join(parts) or "?"
    if d.get("jax"):
        return f"jax {d['jax']}"
    if d.get("torch"):
        return f"torch {d['torch']}, transformers {d.get('transformers', '?')}"
    return "?"


def _commit(d: dict, b: dict | None, name: str) -> str:
    v = (b if b is not None else d).get("versions")
    git = v.get("jvllm_git") if isinstance(v, dict) else None
    m = re.fullmatch(r"([0-9a-f]{7,40})(\+.*)?", str(git.get("commit"))) if isinstance(git, dict) else None
    if m:  # "+suffix": the run had uncommitted changes on top of that commit (kept: it matters)
        return m.group(1)[:7] + (m.group(2) or "")
    m = re.search(r"_([0-9a-f]{7})(?:\.p\d+)?\.json$", name)
    return f"{m.group(1)} (name)" if m else "?"


def _figures(d: dict) -> tuple[str, ...]:
    b = _bench_like(d)
    out = []
    if b is not None and "results" in b:
        r = b["results"]
        if b.get("benchmark") in WORKLOADS:
            r = {b["benchmark"]: r}
        if "throughput" in r:
            out.append(f"W1 {r['throughput']['output_tok_s']:,.1f} out tok/s")
        if "latency" in r:
            mbu = r["latency"].get("mbu")
            out.append(f"B1 {r['latency']['tok_s']:.1f} tok/s" + (f" MBU {mbu:.1%}" if mbu else ""))
        if "prefill" in r:
            mfu = r["prefill"].get("mfu")
            out.append(f"P1 {r['prefill']['tok_s']:,.0f} tok/s" + (f" MFU {mfu:.1%}" if mfu else ""))
        ft = (b.get("startup") or {}).get("first_token_s")
        if ft:
            out.append(f"first token {ft:.1f} s")
        if b is not d:
            out.append(f"keys {sorted(d)}")
    elif b is not None and "device_tracks" in b:
        busy = [t["busy_ms_per_step"] for k, t in b["device_tracks"].items() if "GPU" in k and t["busy_ms_per_step"] > 0.1]
        out.append(f"{b.get('workload')} wall {b.get('wall_ms_per_step', 0):.2f} ms/step, device busy "
                   + ", ".join(f"{x:.2f}" for x in busy) + " ms/step")
    elif "server_startup" in d:
        for row in d.get("results", []):
            out.append(f"S1 rate {row['request_rate']}: TTFT p50/p99 {row['ttft_ms_p50']:.0f}/{row['ttft_ms_p99']:.0f} ms, "
                       f"TPOT {row['tpot_ms_p50']:.1f}/{row['tpot_ms_p99']:.1f} ms, {row['request_throughput']:.1f} req/s")
    elif d.get("tool") == "ncu":  # probes/ncu_summary.py: per kernel name, its mean time and DRAM rate
        for label, rows in d["runs"].items():
            by = {}
            for k in rows if isinstance(rows, list) else []:
                by.setdefault(k["kernel"], []).append(k)
            for name, ks in by.items():
                t = sum(k.get("time_us", 0) for k in ks) / len(ks)
                bw = sum(k.get("dram_GBps", 0) for k in ks) / len(ks)
                out.append(f"{label} {name} x{len(ks)}: {t:.1f} us, DRAM {bw:,.0f} GB/s")
    elif d.get("benchmark") == "cpu_vs_hf":
        out.append(f"jvllm {d['jvllm']['out_tok_s']:.0f} vs HF {d['hf']['out_tok_s']:.0f} out tok/s ({d['ratio']:.2f}x)")
    else:
        out.append(f"keys {sorted(d)[:8]}")
    return tuple(out)


def describe(path: str) -> Described:
    """Read one result JSON; raises ValueError naming the file when it is not a JSON object."""
    name = os.path.basename(path)
    with open(path) as f:
        d = json.load(f)
    if not isinstance(d, dict):
        raise ValueError(f"{name}: expected a JSON object, got {type(d).__name__}")
    b = _bench_like(d)
    return Described(name, _device(d, b, name), _versions(d, b), _commit(d, b, name), _figures(d))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="*", help="result JSONs (default: every JSON under benchmarks/results/)")
    a = ap.parse_args(argv)
    for p in a.files or sorted(glob.glob(os.path.join(RESULTS, "*.json"))):
        x = describe(p)
        print(" | ".join([x.file, x.device, x.versions, x.commit, "; ".join(x.figures)]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
