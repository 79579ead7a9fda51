#!/usr/bin/env bash
# Issue 24's GPU figures (speculative decoding) on random:llama3-8b bf16, one H200. STAGES (default
# "b1 w1"; split over two calls when 600 s cannot hold both: STAGES=b1, then STAGES=w1):
#   b1   benchmarks/spec_b1.py: the target's own greedy continuations generated first (plain engine),
#        the B1 prompt with the highest host-simulated n-gram acceptance chosen, then B1 plain vs
#        n-gram k=4 (prompt_lookup 2..4) vs the draft = target upper bound, engine by engine in
#        this one call -> spec_b1.json (speedup_vs_plain, acceptance, simulated_acceptance,
#        output_identical_to_plain)
#   w1   `jvllm bench throughput` plain, with n-gram k=4 always on, and with n-gram k=4 and
#        disable_by_batch_size=DBS (default 32: above it steps stay on the async path)
#        -> w1_plain.json, w1_ngram.json, w1_ngram_dbs.json (output_tok_s, spec_acceptance_rate)
# Env: K (4), DBS (32), N (W1 requests, 256), END_S (590: every stage's limit ends by then).
set -u
source "$(dirname "$0")/device_env.sh"  # OUT, el, install, wheels, cache dir
END_S=${END_S:-590}
K=${K:-4}
DBS=${DBS:-32}
left() { local l=$(( END_S - $(el) )); [ "$1" -lt "$l" ] && l=$1; echo $l; }  # min(stage limit, time left)
MODEL=(--model random:llama3-8b --dtype bfloat16 --max-model-len 4096)
NGRAM="{\"method\": \"ngram\", \"num_speculative_tokens\": $K, \"prompt_lookup_max\": 4, \"prompt_lookup_min\": 2}"
NGRAM_DBS="{\"method\": \"ngram\", \"num_speculative_tokens\": $K, \"prompt_lookup_max\": 4, \"prompt_lookup_min\": 2, \"disable_by_batch_size\": $DBS}"

w1() {  # name, extra args...
  local name=$1; shift
  timeout $(left 200) python -m jvllm.cli bench throughput "${MODEL[@]}" --num-prompts ${N:-256} --no-xla-report \
    --output-json "$OUT/$name.json" "$@" > "$OUT/$name.log" 2>&1
  echo "[$(el)s] $name rc=$?"; grep -E "tok/s|acceptance|WARNING|Error" "$OUT/$name.log" | tail -4
}

for stage in ${STAGES:-b1 w1}; do
  [ $(( END_S - $(el) )) -lt 20 ] && { echo "[$(el)s] no time left for $stage"; continue; }
  echo "[$(el)s] $stage"
  case $stage in
    b1) timeout $(left 560) python benchmarks/spec_b1.py "${MODEL[@]}" --k $K --draft \
          --output-json "$OUT/spec_b1.json" > "$OUT/spec_b1.log" 2>&1
        echo "[$(el)s] b1 rc=$?"; grep -vE "^\s*$|Warning" "$OUT/spec_b1.log" | tail -8 ;;
    w1) w1 w1_plain
        w1 w1_ngram --speculative-config "$NGRAM"
        w1 w1_ngram_dbs --speculative-config "$NGRAM_DBS" ;;
    *) echo "unknown stage $stage" ;;
  esac
done
echo "done after $(el)s"
