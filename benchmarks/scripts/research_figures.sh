#!/usr/bin/env bash
# Issue 23's figures on one H200, by stage (STAGES, default "update invariant"):
#   update     LLM.update_weights of a random Llama-3-8B (bfloat16) from device arrays in the engine's
#              sharding (target <= 50 ms) and from host numpy (GB/s), with the compile count across the
#              calls; sleep / wake_up seconds and freed bytes (levels 1 and 2, with the device's
#              bytes_in_use) -> $OUT/research.json, $OUT/research.log
#   invariant  W1 and B1 (`jvllm bench all`, one engine each) of the default engine against
#              --batch-invariant (target: <= 15% slower) -> $OUT/invariant_default.json,
#              $OUT/invariant_on.json (+ .log); both with XLA_FLAGS=--xla_gpu_exclude_nondeterministic_ops=true
#              so that the two differ only in jvllm's mode. INV_MNBT sets --max-num-batched-tokens of
#              both (default: the engine's); batch-invariant steps all run that one bucket, so B1 pays
#              for it.
# One device call holds about 590 s: run the stages in separate calls (STAGES=update, then
# STAGES=invariant) unless the compile cache is warm. Env: MODEL (random:llama3-8b), REPEATS (3).
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
    invariant) mnbt=${INV_MNBT:+--max-num-batched-tokens $INV_MNBT}
               for mode in default on; do
                 flag=""; [ "$mode" = on ] && flag=--batch-invariant
                 XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_exclude_nondeterministic_ops=true" \
                   timeout $(left 290) python -m jvllm.cli bench all --model "$MODEL" --dtype bfloat16 --max-model-len 4096 \
                   $mnbt $flag --no-xla-report --output-json "$OUT/invariant_$mode.json" > "$OUT/invariant_$mode.log" 2>&1
                 echo "rc=$? ($mode)"; grep -E "W1:|B1:" "$OUT/invariant_$mode.log"
               done ;;
    *) echo "unknown stage $stage (update | invariant)"; exit 2 ;;
  esac
done
