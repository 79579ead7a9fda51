#!/usr/bin/env bash
# B1 (batch-1 decode) under several XLA_FLAGS settings, TP=1 and TP=2, one device call on
# nvidia-h200-x2: the command-buffer (CUDA graph) A/B behind issue 6 item 4 and the TP=2 host time.
# Token buckets 16,512 only (B1's 512-token prompt in one step, then batch-1 decodes), so each
# configuration compiles two programs. Writes $OUT/b1_flags.json (every configuration's B1 figures
# and host split) and one log per configuration concatenated into $OUT/b1_flags.log.
set -u
source "$(dirname "$0")/device_env.sh"
CB_ALL="FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,COLLECTIVES"
declare -a NAMES=(tp1_default tp1_nocb tp1_cb tp2_default tp2_cb tp2_cb_min1)
declare -A TPS=([tp1_default]=1 [tp1_nocb]=1 [tp1_cb]=1 [tp2_default]=2 [tp2_cb]=2 [tp2_cb_min1]=2)
declare -A FLAGS=([tp1_default]="" [tp1_nocb]="--xla_gpu_enable_command_buffer=" [tp1_cb]="--xla_gpu_enable_command_buffer=$CB_ALL"
  [tp2_default]="" [tp2_cb]="--xla_gpu_enable_command_buffer=$CB_ALL"
  [tp2_cb_min1]="--xla_gpu_enable_command_buffer=$CB_ALL --xla_gpu_graph_min_graph_size=1")
for name in ${ONLY:-${NAMES[@]}}; do
  tp=${TPS[$name]}; vis=0; [ "$tp" -ge 2 ] && vis=0,1
  left=$(( 570 - $(el) )); lim=${PER_CONFIG_S:-90}; [ $left -lt $lim ] && lim=$left
  [ $lim -lt 30 ] && { echo "no time left for $name"; continue; }
  echo "[$(el)s] $name tp=$tp XLA_FLAGS=${FLAGS[$name]}" | tee -a "$OUT/b1_flags.log"
  XLA_FLAGS="${FLAGS[$name]}" CUDA_VISIBLE_DEVICES=$vis timeout -s ABRT $lim python -X faulthandler -u -m jvllm.cli bench latency \
    --model ${MODEL:-random:llama3-8b} --dtype ${DTYPE:-bfloat16} --max-model-len 4096 --token-buckets 16,512 \
    --no-xla-report --tensor-parallel-size $tp --output-json "/tmp/b1_$name.json" >> "$OUT/b1_flags.log" 2>&1
  echo "rc=$?" | tee -a "$OUT/b1_flags.log"; grep "B1:" "$OUT/b1_flags.log" | tail -1
done
python - "$OUT" ${ONLY:-${NAMES[@]}} <<'PY'
import json, os, sys
out, names = sys.argv[1], sys.argv[2:]
res = {}
for n in names:
    p = f"/tmp/b1_{n}.json"
    if os.path.isfile(p):
        res[n] = json.load(open(p))
json.dump(res, open(os.path.join(out, "b1_flags.json"), "w"), indent=1)
PY
echo "[total $(el)s]"
