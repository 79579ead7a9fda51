#!/usr/bin/env bash
# Nsight Compute (hardware counters) on the kernels that hold the open targets back, each run by
# its probe: what limits them (DRAM GB/s against the part's, speed-of-light shares, occupancy and
# its limiter, warp stall reasons). One JSON (benchmarks/probes/ncu_summary.py) -> $OUT/ncu_kernels$TAG.json.
#   STAGES (default "moe walk fp8"):
#     moe   the Qwen3-30B-A3B expert FFN's grouped matmuls (jvllm_grouped_matmul_*) at 256 tokens
#           (W1's decode steps: 2,048 rows, about 16 an expert) and 2,048 (a prefill chunk)
#     walk  batch-invariant mode's fixed-tile walk launch at 2,048 rows (W1's prefill chunks) for
#           the 8B's q/k/v, o, gate/up, down and LM head, next to XLA's own GEMM kernels of the same products
#     fp8   the "pallas" fp8 backend's decode matmul (jvllm_matmul_nk_*) at one token, gate/up and
#           down of the 8B, next to XLA's bf16 and fp8 dots
# ncu runs with --clock-control none (the device README: leave the clocks alone) and kernel replay.
# Env: NCU (default: ncu on PATH, else the newest /opt/nvidia/nsight-compute/*/ncu), STAGE_LIMIT (s, 150),
# WALK_ARGS (more probe arguments for the walk stage, e.g. a --sweep of tile configurations: give each
# configuration its own bm x bn, since the kernel name carries those and not the warps or stages) and
# WALK_LAUNCHES (the walk stage's --launch-count, 60), TREE (a folder holding another build's jvllm, e.g. a carried `git archive` in .before: the probes
# import it instead of this tree's) and TAG (suffix of every output name, e.g. _before).
set -u
source "$(dirname "$0")/device_env.sh"  # OUT, el, jvllm installed from this copy
NCU=${NCU:-$(command -v ncu || ls -d /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | tail -1)}
[ -n "$NCU" ] || { echo "no ncu on this machine"; exit 1; }
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # kernel replay saves and restores what a kernel writes
# XLA's GEMM autotuner times candidates with a delay kernel that timed out under ncu, and two of
# three probes then died (segfault): under ncu XLA takes its default GEMMs, untuned
export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0"
SECTIONS="--section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats --section WarpStateStats"
TAG=${TAG:-}
[ -n "${TREE:-}" ] && export PYTHONPATH="$(realpath "$TREE")${PYTHONPATH:+:$PYTHONPATH}"
labels=()
prof() {  # prof <label> <kernel regex> <launch count> <probe args...>
  local label=$1 rx=$2 n=$3; shift 3
  echo "[$(el)s] ncu $label"
  timeout ${STAGE_LIMIT:-150} "$NCU" --clock-control none --target-processes all -k "regex:$rx" --launch-count "$n" \
    $SECTIONS --csv --page raw python "$@" > "$OUT/ncu_$label$TAG.csv" 2> "$OUT/ncu_$label$TAG.log"
  echo "rc=$? $(grep -c '^"' "$OUT/ncu_$label$TAG.csv") csv lines"; tail -2 "$OUT/ncu_$label$TAG.log" | cut -c1-200
  labels+=("$label=$OUT/ncu_$label$TAG.csv")
}
for stage in ${STAGES:-moe walk fp8}; do
  case $stage in
    moe) prof moe "jvllm_grouped_matmul" 18 benchmarks/probes/moe_grouped_matmul.py --tokens 256,2048 --backends pallas --iters 2 \
           --out "$OUT/moe_gmm_ncu_probe$TAG.json" ;;
    walk) prof walk "jvllm_fixed_tile|nvjet|xmma|gemm|cutlass" ${WALK_LAUNCHES:-60} benchmarks/probes/fixed_tile_probe.py --ms 2048 --time-ms 2048 --iters 1 \
            ${WALK_ARGS:-} --out "$OUT/fixed_tile_ncu_probe$TAG.json" ;;
    fp8) prof fp8 "jvllm_matmul_nk|gemv|nvjet|xmma|gemm|cutlass" 30 benchmarks/probes/fp8_decode_probe.py --tokens 1 --layers 4 \
           --iters 2 --shapes gate_up,down --cands nk:0:16:128:256:0:4:3:cvt16 --out "$OUT/fp8_ncu_probe$TAG.json" ;;
  esac
done
python benchmarks/probes/ncu_summary.py "$OUT/ncu_kernels$TAG.json" --device "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" \
  "${labels[@]}" | cut -c1-400
echo "[total $(el)s]"
