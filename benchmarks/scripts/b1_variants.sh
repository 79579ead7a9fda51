#!/usr/bin/env bash
# B1 (`jvllm bench latency`, buckets 16,512) for several variants in one call on one H200, each
# with its own compile cache; optionally CUPTI profiles of the B1 decode step and the optimized
# HLO of the B1 decode program.
# Two builds in one call: a variant with BUILD=before runs the tree in $BEFORE (default .before: a
# folder holding `git archive` of the old commit, carried with the call), installed into its own
# --target folder and run from /tmp (so this tree is not imported); other variants run this tree.
# E.g. VARIANTS="g4_before=random:gemma3-4b,BUILD=before g4=random:gemma3-4b 8b_before=random:llama3-8b,BUILD=before 8b=random:llama3-8b"
# VARIANTS: space-separated NAME=MODEL[,KEY=VALUE...] (environment settings of that run, e.g.
# 8b=random:llama3-8b or 8b_nocb=random:llama3-8b,XLA_FLAGS=--xla_gpu_enable_command_buffer=).
# PROFILE: the same form, profiled with benchmarks/profile_steps.py. HLO: one MODEL whose B1
# programs' optimized HLO is dumped ($OUT/hlo_b1.tgz). Writes $OUT/b1_variants.json (each run's
# JSON under its name) and $OUT/profile_<NAME>.json. Env: JVLLM_GIT_COMMIT, PER_RUN_S (110),
# MAX_LEN (4096).
set -u
source "$(dirname "$0")/device_env.sh"
VARIANTS=${VARIANTS-"8b=random:llama3-8b"}
parse() {  # NAME=MODEL[,K=V...] -> $name $model $envs
  name=${1%%=*}; local rest=${1#*=}; model=${rest%%,*}; envs=""
  [ "$rest" != "$model" ] && envs=$(echo "${rest#*,}" | tr ',' ' ')
}
common="--dtype bfloat16 --max-model-len ${MAX_LEN:-4096} --token-buckets 16,512"
BEFORE_SITE=/tmp/b1_site_before
case " $VARIANTS " in *BUILD=before*)
  rm -rf $BEFORE_SITE  # a warm machine keeps /tmp: the previous call's .before must not stand in
  python -m pip install -q --no-deps --no-build-isolation --no-compile --target $BEFORE_SITE \
    "$(realpath ${BEFORE:-.before})" > "$OUT/pip_before.log" 2>&1 || { echo "pip failed for ${BEFORE:-.before}"; exit 1; } ;;
esac
for v in $VARIANTS; do
  parse "$v"
  left=$(( 575 - $(el) )); lim=${PER_RUN_S:-110}; [ $left -lt $lim ] && lim=$left
  [ $lim -lt 40 ] && { echo "no time left for $name"; continue; }
  echo "[$(el)s] $name model=$model env=$envs" | tee -a "$OUT/b1_variants.log"
  dir=$PWD; pp=${PYTHONPATH:-}
  case " $envs " in *" BUILD=before "*) dir=/tmp; pp=$BEFORE_SITE${PYTHONPATH:+:$PYTHONPATH} ;; esac
  (cd $dir && env $envs PYTHONPATH=$pp JVLLM_CACHE_DIR=/tmp/cache_$name timeout -s ABRT $lim python -X faulthandler -u \
    -m jvllm.cli bench latency --model $model $common --no-xla-report --output-json "/tmp/b1_$name.json" \
    >> "$OUT/b1_variants.log" 2>&1)
  echo "rc=$?" | tee -a "$OUT/b1_variants.log"; grep "B1:" "$OUT/b1_variants.log" | tail -1
done
for v in ${PROFILE:-}; do
  parse "$v"
  left=$(( 585 - $(el) )); [ $left -lt 60 ] && { echo "no time left for profile $name"; continue; }
  echo "[$(el)s] profile $name env=$envs" | tee -a "$OUT/b1_variants.log"
  env $envs JVLLM_CACHE_DIR=/tmp/cache_$name timeout -s ABRT $left python benchmarks/profile_steps.py --workload b1 \
    --model $model $common --steps 20 --out "$OUT/profile_$name.json" >> "$OUT/b1_variants.log" 2>&1
  echo "rc=$?" | tee -a "$OUT/b1_variants.log"
done
if [ -n "${HLO:-}" ]; then
  left=$(( 590 - $(el) ))
  echo "[$(el)s] hlo $HLO" | tee -a "$OUT/b1_variants.log"
  XLA_FLAGS="--xla_dump_to=/tmp/hlo --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*step.*" \
    JVLLM_CACHE_DIR=/tmp/cache_hlo timeout -s ABRT $left python -m jvllm.cli bench latency --model $HLO $common \
    --no-xla-report --output-json /tmp/b1_hlo.json >> "$OUT/b1_variants.log" 2>&1
  echo "rc=$?" | tee -a "$OUT/b1_variants.log"
  (cd /tmp/hlo && ls | grep -E "after_optimizations.txt$" | head -8 | tar czf "$OUT/hlo_b1.tgz" -T -)
fi
python - "$OUT" $VARIANTS <<'PY'
import json, os, sys
out, res = sys.argv[1], {}
for v in sys.argv[2:]:
    name = v.split("=")[0]
    p = f"/tmp/b1_{name}.json"
    if os.path.isfile(p):
        res[name] = json.load(open(p))
        res[name]["variant"] = v
        it = res[name]["results"]["iterations"]
        print(name, [round(i["decode_tok_s"], 1) for i in it], [round(i["host_step_call_ms_per_step"], 3) for i in it])
json.dump(res, open(os.path.join(out, "b1_variants.json"), "w"), indent=1)
PY
echo "[total $(el)s]"
