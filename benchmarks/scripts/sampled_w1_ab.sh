#!/usr/bin/env bash
# Issue 25 item 1 in one device call: (1) probes/sampler_speed.py, this tree's sampler against
# BEFORE's jvllm/sampling.py on logits already on the device (PROBE_ARGS at R=256, then at R=8),
# (2) W1 (256 seqs, buckets 256,2048, a fixed 50 GB KV pool) sampled at temperature 0.8 + top_p 0.95
# on both builds and greedy on this one, through ab_builds.sh, REPS rounds (the first on empty
# compile caches, later ones warm), a round started only while END (default 430) seconds have not
# passed. Files (one $OUT/$TAG.tgz: the device returns at most 8 files): sampler_speed{,_r8}.json,
# {before,after}_w1_top_p[_repN].json,
# after_w1_greedy[_repN].json (+ logs). BEFORE (default .before) is a `git archive` of the old commit
# carried with the call; BEFORE_COMMIT / AFTER_COMMIT name the builds in the JSONs.
set -u
source "$(dirname "$0")/device_env.sh"  # OUT, el, the server wheels, the compile cache
S=$(dirname "$0")
OLD=${BEFORE:-.before}/jvllm/sampling.py
PROBE_ARGS=${PROBE_ARGS:-"--reps 7 --impls gpu_r0,gpu_r2 --cases greedy,top_p,top_k,min_p,top_k_top_p"}
probe() {  # probe <suffix> <args...>
  local sfx=$1; shift
  JVLLM_GIT_COMMIT=${AFTER_COMMIT:-unknown} PYTHONPATH=$PWD timeout 200 python benchmarks/probes/sampler_speed.py "$@" --old-file "$OLD" \
    --out "$OUT/sampler_speed$sfx.json" > "$OUT/sampler_speed$sfx.log" 2>&1
  echo "[$(el)s] probe$sfx rc=$?"; grep -E '^\{"case"' "$OUT/sampler_speed$sfx.log" | cut -c1-400
}
probe "" --R 256 $PROBE_ARGS
probe _r8 --R 8 --reps 7 --impls gpu_r0 --cases greedy,top_p,top_k
KV="--kv-cache-memory-bytes 50000000000"
for i in $(seq 1 ${REPS:-2}); do
  [ $(el) -gt ${END:-430} ] && { echo "no time for round $i"; break; }
  sfx=""; [ "$i" -gt 1 ] && sfx="_rep$((i - 1))"
  LIMIT=${LIMIT:-200} STAGES=w1 TAG=_top_p$sfx W1ARGS="$KV --temperature 0.8 --top-p 0.95" bash "$S/ab_builds.sh"
  LIMIT=${LIMIT:-200} STAGES=w1 ORDER=after TAG=_greedy$sfx W1ARGS="$KV" bash "$S/ab_builds.sh"
done
echo "[total $(el)s]"
cd "$OUT" && tar czf /tmp/call.tgz --exclude='pip*.log' * && rm -rf "${OUT:?}"/* && mv /tmp/call.tgz "$OUT/${TAG:-sampled_w1_ab}.tgz"; ls -la "$OUT"
