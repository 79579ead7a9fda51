#!/usr/bin/env bash
# Issue 24: where a speculating B1 step's time goes on one GPU. profile_steps.py's "copy" workload
# (spec_b1.py's "oproj" weights, a prompt holding its own continuation, every 6th copied token
# changed) at small steps (4 seqs, buckets 8,512), three runs into one tar:
#   plain      no speculation, device timeline (no Python tracer)
#   ngram      n-gram k=4, device timeline (no Python tracer)
#   ngram_py   n-gram k=4 with the Python tracer (host functions; it slows the host, so its wall
#              time is not the step's)
# Env: END (the last run ends by then, default 400), MODEL, DTYPE, C (commit), TAG, STEPS (40).
export PYTHONUNBUFFERED=1 JVLLM_GIT_COMMIT=${C:-unknown}
source "$(dirname "$0")/device_env.sh"
END=${END:-400}
ARGS=(--workload copy --model ${MODEL:-random:llama3-8b} --dtype ${DTYPE:-bfloat16} --max-model-len 4096
      --max-num-batched-tokens 512 --max-num-seqs 4 --token-buckets 8,512)
NGRAM='{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'
prof() {  # name cap extra...
  local name=$1 cap=$2; shift 2
  local l=$(left $cap); [ $l -lt 30 ] && { echo "[$(el)] no time for $name"; return; }
  timeout -s ABRT $l python -X faulthandler benchmarks/profile_steps.py "${ARGS[@]}" --steps ${STEPS:-40} \
    --out $OUT/prof_$name.json "$@" > $OUT/prof_$name.log 2>&1; local rc=$?
  echo "[$(el)] $name rc=$rc"; grep -vE "Warning|^\s*$" $OUT/prof_$name.log | tail -40 | cut -c1-200
}
prof plain 150 --no-python-trace
prof ngram 120 --no-python-trace --speculative-config "$NGRAM"
prof ngram_py 100 --speculative-config "$NGRAM" --steps 20
cd $OUT && tar czf /tmp/call.tgz --exclude='pip*.log' * && rm -rf $OUT/* && mv /tmp/call.tgz $OUT/${TAG:-spec_profile}.tgz; ls -la $OUT; echo "[$(el)] end"
