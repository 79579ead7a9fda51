#!/usr/bin/env bash
# Issue 23's figures on one H200: LLM.update_weights of a random Llama-3-8B (bfloat16) from device
# arrays in the engine's sharding (target <= 50 ms) and from host numpy (GB/s), with the compile
# count across the calls; sleep / wake_up seconds and freed bytes (levels 1 and 2, with the device's
# bytes_in_use). Writes $OUT/research.json and $OUT/research.log. Env: MODEL (random:llama3-8b),
# REPEATS (3). The batch-invariant mode is not built yet.
set -u
source "$(dirname "$0")/device_env.sh"
left=$(( 590 - $(el) ))
timeout -s ABRT $left python -X faulthandler -u benchmarks/research_figures.py --model "${MODEL:-random:llama3-8b}" \
  --repeats "${REPEATS:-3}" --out "$OUT/research.json" > "$OUT/research.log" 2>&1
echo "rc=$?"; tail -30 "$OUT/research.log"
