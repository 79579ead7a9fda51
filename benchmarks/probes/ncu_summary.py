"""Nsight Compute's raw CSV (`ncu --csv --page raw`) of some kernels -> one JSON row per kernel
launch with what decides a kernel's speed: its time, achieved DRAM GB/s (read and write), the
speed-of-light shares (memory, SM), occupancy and what limits it (registers, shared memory),
the launch (grid, block, registers, shared memory) and the top warp stall reasons (cycles per
issued instruction spent in each). Metrics that a section did not collect are left out.

    python benchmarks/probes/ncu_summary.py OUT.json LABEL=ncu_raw.csv [LABEL=...] [--device NAME]

The JSON: {"device", "tool": "ncu", "versions", "runs": {LABEL: [kernel rows]}}. Used by
`benchmarks/scripts/ncu_kernels.sh`; the CSV is ncu's, not parsed anywhere else.
"""
from __future__ import annotations

import argparse
import csv
import json

KEEP = {  # column -> short name
    "gpu__time_duration.sum": "time_us",
    "dram__bytes.sum.per_second": "dram_GBps",
    "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed": "dram_pct",
    "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed": "memory_sol_pct",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed": "sm_sol_pct",
    "lts__t_sector_hit_rate.pct": "l2_hit_pct",
    "sm__warps_active.avg.pct_of_peak_sustained_active": "achieved_occupancy_pct",
    "sm__maximum_warps_per_active_cycle_pct": "theoretical_occupancy_pct",
    "launch__grid_size": "grid",
    "launch__block_size": "block",
    "launch__registers_per_thread": "registers",
    "launch__shared_mem_per_block_dynamic": "smem_dynamic",
    "launch__shared_mem_per_block_static": "smem_static",
    "launch__occupancy_limit_registers": "blocks_per_sm_by_registers",
    "launch__occupancy_limit_shared_mem": "blocks_per_sm_by_smem",
    "launch__occupancy_limit_warps": "blocks_per_sm_by_warps",
    "launch__waves_per_multiprocessor": "waves",
    "smsp__average_warp_latency_per_inst_issued.ratio": "cycles_per_issue",
}
STALL_PREFIX, STALL_SUFFIX = "smsp__average_warps_issue_stalled_", "_per_issue_active.ratio"
# to microseconds and GB/s (ncu 2025 writes "ns" and "byte/s"; older versions "nsecond", ...)
UNIT_SCALE = {"ns": 1e-3, "nsecond": 1e-3, "us": 1, "usecond": 1, "ms": 1e3, "msecond": 1e3,
              "byte/s": 1e-9, "Kbyte/s": 1e-6, "Mbyte/s": 1e-3, "Gbyte/s": 1, "Tbyte/s": 1e3}


def _num(s: str):
    s = s.strip().replace(",", "")
    try:
        return float(s)
    except ValueError:
        return None


def parse(path: str) -> list[dict]:
    """ncu's raw CSV: a header row of metric names, a row of units, then one row per kernel."""
    with open(path, newline="") as f:
        lines = [ln for ln in f if ln.startswith('"')]  # ncu's own log lines ("==PROF==") are not CSV
    rows = list(csv.reader(lines))
    if len(rows) < 2:
        return []
    head, units, out = rows[0], rows[1], []
    for r in rows[2:]:
        rec = dict(zip(head, r))
        unit = dict(zip(head, units))
        k = {"kernel": rec.get("Kernel Name", "")[:120], "id": rec.get("ID")}
        for col, short in KEEP.items():
            v = _num(rec.get(col, ""))
            if v is None:
                continue
            if short in ("time_us", "dram_GBps"):
                v *= UNIT_SCALE.get(unit.get(col, ""), 1)
            k[short] = round(v, 3)
        stalls = {c[len(STALL_PREFIX):-len(STALL_SUFFIX)]: _num(rec[c]) for c in head
                  if c.startswith(STALL_PREFIX) and c.endswith(STALL_SUFFIX) and _num(rec.get(c, "")) is not None
                  and "_not_issued" not in c}
        top = sorted(stalls.items(), key=lambda kv: -kv[1])[:6]
        if top:
            k["top_stalls"] = {name: round(v, 2) for name, v in top}
        out.append(k)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("runs", nargs="+", metavar="LABEL=CSV")
    ap.add_argument("--device")
    a = ap.parse_args(argv)
    if any("=" not in r for r in a.runs):
        ap.error(f"each run is LABEL=CSV, got {a.runs}")
    res = {"device": a.device, "tool": "ncu", "runs": {}}
    try:
        import jax

        res["versions"] = {"jax": jax.__version__}
    except ImportError:
        pass
    for r in a.runs:
        label, path = r.split("=", 1)
        res["runs"][label] = parse(path)
        for k in res["runs"][label]:
            print(label, json.dumps(k), flush=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
