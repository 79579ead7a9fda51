#!/usr/bin/env bash
# Issue 25 item 3, where S1's time per output token goes (one call, one build): S1 through the
# server (serve_bench.py, with the server's per-thread CPU seconds), the same server under a short
# GIL switch interval (SWITCH_INTERVAL, set by a sitecustomize on its PYTHONPATH), and the same
# workload replayed without HTTP (probes/serve_replay.py: the engine alone, MODES=engine,async adds the server's
# AsyncEngine with asyncio consumers). Every stage shares one compile cache, so only the first
# start compiles. STAGES (default "replay server server_args server_si"), RATES, N, MODEL,
# AFTER_COMMIT, SERVE_ARGS (every server's extra flags); server_args runs the server with SERVE_ARGS2
# too (default a 512-token step budget; "--fit-chunks-to-buckets" makes it that option's A/B).
# Writes $OUT/s1_diag.tgz (the JSONs and logs).
set -u
source "$(dirname "$0")/device_env.sh"
MODEL=${MODEL:-random:llama3-8b}; RATES=${RATES:-4,8,16,inf}; N=${N:-64}
SI=${SWITCH_INTERVAL:-0.0005}
export JVLLM_GIT_COMMIT=${AFTER_COMMIT:-unknown}
D=$OUT/s1_diag; mkdir -p "$D"
for st in ${STAGES:-replay server server_args server_si}; do
  lim=$(left ${LIMIT:-300}); [ "$lim" -lt 60 ] && { echo "[$(el)s] no time left for $st"; continue; }
  echo "[$(el)s] $st (limit ${lim}s)"
  case $st in
    server)
      timeout "$lim" python benchmarks/serve_bench.py "$MODEL" --num-prompts "$N" --request-rates "$RATES" \
        --serve-args="--max-model-len 4096 --dtype bfloat16 ${SERVE_ARGS:-}" --output-json "$D/server.json" > "$D/server.log" 2>&1
      echo "rc=$?"; cp "$D/serve_bench_server.log" "$D/server_server.log" 2>/dev/null; grep -E "^(server|rate)" "$D/server.log" ;;
    server_si)
      mkdir -p /tmp/si_site
      printf 'import os, sys\nsys.setswitchinterval(float(os.environ.get("JVLLM_SWITCH_INTERVAL", "0.005")))\n' > /tmp/si_site/sitecustomize.py
      JVLLM_SWITCH_INTERVAL=$SI PYTHONPATH=/tmp/si_site${PYTHONPATH:+:$PYTHONPATH} timeout "$lim" python benchmarks/serve_bench.py \
        "$MODEL" --num-prompts "$N" --request-rates "$RATES" --serve-args="--max-model-len 4096 --dtype bfloat16 ${SERVE_ARGS:-}" \
        --output-json "$D/server_si.json" > "$D/server_si.log" 2>&1
      echo "rc=$?"; grep -E "^(server|rate)" "$D/server_si.log" ;;
    server_args)
      timeout "$lim" python benchmarks/serve_bench.py "$MODEL" --num-prompts "$N" --request-rates "$RATES" \
        --serve-args="--max-model-len 4096 --dtype bfloat16 ${SERVE_ARGS:-} ${SERVE_ARGS2:---max-num-batched-tokens 512}" \
        --output-json "$D/server_args.json" > "$D/server_args.log" 2>&1
      echo "rc=$?"; grep -E "^(server|rate)" "$D/server_args.log" ;;
    replay)
      timeout "$lim" python benchmarks/probes/serve_replay.py "$MODEL" --num-prompts "$N" --request-rates "$RATES" \
        --modes ${MODES:-engine} --cprofile-rate ${CPROFILE_RATE:-8} --output-json "$D/replay.json" > "$D/replay.log" 2>&1
      echo "rc=$?"; grep -E "^(engine|async) " "$D/replay.log" | cut -c1-400 ;;
  esac
done
tar -czf "$OUT/s1_diag.tgz" -C "$OUT" s1_diag && rm -rf "$D"
echo "[total $(el)s]"
