#!/usr/bin/env bash
# The same GPU workloads on two builds of jvllm in one device call: a "before" tree (BEFORE, a
# folder holding `git archive` of the old commit, carried with the call) and this tree ("after").
# Each build is installed into its own --target folder and runs on its own empty compile cache, so
# neither borrows the other's programs. Builds alternate per stage to spread any drift of the machine.
#   STAGES (default "greedy"): any of
#     greedy   `jvllm bench all` (W1, B1, P1) on random:llama3-8b bf16        -> {before,after}_greedy.json
#     sampled  the same through the general sampler (temperature 0.8, top_p 0.95) -> {before,after}_sampled.json
#     spec     `benchmarks/spec_b1.py` (this tree's script, each build's package): B1 plain against
#              n-gram on the known-acceptance workloads, small step shapes (4 seqs, buckets 8,512),
#              and SPECARGS (e.g. "--workloads oproj,robust --corrupt-every 6") -> {before,after}_spec$TAG.json
#     startup  `jvllm bench latency --cold-start` (process start to first token, empty and warm cache;
#              a short B1 after it), each build in ORDER                      -> {before,after}_startup.json
#     b1       `jvllm bench latency` (B1) with small step shapes (4 seqs, buckets 8,512) and B1ARGS
#              (e.g. "--quantization fp8 --fp8-matmul-backend xla")        -> {before,after}_b1$TAG.json
#     w1       `jvllm bench throughput` (W1) at 256 seqs, buckets 256,2048, and W1ARGS -> {before,after}_w1$TAG.json
#   ORDER (default "before after"), BEFORE (default .before), MODEL (default random:llama3-8b),
#   BEFORE_COMMIT / AFTER_COMMIT: each build's commit for its JSON (the device copy's own git HEAD is
#   the session's base commit, not the tree it carries).
set -u
source "$(dirname "$0")/device_env.sh"  # OUT, el (this tree's editable install is unused: each build runs from its target)
BEFORE=${BEFORE:-.before}; MODEL=${MODEL:-random:llama3-8b}
COMMON="--model $MODEL --dtype ${DTYPE:-bfloat16} --max-model-len ${MAXLEN:-4096} ${EXTRA:-}"
install() {  # install <src> <target>
  python -m pip install -q --no-deps --no-build-isolation --no-compile --target "$2" "$1" > "$OUT/pip_$(basename $2).log" 2>&1 \
    || { echo "pip failed for $1"; tail -5 "$OUT/pip_$(basename $2).log"; exit 1; }
}
# a warm machine keeps /tmp between calls: install the builds in ORDER afresh and empty their
# caches, or a later call would run the previous call's builds under this call's names
for b in ${ORDER:-before after}; do
  rm -rf /tmp/site_$b /tmp/cache_$b
  if [ "$b" = after ]; then install "$PWD" /tmp/site_after; else install "$(realpath $BEFORE)" /tmp/site_before; fi
done
run() {  # run <build> <name> <args...>
  local b=$1 name=$2; shift 2
  echo "[$(el)s] $b $name"
  # from /tmp: `python -m` puts the working directory first on sys.path, which would import this tree
  local commit=${AFTER_COMMIT:-unknown}; [ "$b" = before ] && commit=${BEFORE_COMMIT:-unknown}
  (cd /tmp && JVLLM_GIT_COMMIT=$commit PYTHONPATH=/tmp/site_$b JVLLM_CACHE_DIR=/tmp/cache_$b timeout ${LIMIT:-280} \
    python -m jvllm.cli bench "$@" --output-json "$OUT/${b}_${name}.json" > "$OUT/${b}_${name}.log" 2>&1)
  echo "rc=$?"; grep -E "^ *(W1|B1|P1|startup|cold|memory)" "$OUT/${b}_${name}.log" | cut -c1-220
}
for stage in ${STAGES:-greedy}; do
  case $stage in
    greedy) for b in ${ORDER:-before after}; do run $b greedy all $COMMON --no-xla-report; done ;;
    sampled) for b in ${ORDER:-before after}; do
               run $b sampled all $COMMON --no-xla-report --temperature 0.8 --top-p 0.95; done ;;
    b1) for b in ${ORDER:-before after}; do
          run $b b1${TAG:-} latency $COMMON --no-xla-report --max-num-batched-tokens 512 --max-num-seqs 4 \
            --token-buckets 8,512 ${B1ARGS:-}; done ;;
    w1) for b in ${ORDER:-before after}; do
          run $b w1${TAG:-} throughput $COMMON --no-xla-report --max-num-batched-tokens 2048 --max-num-seqs 256 \
            --token-buckets 256,2048 ${W1ARGS:-}; done ;;
    spec) for b in ${ORDER:-before after}; do
            echo "[$(el)s] $b spec${TAG:-}"
            commit=${AFTER_COMMIT:-unknown}; [ "$b" = before ] && commit=${BEFORE_COMMIT:-unknown}
            (cd /tmp && JVLLM_GIT_COMMIT=$commit PYTHONPATH=/tmp/site_$b JVLLM_CACHE_DIR=/tmp/cache_$b timeout ${LIMIT:-280} \
              python "$OLDPWD/benchmarks/spec_b1.py" --model $MODEL --dtype ${DTYPE:-bfloat16} --max-model-len ${MAXLEN:-4096} \
                --max-num-seqs 4 --max-num-batched-tokens 512 --token-buckets 8,512 ${SPECARGS:-} \
                --output-json "$OUT/${b}_spec${TAG:-}.json" > "$OUT/${b}_spec${TAG:-}.log" 2>&1)
            echo "rc=$?"; grep -E "^\[" "$OUT/${b}_spec${TAG:-}.log" | cut -c1-220; done ;;
    startup) for b in ${ORDER:-before after}; do
               run $b startup latency $COMMON --no-xla-report --cold-start --output-len 16 --num-iters 1 \
                 --num-iters-warmup 0; done ;;
  esac
done
echo "[total $(el)s]"
