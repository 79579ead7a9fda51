#!/usr/bin/env bash
# Issues 23 and 24 on one H200 with few programs to warm (about 20 per engine instead of about 110 at
# the default config, so an empty compile cache still fits a device call), by STAGES:
#   b1_default / b1_on   `bench latency` small steps (4 seqs, buckets 8,512), default / --batch-invariant
#   b1_int8 / b1_int8_g32   the same with int8 weights: one scale per channel (the default) / per 32 input rows
#   spec                 spec_b1.py "oproj" workload, plain vs n-gram k=4 at the same small steps (the
#                        plain engine's programs are the b1_default ones: run that first, same call)
#   w1_default / w1_on   `bench throughput` at 256 seqs, buckets 256,2048, default / --batch-invariant
#   w1_top_p             the same W1, temperature 0.8 + top_p 0.95 (issue 25: within 3% of w1_default)
#   w1_ngram / w1_ngram_dbs   the same W1 with n-gram k=4 always on / disable_by_batch_size 32 (issue
#                        24: not slower than w1_default)
#   w1_kv_fp8            the same W1 with --kv-cache-dtype fp8 (issue 21: decode faster than bf16 KV)
#   prof_w1_on / prof_w1_default   profile_steps.py W1 (20 steps once all 256 decode), --batch-invariant /
#                        default, command buffers off (per-kernel rows), a fixed 50 GB KV pool (no
#                        sizing compile: the mode's took 124 s on an empty cache)
#   prof_w1p_on / prof_w1p_default   the same on W1's prefill phase (10 of its first 2,048-token steps:
#                        profile_steps.py --workload w1_prefill)
#   w1_kv_default / w1_on_qt16 / w1_on_qt8 / w1_on_qt4   W1 default / --batch-invariant at query tiles
#                        of 16 (the accelerator default), 8, 4 tokens, all with a fixed 50 GB KV pool
#                        (no sizing compile)
#   ft256                fixed_tile_probe.py at W1's 256-row decode bucket: XLA against the mode's
#                        launches, and a row-tile sweep timed with the auto, walk and split launches
# Env: STAGES (b1_default spec b1_on), END (575: every run ends by then), W1CAP (w1_default's limit, 240), MODEL, DTYPE, MAXLEN, C (the
# commit for the JSONs), TAG (the tar's name), XF (XLA_FLAGS; unset: none. The session-4 figures
# with "detflag" in their names ran with XF=--xla_gpu_exclude_nondeterministic_ops=true, which
# halved B1). Everything under $OUT goes into one $TAG.tgz (the device returns at most 8 files).
export PYTHONUNBUFFERED=1 JVLLM_GIT_COMMIT=${C:-unknown}
source "$(dirname "$0")/device_env.sh"  # OUT, el, install, wheels, cache dir
[ -n "${XF:-}" ] && export XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }$XF"
END=${END:-575}
M=(--model ${MODEL:-random:llama3-8b} --dtype ${DTYPE:-bfloat16})
SMALL=(--max-num-batched-tokens 512 --max-num-seqs 4 --token-buckets 8,512)
WIDE=(--max-num-batched-tokens 2048 --max-num-seqs 256 --token-buckets 256,2048)
NGRAM='{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'
NGRAM_DBS='{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2, "disable_by_batch_size": 32}'
run() {  # name cap cmd...
  local name=$1 cap=$2; shift 2
  local l=$(left $cap); [ $l -lt 30 ] && { echo "[$(el)] no time for $name"; return; }
  timeout -s ABRT $l python -X faulthandler "$@" > $OUT/$name.log 2>&1; local rc=$?
  echo "[$(el)] $name rc=$rc"; grep -E "W1:|B1:|^\[|startup|Error|speedup" $OUT/$name.log | tail -6 | cut -c1-300
}
bench() {  # name cap subcommand SMALL|WIDE extra...: one `jvllm bench` run on the 8B (or MODEL)
  local name=$1 cap=$2 sub=$3 steps=$4; shift 4
  local -n shape=$steps
  run "$name" "$cap" -m jvllm.cli bench "$sub" "${M[@]}" --max-model-len ${MAXLEN:-4096} "${shape[@]}" --no-xla-report \
    --output-json "$OUT/$name.json" "$@"
}
for s in ${STAGES:-b1_default spec b1_on}; do case $s in
  b1_default) bench inv_b1_default 210 latency SMALL ;;
  b1_on) bench inv_b1_on 200 latency SMALL --batch-invariant ;;
  b1_int8) bench b1_int8 200 latency SMALL --quantization int8 ;;
  b1_int8_g32) bench b1_int8_g32 200 latency SMALL --quantization int8 --quantization-group-size 32 ;;
  spec) run spec_b1 200 benchmarks/spec_b1.py "${M[@]}" --max-model-len ${MAXLEN:-4096} "${SMALL[@]}" --k 4 --workloads oproj --iters 2 --output-json $OUT/spec_b1.json ;;
  w1_default) bench inv_w1_default ${W1CAP:-240} throughput WIDE ;;
  w1_on) bench inv_w1_on 420 throughput WIDE --batch-invariant ;;  # its empty-cache warm-up passed 200 s at ed390ac
  w1_top_p) bench w1_top_p 240 throughput WIDE --temperature 0.8 --top-p 0.95 ;;
  w1_ngram) bench w1_ngram 240 throughput WIDE --speculative-config "$NGRAM" ;;
  w1_ngram_dbs) bench w1_ngram_dbs 240 throughput WIDE --speculative-config "$NGRAM_DBS" ;;
  w1_kv_fp8) bench w1_kv_fp8 240 throughput WIDE --kv-cache-dtype fp8 ;;
  prof_w1_on|prof_w1_default|prof_w1p_on|prof_w1p_default)
    XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }--xla_gpu_enable_command_buffer=" run $s 300 benchmarks/profile_steps.py \
      $(case $s in prof_w1p_*) echo --workload w1_prefill --steps 10 ;; *) echo --workload w1 ;; esac) "${M[@]}" --max-model-len ${MAXLEN:-4096} "${WIDE[@]}" --kv-cache-memory-bytes 50000000000 \
      --no-python-trace --out $OUT/$s.json $(case $s in *_on) echo --batch-invariant ;; esac) ;;
  w1_kv_default) bench $s 200 throughput WIDE --kv-cache-memory-bytes 50000000000 ;;
  w1_on_qt16|w1_on_qt8|w1_on_qt4) bench $s 300 throughput WIDE --kv-cache-memory-bytes 50000000000 --batch-invariant \
      --query-tile ${s#w1_on_qt} ;;
  ft256) run ft256 150 benchmarks/probes/fixed_tile_probe.py --ms 1,256 --time-ms 256 \
      --sweep 64x128x4x3,64x128x8x3,64x128x4x4,128x128x8x3 --sweep-groups qkv,o,down --sweep-launch auto,walk,split \
      --out $OUT/ft256.json ;;
  *) echo "unknown stage $s"; exit 2 ;;
esac; done
cd $OUT && tar czf /tmp/call.tgz --exclude='pip*.log' * && rm -rf $OUT/* && mv /tmp/call.tgz $OUT/${TAG:-small_steps}.tgz; ls -la $OUT; echo "[$(el)] end"
