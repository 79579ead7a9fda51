#!/usr/bin/env bash
# Host-side cost of pipeline stages over processes, in one device call on nvidia-h200-x2:
# benchmarks/host_profile.py (cProfile around a W1-like generate) with PP=2, one process per GPU,
# on random:llama3-8b bf16: per-function host time per micro-batch step in both processes
# ($OUT/host_pp2mp.p0.json, .p1.json). Env: NUM_PROMPTS (256), OUTPUT_LEN (128), LIMIT_S (200),
# BUCKETS (as parallel_figures.sh), NOPROF=1 for the engine timers only.
set -u
source "$(dirname "$0")/device_env.sh"
BUCKETS=${BUCKETS:-16,64,128,256,1024,2048}
port=$(( 29500 + RANDOM % 400 ))
for i in 0 1; do
  CUDA_VISIBLE_DEVICES=$i timeout -s ABRT ${LIMIT_S:-200} python -X faulthandler -u benchmarks/host_profile.py \
    --model ${MODEL:-random:llama3-8b} --dtype bfloat16 --max-model-len 4096 --token-buckets "$BUCKETS" \
    --pipeline-parallel-size 2 --num-prompts ${NUM_PROMPTS:-256} --input-len 64,1024 --output-len ${OUTPUT_LEN:-128} \
    ${NOPROF:+--no-cprofile} --out "$OUT/host_pp2mp.json" --coordinator-address 127.0.0.1:$port --num-processes 2 \
    --process-id $i > "$OUT/host_pp2mp.p$i.log" 2>&1 &
done
wait
tail -30 "$OUT/host_pp2mp.p0.log"; tail -4 "$OUT/host_pp2mp.p1.log"
echo "[total $(el)s]"
