#!/usr/bin/env bash
# One nvidia-h200-x2 call: PP=2 figures, an NCCL all-reduce probe (benchmarks/gpu_collectives_probe.py),
# TP=2 figures (synchronous loop by default: TPFLAGS), then, time allowing, TP=2 B1 with async
# scheduling under a short timeout (plain, then without XLA command buffers), each Python stack
# dumped on timeout (faulthandler + SIGABRT). JSON/logs in $OUT. Env: JVLLM_GIT_COMMIT, TPFLAGS.
set -u
source "$(dirname "$0")/device_env.sh"  # OUT, el, install, wheels, cache dir
common="--model random:llama3-8b --dtype bfloat16 --max-model-len 4096 --token-buckets 16,64,128,256,1024,2048 --no-xla-report"
run() {  # name seconds args...
  local name=$1 secs=$2; shift 2
  [ "$secs" -lt 30 ] && { echo "[$(el)s] $name skipped (no time)"; return; }
  echo "[$(el)s] $name (limit ${secs}s)"
  timeout -s ABRT "$secs" python -X faulthandler -u -m jvllm.cli bench "$@" > "$OUT/$name.log" 2>&1
  echo "rc=$?"; grep -E "W1:|B1:|P1:|memory:|startup:" "$OUT/$name.log" | cut -c1-330
  grep -q "Fatal Python error" "$OUT/$name.log" && grep -A14 "most recent call first" "$OUT/$name.log" | cut -c1-160
}
run pp2 220 all $common --pipeline-parallel-size 2 --output-json "$OUT/bench_pp2.json"
echo "[$(el)s] collectives probe"
python benchmarks/gpu_collectives_probe.py --timeout 40 --variants default,p2p_disabled --out "$OUT/collectives.json"
if python -c "import json,sys; d=json.load(open('$OUT/collectives.json')); sys.exit(0 if not d['default'].get('correct') and d['p2p_disabled'].get('correct') else 1)"; then
  echo "default NCCL failed, p2p_disabled worked: NCCL_P2P_DISABLE=1"; export NCCL_P2P_DISABLE=1
fi
run tp2 $(( 480 - $(el) )) all $common --tensor-parallel-size 2 ${TPFLAGS:---no-async-scheduling} --output-json "$OUT/bench_tp2.json"
run tp2_async_b1 $(( 530 - $(el) )) latency $common --tensor-parallel-size 2 --async-scheduling --output-json "$OUT/bench_tp2_async_b1.json"
if ! grep -q "B1:" "$OUT/tp2_async_b1.log" 2>/dev/null; then
  XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer=" run tp2_async_b1_nocmdbuf $(( 585 - $(el) )) latency $common \
    --tensor-parallel-size 2 --async-scheduling --output-json "$OUT/bench_tp2_async_b1_nocmdbuf.json"
fi
echo "[total $(el)s]"
