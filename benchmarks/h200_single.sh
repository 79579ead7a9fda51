#!/usr/bin/env bash
# Single-GPU figures on one nvidia-h200, in sequence (one device call each when a call's 600 s
# cannot hold them all). STAGES (default "bench hf"): any of
#   bench   `jvllm bench all` (W1, B1, P1, XLA report) on random:llama3-8b bf16 -> jvllm_all.json
#   hf      the HF transformers peer (benchmarks/peers/hf_baseline.py) -> hf_baseline.json
#   s1      S1 (benchmarks/serve_bench.py against `jvllm serve`) -> s1.json (+ PNG)
#   kernels benchmarks/gpu_kernels.py -> gpu_kernels.json
#   warm    `jvllm bench latency` twice on one compile cache: the second start is the warm-cache
#           start-up figure (jvllm's executable cache + JAX's) -> warm_1.json, warm_2.json
#   sampled W1 and B1 through the general sampler (temperature 0.8, top_p 0.95) -> sampled.json
#   profile benchmarks/profile_steps.py: B1 and W1 decode steps under the JAX profiler (CUPTI),
#           per-kernel and per-host-function time -> profile_b1.json, profile_w1.json
#   split   B1 with --attention-backend ragged_split (split-K decode) -> split.json
#   sweep   benchmarks/gpu_decode_sweep.py (decode kernel page size x launch) -> gpu_decode_sweep.json
# Env: JVLLM_GIT_COMMIT (the copy has no .git), BACKEND (attention backend, default auto),
# S1_RATES (2,4,8,16,inf), S1_N (64).
set -u
source "$(dirname "$0")/device_env.sh"  # OUT, el, install, wheels, cache dir
BACKEND=${BACKEND:-auto}
for stage in ${STAGES:-bench hf}; do
  echo "[$(el)s] $stage"
  case $stage in
    bench) timeout 330 python -m jvllm.cli bench all --model random:llama3-8b --dtype bfloat16 --max-model-len 4096 \
             --attention-backend $BACKEND --output-json "$OUT/jvllm_all.json" > "$OUT/jvllm_all.log" 2>&1
           echo "rc=$?"; tail -9 "$OUT/jvllm_all.log" ;;
    hf) NREQ=256 OUTN=256 timeout $(( 590 - $(el) )) python benchmarks/peers/hf_baseline.py > "$OUT/hf_baseline.log" 2>&1
        echo "rc=$?"; tail -1 "$OUT/hf_baseline.log" ;;
    s1) timeout $(( 590 - $(el) )) python benchmarks/serve_bench.py random:llama3-8b --num-prompts ${S1_N:-64} \
          --request-rates ${S1_RATES:-2,4,8,16,inf} \
          --serve-args="--max-model-len 4096 --dtype bfloat16 --attention-backend $BACKEND" \
          --output-json "$OUT/s1.json" > "$OUT/s1.log" 2>&1
        echo "rc=$?"; tail -9 "$OUT/s1.log" ;;
    warm) for i in 1 2; do
            timeout 300 python -m jvllm.cli bench latency --model random:llama3-8b --dtype bfloat16 --max-model-len 4096 \
              --attention-backend $BACKEND --no-xla-report --output-json "$OUT/warm_$i.json" > "$OUT/warm_$i.log" 2>&1
            echo "rc=$?"; grep -E "startup|B1:" "$OUT/warm_$i.log"
          done ;;
    sampled) timeout 330 python -m jvllm.cli bench all --model random:llama3-8b --dtype bfloat16 --max-model-len 4096 \
               --attention-backend $BACKEND --no-xla-report --temperature 0.8 --top-p 0.95 \
               --output-json "$OUT/sampled.json" > "$OUT/sampled.log" 2>&1
             echo "rc=$?"; grep -E "W1:|B1:" "$OUT/sampled.log" ;;
    profile) for w in b1 w1; do
               timeout 240 python benchmarks/profile_steps.py --workload $w --model random:llama3-8b --dtype bfloat16 \
                 --max-model-len 4096 --token-buckets 16,64,128,256,1024,2048 --attention-backend $BACKEND --steps 20 \
                 --out "$OUT/profile_$w.json" > "$OUT/profile_$w.log" 2>&1
               echo "rc=$?"; grep -v "^[WI]0" "$OUT/profile_$w.log" | head -40
             done ;;
    split) timeout 240 python -m jvllm.cli bench latency --model random:llama3-8b --dtype bfloat16 --max-model-len 4096 \
             --token-buckets 16,512 --attention-backend ragged_split --no-xla-report --output-json "$OUT/split.json" \
             > "$OUT/split.log" 2>&1
           echo "rc=$?"; grep -E "B1:" "$OUT/split.log" ;;
    sweep) timeout 150 python benchmarks/gpu_decode_sweep.py --out "$OUT/gpu_decode_sweep.json" > "$OUT/sweep.log" 2>&1
           echo "rc=$?"; tail -1 "$OUT/sweep.log" ;;
    kernels) timeout 200 python benchmarks/gpu_kernels.py --out "$OUT/gpu_kernels.json" > "$OUT/gpu_kernels.log" 2>&1
             echo "rc=$?"; tail -2 "$OUT/gpu_kernels.log" ;;
  esac
done
echo "[total $(el)s]"
