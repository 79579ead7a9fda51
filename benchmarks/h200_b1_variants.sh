#!/usr/bin/env bash
# B1 (`jvllm bench latency`, buckets 16,512) for several (model, KV-write) variants in one call
# on one H200, each with its own compile cache; optionally a CUPTI profile of the B1 decode step.
# VARIANTS: space-separated NAME=MODEL,KV_WRITE (KV_WRITE "xla": two XLA scatters per layer,
# "pallas": jvllm_kv_write, one launch for K and V). PROFILE: NAME=MODEL,KV_WRITE entries to
# profile (benchmarks/profile_steps.py). Writes $OUT/b1_variants.json (each run's JSON under its
# name) and $OUT/profile_<NAME>.json. Env: JVLLM_GIT_COMMIT, PER_RUN_S (default 110).
set -u
source "$(dirname "$0")/device_env.sh"
VARIANTS=${VARIANTS:-"8b=random:llama3-8b,xla 8b_kvp=random:llama3-8b,pallas"}
for v in $VARIANTS; do
  name=${v%%=*}; rest=${v#*=}; model=${rest%,*}; kvw=${rest##*,}
  left=$(( 575 - $(el) )); lim=${PER_RUN_S:-110}; [ $left -lt $lim ] && lim=$left
  [ $lim -lt 40 ] && { echo "no time left for $name"; continue; }
  echo "[$(el)s] $name model=$model kv_write=$kvw" | tee -a "$OUT/b1_variants.log"
  JVLLM_KV_WRITE=$kvw JVLLM_CACHE_DIR=/tmp/cache_$kvw timeout -s ABRT $lim python -X faulthandler -u -m jvllm.cli bench latency \
    --model $model --dtype bfloat16 --max-model-len ${MAX_LEN:-4096} --token-buckets 16,512 --no-xla-report \
    --output-json "/tmp/b1_$name.json" >> "$OUT/b1_variants.log" 2>&1
  echo "rc=$?" | tee -a "$OUT/b1_variants.log"; grep "B1:" "$OUT/b1_variants.log" | tail -1
done
for v in ${PROFILE:-}; do
  name=${v%%=*}; rest=${v#*=}; model=${rest%,*}; kvw=${rest##*,}
  left=$(( 585 - $(el) )); [ $left -lt 60 ] && { echo "no time left for profile $name"; continue; }
  echo "[$(el)s] profile $name" | tee -a "$OUT/b1_variants.log"
  JVLLM_KV_WRITE=$kvw JVLLM_CACHE_DIR=/tmp/cache_$kvw timeout -s ABRT $left python benchmarks/profile_steps.py --workload b1 \
    --model $model --dtype bfloat16 --max-model-len 4096 --token-buckets 16,512 --steps 20 \
    --out "$OUT/profile_$name.json" >> "$OUT/b1_variants.log" 2>&1
  echo "rc=$?" | tee -a "$OUT/b1_variants.log"
done
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
