#!/usr/bin/env bash
# Issue 23's figures on one H200, by stage (STAGES, default "update invariant"):
#   update     LLM.update_weights of a random Llama-3-8B (bfloat16) from device arrays in the engine's
#              sharding (target <= 50 ms) and from host numpy (GB/s), with the compile count across the
#              calls; sleep / wake_up seconds and freed bytes (levels 1 and 2, with the device's
#              bytes_in_use) -> $OUT/research.json, $OUT/research.log
#   invariant  B1 (`jvllm bench latency` on small steps: --token-buckets 8,512, 4 sequences) and W1
#              (`jvllm bench throughput` at the engine's default config) of the default engine against
#              --batch-invariant (target: <= 15% slower), one process each, in the order B1 default,
#              B1 invariant, W1 default, W1 invariant, all within INV_S seconds (300) of the stage's
#              start -> $OUT/inv_{b1,w1}_{default,on}.json (+ .log). No
#              --xla_gpu_exclude_nondeterministic_ops: it halved the default's B1 too (122 against 220
#              tok/s, INDEX.md Negative results), so it would hide the mode's own cost.
# One device call holds about 590 s: run the stages in separate calls (STAGES=update, then
# STAGES=invariant) unless the compile cache is warm. Env: MODEL (random:llama3-8b), REPEATS (3), INV_S,
# B1_CAP / W1_CAP (75 / 110: one run's limit within INV_S).
set -u
source "$(dirname "$0")/device_env.sh"
left() { local l=$(( 590 - $(el) )); echo $(( l < $1 ? l : $1 )); }
MODEL=${MODEL:-random:llama3-8b}
for stage in ${STAGES:-update invariant}; do
  echo "== $stage (t=$(el)s)"
  case $stage in
    update) timeout -s ABRT $(left 590) python -X faulthandler -u benchmarks/research_figures.py --model "$MODEL" \
              --repeats "${REPEATS:-3}" --out "$OUT/research.json" > "$OUT/research.log" 2>&1
            echo "rc=$?"; tail -30 "$OUT/research.log" ;;
    invariant) inv_end=$(( $(el) + ${INV_S:-300} ))
               for run in b1:default b1:on w1:default w1:on; do
                 wl=${run%%:*}; mode=${run##*:}; flag=""; [ "$mode" = on ] && flag=--batch-invariant
                 if [ "$wl" = b1 ]; then cap=${B1_CAP:-75}; args=(latency --max-num-batched-tokens 512 --max-num-seqs 4 --token-buckets 8,512)
                 else cap=${W1_CAP:-110}; args=(throughput); fi
                 lim=$(( inv_end - $(el) )); [ $lim -gt $cap ] && lim=$cap
                 [ $lim -lt 20 ] && { echo "[$(el)s] no time left for $run"; continue; }
                 timeout $lim python -m jvllm.cli bench "${args[@]}" --model "$MODEL" --dtype bfloat16 --max-model-len 4096 \
                   $flag --no-xla-report --output-json "$OUT/inv_${wl}_$mode.json" > "$OUT/inv_${wl}_$mode.log" 2>&1
                 rc=$?; echo "[$(el)s] $run rc=$rc"; grep -E "startup:|W1:|B1:|Error" "$OUT/inv_${wl}_$mode.log" | tail -3
               done ;;
    *) echo "unknown stage $stage (update | invariant)"; exit 2 ;;
  esac
done
