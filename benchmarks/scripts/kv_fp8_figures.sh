#!/usr/bin/env bash
# fp8 KV cache figures on one H200 (issue 21 item 3): W1 (`jvllm bench throughput`) on
# random:llama3-8b bf16 with --kv-cache-dtype auto (bf16 pages) and fp8 (float8_e4m3fn pages with
# per-token scales) in the same call, and from the two bench JSONs the KV capacity (tokens) and the
# W1 decode phase (seconds from every request's first token to the end) side by side.
# STAGES (default "smoke auto fp8 summary") run in order:
#   smoke    the ragged kernel and JAX's decode kernel compiled on fp8 pages against the XLA
#            reference on the same pages -> kv_fp8_smoke.log
#   auto     W1 with bf16 KV -> kv_auto_w1.json
#   fp8      W1 with fp8 KV -> kv_fp8_w1.json
#   summary  kv_tokens, decode_phase_s, output tok/s of both and their ratios -> kv_fp8_summary.json
# Both runs get the same KV byte budget, KV_BYTES (default 40 GiB): sized from free memory instead,
# the fp8 pool would hit the engine's cap of max_num_seqs x max_model_len tokens (256 x 4096) and
# the capacity ratio would show that cap, not the format.
# Env: BACKEND (attention backend, default auto), N (W1 requests, 256), KV_BYTES, END_S (590:
# every stage's limit ends by then).
set -u
source "$(dirname "$0")/device_env.sh"  # OUT, el, install, wheels, cache dir
BACKEND=${BACKEND:-auto}
END_S=${END_S:-590}
left() { local l=$(( END_S - $(el) )); [ "$1" -lt "$l" ] && l=$1; echo $l; }  # min(stage limit, time left)
W1="--model random:llama3-8b --dtype bfloat16 --max-model-len 4096 --attention-backend $BACKEND --num-prompts ${N:-256} --no-xla-report --kv-cache-memory-bytes ${KV_BYTES:-42949672960}"

smoke() {
  python - > "$OUT/kv_fp8_smoke.log" 2>&1 <<'PY'
import jax, jax.numpy as jnp
from jvllm.ops import kv_quant
from jvllm.ops.attention import example_metadata, paged_attention, pallas_decode_attention
from jvllm.ops.pallas_attention import ragged_paged_attention
k = jax.random.split(jax.random.key(0), 3)
pages = [kv_quant.QuantizedPages(*kv_quant.quantize(jax.random.normal(kk, (8, 32, 16, 128), jnp.float32))) for kk in k[1:]]
for spans, qt in (([(0, 40), (70, 1)], 16), ([(0, 1), (70, 1), (300, 1)], 1)):
    md = jax.tree_util.tree_map(jnp.asarray, example_metadata(spans, T=64, R=8, query_tile=qt, block_size=16,
                                                              table_width=32, num_blocks=32))
    q = jax.random.normal(k[0], (64, 32, 128), jnp.bfloat16)
    ref = paged_attention(q, *pages, md, scale=0.088).astype(jnp.float32)
    n = sum(s for _, s in spans)
    a = jax.jit(lambda q, kp, vp, md: ragged_paged_attention(q, kp, vp, md, scale=0.088))(q, *pages, md)
    print("smoke ragged qt", qt, "err", float(jnp.abs(a.astype(jnp.float32) - ref)[:n].max()))
    if qt == 1:
        b = jax.jit(lambda q, kp, vp, md: pallas_decode_attention(q, kp, vp, md, scale=0.088))(q, *pages, md)
        print("smoke pallas_decode err", float(jnp.abs(b.astype(jnp.float32) - ref)[:len(spans)].max()))
PY
}

summary() {
  python - "$OUT" > "$OUT/kv_fp8_summary.log" 2>&1 <<'PY'
import json, os, sys
out = sys.argv[1]
rows = {}
for kv in ("auto", "fp8"):
    path = os.path.join(out, f"kv_{kv}_w1.json")
    if not os.path.exists(path):
        print(f"missing {path}"); continue
    d = json.load(open(path))
    r, m = d["results"], d["memory"]
    rows[kv] = dict(kv_cache_dtype=m.get("kv_cache_dtype"), kv_tokens=m.get("kv_tokens"), kv_blocks=m.get("kv_blocks"),
                    kv_pool_bytes=m.get("kv_pool_bytes_global"), decode_phase_s=r.get("decode_phase_s"),
                    prefill_phase_s=r.get("prefill_phase_s"), output_tok_s=r.get("output_tok_s"),
                    num_preemptions=r.get("num_preemptions"), peak_bytes_in_use=m.get("peak_bytes_in_use"))
if len(rows) == 2:
    a, f = rows["auto"], rows["fp8"]
    rows["fp8_over_auto"] = dict(kv_tokens=f["kv_tokens"] / a["kv_tokens"],
                                 decode_phase_speedup=(a["decode_phase_s"] / f["decode_phase_s"]
                                                       if a["decode_phase_s"] and f["decode_phase_s"] else None),
                                 output_tok_s=f["output_tok_s"] / a["output_tok_s"])
json.dump(rows, open(os.path.join(out, "kv_fp8_summary.json"), "w"), indent=1)
print(json.dumps(rows, indent=1))
PY
}

run_stage() {
  local stage=$1
  [ $(( END_S - $(el) )) -lt 20 ] && { echo "[$(el)s] no time left for $stage"; return; }
  echo "[$(el)s] $stage"
  case $stage in
    smoke) smoke; echo "rc=$?"; grep -E "smoke|Error" "$OUT/kv_fp8_smoke.log" | tail -4 ;;
    auto|fp8) timeout $(left 280) python -m jvllm.cli bench throughput $W1 --kv-cache-dtype $stage \
                --output-json "$OUT/kv_${stage}_w1.json" > "$OUT/kv_${stage}_w1.log" 2>&1
              echo "rc=$?"; tail -4 "$OUT/kv_${stage}_w1.log" ;;
    summary) summary; echo "rc=$?"; tail -30 "$OUT/kv_fp8_summary.log" ;;
    *) echo "unknown stage $stage (smoke auto fp8 summary)"; return 2 ;;
  esac
}

for s in ${STAGES:-smoke auto fp8 summary}; do run_stage $s; done
echo "[total $(el)s]"
