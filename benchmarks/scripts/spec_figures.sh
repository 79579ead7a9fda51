#!/usr/bin/env bash
# Issue 24's GPU figures (speculative decoding) on random:llama3-8b bf16, one H200, all in ONE device
# call of at most END_S (590) seconds. STAGES (default "b1 w1"):
#   b1   benchmarks/spec_b1.py (one process, engines one at a time: plain, n-gram k, draft = target):
#        known-acceptance workloads (o_proj zeroed; "robust": + down_proj zeroed, permuted head),
#        B1 at the corruption J whose host-simulated acceptance is the smallest >= 0.70 and at
#        the exact copy, and the batch sweep B in SWEEP, plain vs n-gram k (disable_by_batch_size)
#        -> spec_b1.json (workloads.*, ngram.*.headline.speedup_vs_plain, sweep, ...)
#   w1   `jvllm bench throughput` plain, with n-gram k always on, and with disable_by_batch_size=DBS
#        -> w1_plain.json, w1_ngram.json, w1_ngram_dbs.json (output_tok_s, spec_acceptance_rate)
# Env: MODEL (random:llama3-8b), W1_MAX_MODEL_LEN (4096), DTYPE (bfloat16), K (4), DBS (32), N (W1 requests, 256), SWEEP
# (1,2,4,8,16,32), B1_ARGS (extra spec_b1.py args), W1_ARGS (extra bench args), B1_S (b1 limit,
# 330), END_S (590: every stage's limit ends by then). The compile cache (JVLLM_CACHE_DIR) is shared
# by every engine of the call.
set -u
source "$(dirname "$0")/device_env.sh"  # OUT, el, install, wheels, cache dir
END_S=${END_S:-590}
K=${K:-4}
DBS=${DBS:-32}
left() { local l=$(( END_S - $(el) )); [ "$1" -lt "$l" ] && l=$1; echo $l; }  # min(stage limit, time left)
MODEL_ARGS=(--model "${MODEL:-random:llama3-8b}" --dtype "${DTYPE:-bfloat16}")
NGRAM="{\"method\": \"ngram\", \"num_speculative_tokens\": $K, \"prompt_lookup_max\": 4, \"prompt_lookup_min\": 2}"
NGRAM_DBS="{\"method\": \"ngram\", \"num_speculative_tokens\": $K, \"prompt_lookup_max\": 4, \"prompt_lookup_min\": 2, \"disable_by_batch_size\": $DBS}"

w1() {  # name, extra args...
  local name=$1; shift
  local l=$(left ${W1_S:-110})
  [ "$l" -lt 30 ] && { echo "[$(el)s] no time left for $name"; return; }
  timeout $l python -m jvllm.cli bench throughput "${MODEL_ARGS[@]}" --max-model-len ${W1_MAX_MODEL_LEN:-4096} --num-prompts ${N:-256} \
    --no-xla-report ${W1_ARGS:-} --output-json "$OUT/$name.json" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?; echo "[$(el)s] $name rc=$rc"; grep -E "tok/s|acceptance|WARNING|Error" "$OUT/$name.log" | tail -4
}

for stage in ${STAGES:-b1 w1}; do
  [ $(( END_S - $(el) )) -lt 30 ] && { echo "[$(el)s] no time left for $stage"; continue; }
  echo "[$(el)s] $stage"
  case $stage in
    b1) timeout $(left ${B1_S:-330}) python benchmarks/spec_b1.py "${MODEL_ARGS[@]}" --k $K --draft \
          --max-num-seqs 32 --max-num-batched-tokens 512 --sweep ${SWEEP:-1,2,4,8,16,32} ${B1_ARGS:-} \
          --output-json "$OUT/spec_b1.json" > "$OUT/spec_b1.log" 2>&1
        rc=$?; echo "[$(el)s] b1 rc=$rc"; grep -E "^\[|Error" "$OUT/spec_b1.log" | tail -40 ;;
    w1) w1 w1_plain
        w1 w1_ngram --speculative-config "$NGRAM"
        w1 w1_ngram_dbs --speculative-config "$NGRAM_DBS" ;;
    *) echo "unknown stage $stage" ;;
  esac
done
echo "done after $(el)s"
