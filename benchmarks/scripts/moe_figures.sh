#!/usr/bin/env bash
# Mixture-of-experts figures on one H200 (issue 20 item 5): a Qwen3-30B-A3B-shaped model
# (random:qwen3-30b-a3b, 48 layers, 128 experts, top-8, ~61 GB bf16) W1 / B1 next to the dense 8B,
# the expert FFN per grouped-matmul backend, and the profile's share of grouped matmuls / routing.
# STAGES (default "smoke gmm moe dense") run in order; about 600 s of device time per call, so
# put "share" (and "moe_xla") in a second call. "decode" is not in the default list.
#   smoke    the expert FFN on $MOE_BACKEND (auto = pallas) equal to XLA's at a decode shape -> moe_smoke.log
#   gmm      benchmarks/probes/moe_grouped_matmul.py: one layer's expert FFN, backends xla and
#            pallas, 1..2048 tokens -> moe_gmm.json
#   decode   benchmarks/probes/moe_decode_probe.py: the decode path against the sorted one, 16 chained
#            layers at 1..16 tokens and at the batch-1 step (8 tokens, 1 real), plus $DEC_SWEEP launches -> moe_decode.json
#   moe      `jvllm bench all` (W1, B1, P1) on random:qwen3-30b-a3b bf16, --moe-backend $MOE_BACKEND -> moe_all.json
#   moe_xla  the same with --moe-backend xla (jax.lax.ragged_dot) -> moe_all_xla.json
#   dense    `jvllm bench all` on random:llama3-8b bf16 (the dense figures of the same call) -> dense_all.json
#   gemma3_4b  `jvllm bench latency` (B1 and its bandwidth roofline share) on random:gemma3-4b bf16 -> gemma3_4b_b1.json
#   share    benchmarks/probes/moe_profile_share.py, B1 and W1: device time in grouped matmuls and
#            routing (CUPTI trace attributed through the HLO op names) -> moe_share_b1.json, moe_share_w1.json
#            (B1 at small steps: 4 seqs, buckets 8,512, a fixed KV pool; with the W1 buckets and KV
#            sizing its warm-up outlasted 240 s)
#   prof_b1 / prof_b1_nocb  benchmarks/profile_steps.py B1 at small steps with command buffers on (as
#            the engine runs: device busy per step and the host's events in a step call) / off
#            (per-kernel rows) -> moe_prof_b1_cb.json, moe_prof_b1_nocb.json
#   b1_nocb  `jvllm bench latency` B1 at small steps with command buffers off -> moe_b1_nocb.json
#   decode_tune  the decode probe at the batch-1 step over $DEC_SWEEP launches (moe_decode_tune.json), then
#            B1 at small steps with the engine's launches and with the probe's fastest
#            (probes/moe_decode_launch.py, own compile caches) -> moe_b1_launch_default.json, moe_b1_launch_best.json
# MOE_BACKEND=auto takes jvllm's Pallas kernel on the GPU. tokamax (MOE_BACKEND=tokamax) is not in the
# device image, and 0.0.12's kernels fail on jax 0.11.2; to try it, carry its wheels in .whl/ (device_env.sh installs them), e.g.
#   pip download --no-deps -d .whl tokamax==0.0.12 qwix==0.1.8 einshape==1.0 immutabledict==4.3.1 \
#       typeguard==2.13.3 tensorboardx==2.6.5 pydantic==2.12.5 pydantic-core==2.41.5 annotated-types==0.7.0 \
#       typing-inspection==0.4.2  (the image has jaxtyping and wadler-lindig, not pydantic)
# MOE_BACKEND=xla runs XLA's ragged_dot, which upstream XLA expands densely on CUDA.
# Env: MOE_BACKEND (auto | xla | tokamax | pallas, default auto), BACKEND (attention backend, default auto),
# END_S (590: every stage's limit ends by then), SHARE_WORKLOADS (share's, default "b1 w1"), KV_BYTES (the small steps' KV pool), GMM_SWEEP (the gmm stage's --sweep of Pallas launch configs).
# TINY=1: a CPU dry run of the stages' commands (random:tiny-moe / random:tiny in float32 at toy
# lengths, the probe's --tiny shape; the figures mean nothing, it only shows that every stage runs).
set -u
source "$(dirname "$0")/device_env.sh"  # OUT, el, install, wheels, cache dir
BACKEND=${BACKEND:-auto}
MOE_BACKEND=${MOE_BACKEND:-auto}
END_S=${END_S:-590}
left() { local l=$(( END_S - $(el) )); [ "$1" -lt "$l" ] && l=$1; echo $l; }  # min(stage limit, time left)
MOE="--model random:qwen3-30b-a3b --dtype bfloat16 --max-model-len 4096 --attention-backend $BACKEND"
DENSE="--model random:llama3-8b --dtype bfloat16 --max-model-len 4096 --attention-backend $BACKEND"
SMALL="--max-num-seqs 4 --max-num-batched-tokens 512 --token-buckets 8,512 --kv-cache-memory-bytes ${KV_BYTES:-10000000000}"
NOCB="--xla_gpu_enable_command_buffer="; TOY=""; B1SIZES=""
SIZES=""; GMM=""; DEC="--tokens 1,2,4,8,16"; DEC_B1="--tokens 8 --valid 1"; SHARE="--token-buckets 16,64,128,256,1024,2048 --steps 20"
if [ "${TINY:-0}" = 1 ]; then
  MOE="--model random:tiny-moe --dtype float32 --max-model-len 256 --attention-backend $BACKEND --token-buckets 16,64 --max-num-seqs 8"
  DENSE="--model random:tiny --dtype float32 --max-model-len 256 --attention-backend $BACKEND --token-buckets 16,64 --max-num-seqs 8"
  SIZES="--num-prompts 8 --w1-input-len 8,16 --output-len 8 --b1-input-len 16 --b1-output-len 8 --prefill-len 64
         --num-iters 1 --num-iters-warmup 0 --warmup-requests 1 --copy-bytes 16777216 --matmul-n 256"
  GMM="--tiny --tokens 8,64 --iters 2"
  DEC="--tiny --tokens 1,4 --iters 2"; DEC_B1="--tiny --tokens 4 --valid 1 --iters 2"
  SHARE="--steps 2 --num-prompts 8 --input-len 16 --w1-input-len 8,16"
  SMALL="--max-num-seqs 4 --max-num-batched-tokens 64 --token-buckets 8,64 --kv-cache-memory-bytes 10000000"
  NOCB=""; TOY="--steps 2 --input-len 16"  # XLA:CPU has no command-buffer flag
  B1SIZES="--input-len 16 --output-len 8 --num-iters 1 --num-iters-warmup 0 --copy-bytes 16777216 --matmul-n 256"
fi

smoke() {
  SMOKE_BACKEND=${MOE_BACKEND/auto/pallas} python - > "$OUT/moe_smoke.log" 2>&1 <<'PY'
import os, jax, jax.numpy as jnp, numpy as np
from jvllm.ops.grouped_matmul import moe_ffn, ragged_dot_fn
B = os.environ["SMOKE_BACKEND"]; ragged_dot_fn(B)  # ImportError naming the package when the wheels were not carried
E, k, D, I, T = 128, 8, 2048, 768, 8
key = jax.random.split(jax.random.key(0), 4)
ws = [(jax.random.normal(kk, s) * 0.02).astype(jnp.bfloat16) for kk, s in zip(key, ((E, D, I), (E, D, I), (E, I, D)))]
x = jax.random.normal(key[3], (T, D)).astype(jnp.bfloat16)
idx = jnp.asarray(np.stack([np.random.default_rng(t).choice(E, k, replace=False) for t in range(T)]), jnp.int32)
w = jnp.full((T, k), 1.0 / k, jnp.float32)
a = jax.jit(lambda *z: moe_ffn(*z, backend=B))(x, idx, w, *ws)
b = jax.jit(lambda *z: moe_ffn(*z, backend="xla"))(x, idx, w, *ws)
err = float(jnp.abs(a - b).max()); scale = float(jnp.abs(b).max()); print("smoke", B, "err", err, "scale", scale)
assert err <= 0.02 * scale + 1e-3
PY
}

run_stage() {
  local stage=$1
  [ $(( END_S - $(el) )) -lt 20 ] && { echo "[$(el)s] no time left for $stage"; return; }
  echo "[$(el)s] $stage"
  case $stage in
    smoke) smoke; echo "rc=$?"; grep -E "smoke err|Error" "$OUT/moe_smoke.log" | tail -2 ;;
    gmm) timeout $(left 150) python benchmarks/probes/moe_grouped_matmul.py $GMM ${GMM_SWEEP:+--sweep $GMM_SWEEP} \
           --out "$OUT/moe_gmm.json" > "$OUT/moe_gmm.log" 2>&1
         echo "rc=$?"; grep -E "^T=|Error" "$OUT/moe_gmm.log" | tail -12 ;;
    decode) timeout $(left 120) python benchmarks/probes/moe_decode_probe.py $DEC --out "$OUT/moe_decode.json" \
              > "$OUT/moe_decode.log" 2>&1
            echo "rc=$?"; grep -E "^T=|Error" "$OUT/moe_decode.log" | tail -12
            timeout $(left 120) python benchmarks/probes/moe_decode_probe.py $DEC_B1 ${DEC_SWEEP:+--sweep $DEC_SWEEP} \
              --out "$OUT/moe_decode_b1.json" > "$OUT/moe_decode_b1.log" 2>&1
            echo "rc=$?"; grep -E "^T=|Error" "$OUT/moe_decode_b1.log" | tail -12 ;;
    moe) timeout $(left 330) python -m jvllm.cli bench all $MOE $SIZES --moe-backend $MOE_BACKEND \
           --output-json "$OUT/moe_all.json" > "$OUT/moe_all.log" 2>&1
         echo "rc=$?"; tail -9 "$OUT/moe_all.log" ;;
    moe_xla) timeout $(left 330) python -m jvllm.cli bench all $MOE $SIZES --moe-backend xla --no-xla-report \
               --output-json "$OUT/moe_all_xla.json" > "$OUT/moe_all_xla.log" 2>&1
             echo "rc=$?"; tail -9 "$OUT/moe_all_xla.log" ;;
    dense) timeout $(left 330) python -m jvllm.cli bench all $DENSE $SIZES --no-xla-report --output-json "$OUT/dense_all.json" > "$OUT/dense_all.log" 2>&1
           echo "rc=$?"; tail -9 "$OUT/dense_all.log" ;;
    gemma3_4b) timeout $(left 240) python -m jvllm.cli bench latency --model random:gemma3-4b --dtype bfloat16 \
             --max-model-len 4096 --attention-backend $BACKEND --no-xla-report --output-json "$OUT/gemma3_4b_b1.json" \
             > "$OUT/gemma3_4b_b1.log" 2>&1
           echo "rc=$?"; tail -6 "$OUT/gemma3_4b_b1.log" ;;
    share) for w in ${SHARE_WORKLOADS:-b1 w1}; do
             local sz=$SHARE; [ $w = b1 ] && sz="$SMALL $TOY"
             timeout $(left 240) python benchmarks/probes/moe_profile_share.py --workload $w $MOE --moe-backend $MOE_BACKEND \
               $sz --out "$OUT/moe_share_$w.json" > "$OUT/moe_share_$w.log" 2>&1
             echo "rc=$?"; grep -E "ms/step|Error" "$OUT/moe_share_$w.log" | tail -2
           done ;;
    prof_b1|prof_b1_nocb)
           local f=cb flags=${XLA_FLAGS:-}; [ $stage = prof_b1_nocb ] && { f=nocb; flags=$(echo $flags $NOCB); }
           XLA_FLAGS="$flags" timeout $(left 200) python benchmarks/profile_steps.py --workload b1 $MOE $SMALL \
             --moe-backend $MOE_BACKEND --no-python-trace $TOY \
             --out "$OUT/moe_prof_b1_$f.json" > "$OUT/moe_prof_b1_$f.log" 2>&1
           echo "rc=$?"; grep -E "busy|wall|Error" "$OUT/moe_prof_b1_$f.log" | head -4 ;;
    decode_tune)
           timeout $(left 200) python benchmarks/probes/moe_decode_probe.py $DEC_B1 ${DEC_SWEEP:+--sweep $DEC_SWEEP} \
             --out "$OUT/moe_decode_tune.json" > "$OUT/moe_decode_tune.log" 2>&1
           echo "rc=$?"; grep -E "^T=|Error" "$OUT/moe_decode_tune.log" | tail -16
           local best; best=$(python - "$OUT/moe_decode_tune.json" <<'PY'
import json, sys
rows = [r for r in json.load(open(sys.argv[1]))["rows"] if r["path"].startswith("decode") and "ms_per_layer" in r]
r = min(rows, key=lambda r: r["ms_per_layer"]) if rows else None
print(r["path"].split()[1] if r and " " in r["path"] else "default")
PY
)
           echo "fastest decode launch: $best"
           for tag in default best; do
             local l=$best; [ $tag = default ] && l=default
             [ $tag = best ] && [ $best = default ] && break
             JVLLM_CACHE_DIR=/tmp/cache_launch_$tag timeout $(left 150) python benchmarks/probes/moe_decode_launch.py $l \
               bench latency $MOE $B1SIZES $SMALL --moe-backend $MOE_BACKEND --no-xla-report \
               --output-json "$OUT/moe_b1_launch_$tag.json" > "$OUT/moe_b1_launch_$tag.log" 2>&1
             echo "rc=$? launch $l"; grep -E "^ *B1" "$OUT/moe_b1_launch_$tag.log" | cut -c1-240
           done ;;
    b1_nocb) XLA_FLAGS=$(echo ${XLA_FLAGS:-} $NOCB) timeout $(left 200) python -m jvllm.cli bench latency $MOE $B1SIZES $SMALL \
               --moe-backend $MOE_BACKEND --no-xla-report --output-json "$OUT/moe_b1_nocb.json" > "$OUT/moe_b1_nocb.log" 2>&1
             echo "rc=$?"; grep -E "^ *(B1|startup)" "$OUT/moe_b1_nocb.log" | cut -c1-240 ;;
    *) echo "unknown stage $stage (smoke gmm decode moe moe_xla dense gemma3_4b share prof_b1 prof_b1_nocb b1_nocb decode_tune)"; return 2 ;;
  esac
}

for s in ${STAGES:-smoke gmm moe dense}; do run_stage $s; done
echo "[total $(el)s]"
