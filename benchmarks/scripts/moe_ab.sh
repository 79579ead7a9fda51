#!/usr/bin/env bash
# A change to the MoE expert FFN, A/B in one device call: a "before" tree (BEFORE, a carried
# `git archive` of the old commit, default .before) against this tree, on
#   probe  probes/moe_grouped_matmul.py (the jitted FFN at 256 and 2,048 tokens), builds alternated
#          over ROUNDS rounds                                      -> gmm_{before,after}_r{1..}.json
#   ncu    ncu_kernels.sh STAGES=moe on each tree (the grouped matmuls' counters) -> ncu_kernels_{before,after}.json
#   w1     ab_builds.sh STAGES=w1 on random:qwen3-30b-a3b (ORDER "after before"), KV pool of
#          KV bytes (default: 12 GB on an H100, 30 GB on anything larger)     -> {after,before}_w1_moe.json
# STAGES (default "probe ncu w1"); BEFORE_COMMIT / AFTER_COMMIT name the builds in the JSONs.
# Logs and ncu's CSVs go into one logs.tgz (the device tool brings back at most 8 files).
set -u
source "$(dirname "$0")/device_env.sh"  # OUT, el, this tree installed
BEFORE=${BEFORE:-.before}
GPU=$(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1); echo "$GPU"
case "$GPU" in *H100*) KV=${KV:-12000000000} ;; *) KV=${KV:-30000000000} ;; esac
for stage in ${STAGES:-probe ncu w1}; do
  case $stage in
    probe) for r in $(seq ${ROUNDS:-2}); do for b in before after; do
             tree=$PWD; [ $b = before ] && tree=$(realpath "$BEFORE")
             echo "[$(el)s] probe $b r$r"
             PYTHONPATH=$tree timeout ${PROBE_LIMIT:-150} python benchmarks/probes/moe_grouped_matmul.py --tokens 256,2048 \
               --backends pallas --iters ${ITERS:-20} --out "$OUT/gmm_${b}_r$r.json" > "$OUT/gmm_${b}_r$r.log" 2>&1
             echo "rc=$?"; grep -E "pallas" "$OUT/gmm_${b}_r$r.log" | cut -c1-200; done; done ;;
    ncu) for b in before after; do
           tree=.; [ $b = before ] && tree=$BEFORE
           TREE=$tree TAG=_$b STAGES=moe bash "$(dirname "$0")/ncu_kernels.sh"; done ;;
    w1) MODEL=random:qwen3-30b-a3b STAGES=w1 ORDER=${ORDER:-after before} TAG=_moe LIMIT=${LIMIT:-240} \
          EXTRA="--kv-cache-memory-bytes $KV" BEFORE=$BEFORE bash "$(dirname "$0")/ab_builds.sh" ;;
  esac
done
(cd "$OUT" && tar czf logs.tgz $(ls *.log *.csv 2>/dev/null) && rm -f *.log *.csv moe_gmm_ncu_probe*.json)
echo "[total $(el)s]"
