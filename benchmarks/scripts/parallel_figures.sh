#!/usr/bin/env bash
# Sharding figures in one device call on nvidia-h200-x2: `jvllm bench all` (W1, B1, P1)
# on random:llama3-8b bf16 for each configuration in CONFIGS, one after the other, JSON per config
# in $OUT (per-GPU peak memory in its "memory.per_device"), then a table of the speed-ups against
# the first configuration ($OUT/parallel_summary$TAG.json). Env: CONFIGS (default "tp1 tp2 pp2";
# tpN = tensor parallel N, tpNmp = the same with one process per GPU (jax.distributed),
# ppN = pipeline parallel N, ppNmp = pipeline stages one process per GPU, ppNt = ppN with
# --pipeline-stage-threads, ppNp = ppN with --pipeline-handoff ppermute, dpN = data parallel N;
# tp1 runs on GPU 0 alone), BUCKETS (token buckets, default 16,64,128,256,1024,2048: fewer programs
# to compile per configuration; the same for every configuration), PER_CONFIG_S (time limit of each
# configuration, default 190), EXTRA (more bench flags, e.g. --no-async-scheduling), WORKLOAD (bench
# subcommand: all (default), latency, throughput, prefill), TAG (suffix of the output names, for A/B
# runs of one configuration under other env such as NCCL_PROTO or XLA_FLAGS), NCCL_PROBE=1 (first
# run benchmarks/probes/gpu_collectives_probe.py -> $OUT/collectives.json; when the default NCCL
# all-reduce fails and NCCL_P2P_DISABLE=1 works, every configuration runs with NCCL_P2P_DISABLE=1),
# JVLLM_GIT_COMMIT (the copy has no .git); MODEL, DTYPE, MAXLEN for dry runs elsewhere
# (CPU: XLA_FLAGS=--xla_force_host_platform_device_count=2).
set -u
source "$(dirname "$0")/device_env.sh"  # OUT, el, install, wheels, cache dir
BUCKETS=${BUCKETS:-16,64,128,256,1024,2048}  # 128: PP micro-batches of a 256-request W1 step
if [ "${NCCL_PROBE:-0}" = 1 ]; then
  echo "[$(el)s] collectives probe"
  python benchmarks/probes/gpu_collectives_probe.py --timeout 40 --variants default,p2p_disabled --out "$OUT/collectives.json"
  if python -c "import json,sys; d=json.load(open('$OUT/collectives.json')); sys.exit(0 if not d['default'].get('correct') and d['p2p_disabled'].get('correct') else 1)"; then
    echo "default NCCL failed, p2p_disabled worked: NCCL_P2P_DISABLE=1"; export NCCL_P2P_DISABLE=1
  fi
fi
for cfg in ${CONFIGS:-tp1 tp2 pp2}; do
  n=${cfg:2}; n=${n%t}; n=${n%mp}; n=${n%p}
  case $cfg in
    tp*mp) flags="--tensor-parallel-size $n" ;;
    pp*mp) flags="--pipeline-parallel-size $n" ;;
    tp*) flags="--tensor-parallel-size $n" ;;
    pp*t) flags="--pipeline-parallel-size $n --pipeline-stage-threads" ;;
    pp*p) flags="--pipeline-parallel-size $n --pipeline-handoff ppermute" ;;
    pp*) flags="--pipeline-parallel-size $n" ;;
    dp*) flags="--data-parallel-size $n" ;;
    *) echo "unknown config $cfg"; continue ;;
  esac
  vis=0; [ "$n" -ge 2 ] && vis=$(seq -s, 0 $(( n - 1 )))
  [[ $cfg == *mp ]] && vis="one per process"
  echo "[$(el)s] $cfg ($flags, CUDA_VISIBLE_DEVICES=$vis)"
  left=$(( 585 - $(el) )); lim=${PER_CONFIG_S:-190}; [ $left -lt $lim ] && lim=$left
  [ $lim -lt 30 ] && { echo "no time left"; continue; }
  name=$cfg${TAG:-}
  run=(python -X faulthandler -u -m jvllm.cli bench ${WORKLOAD:-all} --model ${MODEL:-random:llama3-8b} --dtype ${DTYPE:-bfloat16}
       --max-model-len ${MAXLEN:-4096} --token-buckets "$BUCKETS" --no-xla-report $flags ${EXTRA:-}
       --output-json "$OUT/bench_$name.json")
  if [[ $cfg == *mp ]]; then  # one process per GPU (jax.distributed on 127.0.0.1), process 0 reports
    port=$(( 29500 + RANDOM % 400 ))
    for i in $(seq 0 $(( n - 1 ))); do
      CUDA_VISIBLE_DEVICES=$i timeout -s ABRT $lim "${run[@]}" --coordinator-address 127.0.0.1:$port \
        --num-processes $n --process-id $i > "$OUT/bench_$name.p$i.log" 2>&1 &
    done
    wait; echo "rc=$?"; mv "$OUT/bench_$name.p0.log" "$OUT/bench_$name.log"; tail -6 "$OUT/bench_$name.log"
    tail -3 "$OUT"/bench_$name.p[1-9]*.log; continue
  fi
  # faulthandler + SIGABRT on timeout: a hang leaves its Python stack in the log
  CUDA_VISIBLE_DEVICES=$vis timeout -s ABRT $lim "${run[@]}" > "$OUT/bench_$name.log" 2>&1
  echo "rc=$?"; tail -6 "$OUT/bench_$name.log"
done
python - "$OUT" $(for c in ${CONFIGS:-tp1 tp2 pp2}; do echo "$c${TAG:-}"; done) <<'PY'
import json, os, sys
out, cfgs = sys.argv[1], sys.argv[2:]
rows = {}
for c in cfgs:
    p = os.path.join(out, f"bench_{c}.json")
    if os.path.isfile(p):
        d = json.load(open(p)); r = d.get("results", {})
        if d.get("benchmark") in ("latency", "throughput", "prefill"):  # one workload: its figures at the top
            r = {d["benchmark"]: r}
        rows[c] = dict(w1=r.get("throughput", {}).get("output_tok_s"), b1=r.get("latency", {}).get("tok_s"),
                       p1=r.get("prefill", {}).get("tok_s"),
                       peak_gib=[round((x.get("peak_bytes_in_use") or 0) / 2**30, 1) for x in d.get("memory", {}).get("per_device", [])])
base = rows.get(cfgs[0], {})
print(f"{'config':<8}{'W1 tok/s':>12}{'x':>7}{'B1 tok/s':>11}{'x':>7}{'P1 tok/s':>11}  per-GPU peak GiB")
for c, r in rows.items():
    f = lambda k: (r[k] / base[k]) if r.get(k) and base.get(k) else float("nan")
    print(f"{c:<8}{r['w1'] or 0:>12.1f}{f('w1'):>7.2f}{r['b1'] or 0:>11.1f}{f('b1'):>7.2f}{r['p1'] or 0:>11.1f}  {r['peak_gib']}")
json.dump(rows, open(os.path.join(out, f"parallel_summary{os.environ.get('TAG', '')}.json"), "w"), indent=1)
PY
echo "[total $(el)s]"
