#!/usr/bin/env bash
# Single-GPU figures in one device call (several calls when 600 s cannot hold them all). STAGES
# (default "bench hf") run in order; on a 2-GPU machine (nvidia-h200-x2) GPU1_STAGES run at the
# same time on GPU 1 while STAGES run on GPU 0 (e.g. STAGES="smoke bench s1" GPU1_STAGES="kernels hf":
# jvllm's W1 and the HF peer in one call, S1's server start reusing the bench's compile cache); a
# stage may be in only one of the two lists (its outputs have fixed names in $OUT).
#   smoke   compile the ragged kernel on a tiny batch and check it against the XLA reference; on
#           failure the later stages of that GPU fall back to BACKEND=pallas_decode -> smoke.log
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
#   sweep   benchmarks/probes/gpu_decode_sweep.py (decode kernel page size x launch) -> gpu_decode_sweep.json
# Env: JVLLM_GIT_COMMIT (the copy has no .git), BACKEND (attention backend, default auto),
# S1_RATES (2,4,8,16,inf), S1_N (64), END_S (590: every stage's limit ends by then).
set -u
source "$(dirname "$0")/device_env.sh"  # OUT, el, install, wheels, cache dir
BACKEND=${BACKEND:-auto}
END_S=${END_S:-590}
left() { local l=$(( END_S - $(el) )); [ "$1" -lt "$l" ] && l=$1; echo $l; }  # min(stage limit, time left)

smoke() {
  python - > "$OUT/smoke.log" 2>&1 <<'PY'
import jax, jax.numpy as jnp
from jvllm.ops.attention import example_metadata, paged_attention
from jvllm.ops.pallas_attention import ragged_paged_attention
md = jax.tree_util.tree_map(jnp.asarray, example_metadata([(0, 40), (70, 1)], T=64, R=8, query_tile=16, block_size=16, table_width=16, num_blocks=32))
k = jax.random.split(jax.random.key(0), 3)
q = jax.random.normal(k[0], (64, 32, 128), jnp.bfloat16)
kp = jax.random.normal(k[1], (8, 32, 16, 128), jnp.bfloat16); vp = jax.random.normal(k[2], (8, 32, 16, 128), jnp.bfloat16)
a = jax.jit(lambda *x: ragged_paged_attention(*x, scale=0.088))(q, kp, vp, md)
b = paged_attention(q, kp, vp, md, scale=0.088)
err = float(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))[:41].max()); print("smoke err", err); assert err < 0.05
PY
}

run_stage() {  # one stage on the GPUs in CUDA_VISIBLE_DEVICES (all when unset)
  local stage=$1
  [ $(( END_S - $(el) )) -lt 20 ] && { echo "[${GPU_TAG:-}$(el)s] no time left for $stage"; return; }
  echo "[${GPU_TAG:-}$(el)s] $stage"
  case $stage in
    smoke) smoke || BACKEND=pallas_decode; echo "backend=$BACKEND"; grep -E "smoke err|Error" "$OUT/smoke.log" | tail -2 ;;
    bench) timeout $(left 330) python -m jvllm.cli bench all --model random:llama3-8b --dtype bfloat16 --max-model-len 4096 \
             --attention-backend $BACKEND --output-json "$OUT/jvllm_all.json" > "$OUT/jvllm_all.log" 2>&1
           echo "rc=$?"; tail -9 "$OUT/jvllm_all.log" ;;
    hf) NREQ=256 OUTN=256 timeout $(left 590) python benchmarks/peers/hf_baseline.py > "$OUT/hf_baseline.log" 2>&1
        echo "rc=$?"; tail -1 "$OUT/hf_baseline.log" ;;
    s1) timeout $(left 590) python benchmarks/serve_bench.py random:llama3-8b --num-prompts ${S1_N:-64} \
          --request-rates ${S1_RATES:-2,4,8,16,inf} \
          --serve-args="--max-model-len 4096 --dtype bfloat16 --attention-backend $BACKEND" \
          --output-json "$OUT/s1.json" > "$OUT/s1.log" 2>&1
        echo "rc=$?"; tail -9 "$OUT/s1.log" ;;
    warm) for i in 1 2; do
            timeout $(left 300) python -m jvllm.cli bench latency --model random:llama3-8b --dtype bfloat16 --max-model-len 4096 \
              --attention-backend $BACKEND --no-xla-report --output-json "$OUT/warm_$i.json" > "$OUT/warm_$i.log" 2>&1
            echo "rc=$?"; grep -E "startup|B1:" "$OUT/warm_$i.log"
          done ;;
    sampled) timeout $(left 330) python -m jvllm.cli bench all --model random:llama3-8b --dtype bfloat16 --max-model-len 4096 \
               --attention-backend $BACKEND --no-xla-report --temperature 0.8 --top-p 0.95 \
               --output-json "$OUT/sampled.json" > "$OUT/sampled.log" 2>&1
             echo "rc=$?"; grep -E "W1:|B1:" "$OUT/sampled.log" ;;
    profile) for w in b1 w1; do
               timeout $(left 240) python benchmarks/profile_steps.py --workload $w --model random:llama3-8b --dtype bfloat16 \
                 --max-model-len 4096 --token-buckets 16,64,128,256,1024,2048 --attention-backend $BACKEND --steps 20 \
                 --out "$OUT/profile_$w.json" > "$OUT/profile_$w.log" 2>&1
               echo "rc=$?"; grep -v "^[WI]0" "$OUT/profile_$w.log" | head -40
             done ;;
    split) timeout $(left 240) python -m jvllm.cli bench latency --model random:llama3-8b --dtype bfloat16 --max-model-len 4096 \
             --token-buckets 16,512 --attention-backend ragged_split --no-xla-report --output-json "$OUT/split.json" \
             > "$OUT/split.log" 2>&1
           echo "rc=$?"; grep -E "B1:" "$OUT/split.log" ;;
    sweep) timeout $(left 150) python benchmarks/probes/gpu_decode_sweep.py --out "$OUT/gpu_decode_sweep.json" > "$OUT/sweep.log" 2>&1
           echo "rc=$?"; tail -1 "$OUT/sweep.log" ;;
    kernels) timeout $(left 200) python benchmarks/gpu_kernels.py --out "$OUT/gpu_kernels.json" > "$OUT/gpu_kernels.log" 2>&1
             echo "rc=$?"; tail -2 "$OUT/gpu_kernels.log" ;;
    *) echo "unknown stage $stage (smoke bench hf s1 kernels warm sampled profile split sweep)"; return 2 ;;
  esac
}

if [ -n "${GPU1_STAGES:-}" ]; then
  for s in $GPU1_STAGES; do  # each stage writes fixed file names in $OUT: one GPU each
    [[ " ${STAGES:-bench hf} " == *" $s "* ]] && { echo "stage $s is in both STAGES and GPU1_STAGES"; exit 2; }
  done
  ( export CUDA_VISIBLE_DEVICES=1 GPU_TAG="gpu1 "; for s in $GPU1_STAGES; do run_stage $s; done ) &
  GPU1=$!
  export CUDA_VISIBLE_DEVICES=0 GPU_TAG="gpu0 "
fi
for s in ${STAGES:-bench hf}; do run_stage $s; done
[ -n "${GPU1:-}" ] && wait $GPU1
echo "[total $(el)s]"
