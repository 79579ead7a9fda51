#!/usr/bin/env bash
# One H200 call: B1 (`jvllm bench latency`, random:llama3-8b bf16, one 512-token prompt, 256 out) for
# this session's features side by side, each config its own process, one compile cache for all:
#   base     greedy bf16                                                                     -> b1_base.json
#   sampled  temperature 0.8, top_p 0.95 (the no-sort sampler)                              -> b1_sampled.json
#   fp8      --quantization fp8 (weight-only fp8; the auto matmul backend: xla)             -> b1_fp8.json
#   fp8_pallas / fp8_xla  --quantization fp8 --fp8-matmul-backend pallas / xla                -> b1_fp8_{pallas,xla}.json
#   fp8mm    benchmarks/probes/fp8_decode_probe.py: the 8B's projections, bf16 / XLA fp8 / Pallas -> fp8_decode_probe.json
#   int8     --quantization int8 (weight-only)                                               -> b1_int8.json
#   spec     benchmarks/spec_b1.py: plain vs n-gram k=4 on the target's own continuation     -> spec_b1.json
#   hlo      benchmarks/probes/fp8_gemm_hlo.py: is the fp8 projection a cuBLASLt f8 GEMM     -> fp8_hlo.json
#   coldstart  base with --cold-start (process start -> first token, empty then warm cache)  -> b1_coldstart.json
# Small step shapes (buckets 8 and 512, 4 sequences) keep the compiles short; B1 uses only those.
# For issue 21's fp8 matmul: STAGES="fp8mm base fp8_pallas fp8_xla" bash benchmarks/scripts/b1_features.sh
# Env: STAGES (default "hlo base fp8 spec sampled coldstart", in priority order), END_S (580), DRAFT=1 adds spec_b1.py's draft = target run.
set -u
source "$(dirname "$0")/device_env.sh"  # OUT, el, install, wheels, cache dir
END_S=${END_S:-580}  # every stage ends by then
left() { local l=$(( END_S - $(el) )); [ "$1" -lt "$l" ] && l=$1; echo $l; }
MODEL=(--model random:llama3-8b --dtype bfloat16 --max-model-len 4096)
SMALL=(--max-num-batched-tokens 512 --max-num-seqs 4 --token-buckets 8,512 --no-xla-report)

b1() {  # name, limit, extra args...
  local name=$1 lim=$2; shift 2
  timeout $(left $lim) python -m jvllm.cli bench latency "${MODEL[@]}" "${SMALL[@]}" --output-json "$OUT/b1_$name.json" "$@" \
    > "$OUT/b1_$name.log" 2>&1
  rc=$?; echo "[$(el)s] $name rc=$rc"; grep -E "startup:|B1:|cold start|memory:|Error" "$OUT/b1_$name.log" | tail -4
}

for stage in ${STAGES:-hlo base fp8 spec sampled coldstart}; do
  [ $(( END_S - $(el) )) -lt 20 ] && { echo "[$(el)s] no time left for $stage"; continue; }
  case $stage in
    base) b1 base 120 ;;
    coldstart) b1 coldstart 200 --cold-start ;;
    sampled) b1 sampled 90 --temperature 0.8 --top-p 0.95 ;;
    fp8) b1 fp8 120 --quantization fp8 ;;
    fp8_pallas) b1 fp8_pallas 120 --quantization fp8 --fp8-matmul-backend pallas ;;
    fp8_xla) b1 fp8_xla 120 --quantization fp8 --fp8-matmul-backend xla ;;
    fp8mm) (cd benchmarks/probes && timeout $(left 250) python fp8_decode_probe.py --out "$OUT/fp8_decode_probe.json") \
             > "$OUT/fp8_decode_probe.log" 2>&1
           rc=$?; echo "[$(el)s] fp8mm rc=$rc"; tail -2 "$OUT/fp8_decode_probe.log" ;;
    int8) b1 int8 120 --quantization int8 ;;
    spec) timeout $(left 200) python benchmarks/spec_b1.py "${MODEL[@]}" --k 4 --iters 2 ${DRAFT:+--draft} \
            --output-json "$OUT/spec_b1.json" > "$OUT/spec_b1.log" 2>&1
          rc=$?; echo "[$(el)s] spec rc=$rc"; grep -vE "^\s*$|Warning" "$OUT/spec_b1.log" | tail -6 ;;
    hlo) timeout $(left 90) python benchmarks/probes/fp8_gemm_hlo.py --out "$OUT/fp8_hlo.json" > "$OUT/fp8_hlo.log" 2>&1
         rc=$?; echo "[$(el)s] hlo rc=$rc"; tail -8 "$OUT/fp8_hlo.log" ;;
    *) echo "unknown stage $stage (hlo base fp8 fp8_pallas fp8_xla fp8mm int8 spec sampled coldstart)" ;;
  esac
done
echo "[total $(el)s]"
