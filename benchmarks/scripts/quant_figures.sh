#!/usr/bin/env bash
# Quantized-weight figures on one H200 (issue 21 items 1-2): is jvllm's fp8 projection an fp8
# cuBLASLt GEMM in the optimized HLO, and B1 / W1 / P1 with bf16 vs fp8 vs int8 weights on
# random:llama3-8b, side by side, with each run's memory table (weights, KV blocks, peak).
# STAGES (default "probe bf16 fp8") run in order; one `bench all` on the 8B takes a few minutes,
# so put the rest (e.g. STAGES="int8 memory") in a second call (the memory stage reads whichever
# quant_all_*.json files $OUT holds, so run it in the call that has them, or with all three).
#   probe   benchmarks/probes/fp8_gemm_hlo.py: gate_proj (4096 -> 14336) at T = 8, 256, 2048 in
#           bf16 / fp8 (W8A8, jvllm's) / fp8 weight-only / int8: f8 GEMM custom call?, ms, GB/s,
#           TFLOP/s -> fp8_gemm_hlo.json
#   bf16 | fp8 | int8
#           `jvllm bench all` (W1, B1, P1, XLA report, memory) on random:llama3-8b, bfloat16
#           activations, --quantization as named (bf16: none) -> quant_all_<name>.json
#   memory  one table from the quant_all_*.json in $OUT: weight bytes, KV blocks and pool bytes,
#           peak / in use / limit per device, and the B1 / W1 / P1 figures -> quant_memory.json
# P1's MFU in the JSON is against the bench's bf16 matmul probe; for fp8 compare P1 tok/s with
# the probe's fp8 TFLOP/s at T=2048 as well.
# Env: BACKEND (attention backend, default auto), END_S (590: every stage's limit ends by then).
set -u
source "$(dirname "$0")/device_env.sh"  # OUT, el, install, wheels, cache dir
BACKEND=${BACKEND:-auto}
END_S=${END_S:-590}
left() { local l=$(( END_S - $(el) )); [ "$1" -lt "$l" ] && l=$1; echo $l; }  # min(stage limit, time left)
MODEL="--model random:llama3-8b --dtype bfloat16 --max-model-len 4096 --attention-backend $BACKEND"

memory() {
  python - "$OUT" > "$OUT/quant_memory.log" 2>&1 <<'PY'
import glob, json, os, sys
out = sys.argv[1]
rows = {}
for p in sorted(glob.glob(os.path.join(out, "quant_all_*.json"))):
    d = json.load(open(p))
    m, r = d.get("memory") or {}, d.get("results") or {}
    rows[os.path.basename(p)[len("quant_all_"):-5]] = dict(
        weight_gib=(m.get("weight_bytes") or 0) / 2**30, kv_blocks=m.get("kv_blocks"),
        kv_pool_gib=(m.get("kv_pool_bytes_global") or 0) / 2**30,
        peak_gib=(m.get("peak_bytes_in_use") or 0) / 2**30, limit_gib=(m.get("bytes_limit") or 0) / 2**30,
        b1_tok_s=(r.get("latency") or {}).get("tok_s"), w1_out_tok_s=(r.get("throughput") or {}).get("output_tok_s"),
        p1_tok_s=(r.get("prefill") or {}).get("tok_s"), p1_mfu_vs_bf16_probe=(r.get("prefill") or {}).get("mfu"))
json.dump(rows, open(os.path.join(out, "quant_memory.json"), "w"), indent=1)
for k, v in rows.items():
    print(k, " ".join(f"{a}={b:.2f}" if isinstance(b, float) else f"{a}={b}" for a, b in v.items()))
PY
}

run_stage() {
  local stage=$1
  [ $(( END_S - $(el) )) -lt 20 ] && { echo "[$(el)s] no time left for $stage"; return; }
  echo "[$(el)s] $stage"
  case $stage in
    probe) timeout $(left 200) python benchmarks/probes/fp8_gemm_hlo.py --out "$OUT/fp8_gemm_hlo.json" \
             > "$OUT/fp8_gemm_hlo.log" 2>&1; echo "rc=$?"; tail -12 "$OUT/fp8_gemm_hlo.log" ;;
    bf16|fp8|int8)
      Q=""; [ "$stage" != bf16 ] && Q="--quantization $stage"
      timeout $(left 330) python -m jvllm.cli bench all $MODEL $Q --output-json "$OUT/quant_all_$stage.json" \
        > "$OUT/quant_all_$stage.log" 2>&1
      echo "rc=$?"; tail -9 "$OUT/quant_all_$stage.log" ;;
    memory) memory; echo "rc=$?"; cat "$OUT/quant_memory.log" ;;
    *) echo "unknown stage $stage" ;;
  esac
}

for s in ${STAGES:-probe bf16 fp8}; do run_stage "$s"; done
