#!/usr/bin/env bash
# Issue 25 item 1: W1 and B1 (`jvllm bench all`, random:llama3-8b bf16) greedy against sampled
# decoding in one device call: greedy, temperature 0.8 + top_p 0.95, temperature 0.8 + top_k 50,
# temperature 0.8 + min_p 0.05. With BEFORE (a folder holding `git archive` of the build before,
# carried with the call) each configuration runs on both builds, alternating, each build installed
# into its own --target folder with its own compile cache (as ab_builds.sh does); the build before
# has no --min-p, so its min_p run is skipped.
#   CONFIGS (default "greedy top_p top_k min_p"), BUILDS (default "after", or "before after" with
#   BEFORE), MODEL (random:llama3-8b), LIMIT (seconds per run, default 140; the whole call must
#   end within 600 s: a run takes about 60-90 s with a warm cache, the first of a build more while
#   it compiles, so split CONFIGS over calls, e.g. "greedy top_p" then "top_k min_p"),
#   BEFORE_COMMIT / AFTER_COMMIT (each build's commit for its JSON), PROBE=1 (first, with BEFORE:
#   benchmarks/probes/sampler_speed.py at R=256, V=128256, old vs new per-call sampler time and
#   radix 4 / 2 / 1 on this GPU -> $OUT/sampler_speed.json, about 2 minutes).
# Writes $OUT/<build>_<config>.json (+ .log) and $OUT/sampled_vs_greedy.json: per build and config
# W1 output tok/s, mean step ms, host sample_call ms per step, B1 tok/s and step ms, and each
# sampled figure as a ratio of the same build's greedy one (target: >= 0.97).
set -u
source "$(dirname "$0")/device_env.sh"  # OUT, el, install, wheels, cache dir
MODEL=${MODEL:-random:llama3-8b}; ROOT=$PWD
COMMON="--model $MODEL --dtype ${DTYPE:-bfloat16} --max-model-len ${MAXLEN:-4096} --no-xla-report ${EXTRA:-}"
if [ -n "${BEFORE:-}" ]; then BUILDS=${BUILDS:-"before after"}; else BUILDS=${BUILDS:-after}; fi
args_of() {
  case $1 in
    greedy) echo "" ;;
    top_p) echo "--temperature 0.8 --top-p 0.95" ;;
    top_k) echo "--temperature 0.8 --top-k 50" ;;
    min_p) echo "--temperature 0.8 --min-p 0.05" ;;
    *) echo "unknown config $1" >&2; return 1 ;;
  esac
}
install() {  # install <src> <target>
  python -m pip install -q --no-deps --no-build-isolation --no-compile --target "$2" "$1" > "$OUT/pip_$(basename $2).log" 2>&1 \
    || { echo "pip failed for $1"; tail -5 "$OUT/pip_$(basename $2).log"; exit 1; }
}
for b in $BUILDS; do
  src=$PWD; [ "$b" = before ] && src=$(realpath "$BEFORE")
  [ -d /tmp/site_$b ] || install "$src" /tmp/site_$b
done
if [ "${PROBE:-0}" = 1 ]; then
  if [ -z "${BEFORE:-}" ]; then echo "PROBE needs BEFORE (the old jvllm/sampling.py)"; else
    echo "[$(el)s] sampler_speed probe"
    (cd /tmp && PYTHONPATH=/tmp/site_after${PYTHONPATH:+:$PYTHONPATH} timeout 240 python "$ROOT/benchmarks/probes/sampler_speed.py" \
      --both-old --impls gpu2,gpu1 --old-file "$(realpath "$BEFORE")/jvllm/sampling.py" --out "$OUT/sampler_speed.json" \
      > "$OUT/sampler_speed.log" 2>&1)
    echo "rc=$?"; grep '"case"' "$OUT/sampler_speed.log" | cut -c1-400
  fi
fi
for c in ${CONFIGS:-greedy top_p top_k min_p}; do
  sargs=$(args_of $c) || exit 2
  for b in $BUILDS; do
    if [ "$c" = min_p ] && ! (cd /tmp && PYTHONPATH=/tmp/site_$b${PYTHONPATH:+:$PYTHONPATH} python -m jvllm.cli bench all --help | grep -q -- --min-p); then
      echo "[$(el)s] $b $c: this build's bench has no --min-p, skipped"; continue
    fi
    left=$(( 590 - $(el) )); lim=${LIMIT:-140}; [ $left -lt $lim ] && lim=$left
    [ $lim -lt 45 ] && { echo "[$(el)s] no time left for $b $c"; continue; }
    commit=${AFTER_COMMIT:-unknown}; [ "$b" = before ] && commit=${BEFORE_COMMIT:-unknown}
    echo "[$(el)s] $b $c ($sargs)"
    # from /tmp: `python -m` puts the working directory first on sys.path, which would import this tree
    (cd /tmp && JVLLM_GIT_COMMIT=$commit PYTHONPATH=/tmp/site_$b${PYTHONPATH:+:$PYTHONPATH} JVLLM_CACHE_DIR=/tmp/cache_$b timeout $lim \
      python -m jvllm.cli bench all $COMMON $sargs --output-json "$OUT/${b}_${c}.json" > "$OUT/${b}_${c}.log" 2>&1)
    echo "rc=$?"; grep -E "^ *(W1|B1):" "$OUT/${b}_${c}.log" | cut -c1-200
  done
done
python - "$OUT" <<'PY'
import glob, json, os, sys
out = sys.argv[1]
rows = {}
for f in sorted(glob.glob(os.path.join(out, "*_*.json"))):
    build, _, config = os.path.basename(f)[:-5].partition("_")
    if build not in ("before", "after"):
        continue
    try:
        d = json.load(open(f))
    except ValueError:
        continue
    r = d.get("results", {})
    w, l = r.get("throughput") or {}, r.get("latency") or {}
    rows.setdefault(build, {})[config] = dict(
        commit=(d.get("versions", {}).get("jvllm_git") or {}).get("commit"),
        sampling=d.get("config", {}).get("sampling"), compiles_after_warmup=d.get("compiles_after_warmup"),
        w1_output_tok_s=w.get("output_tok_s"), w1_mean_step_ms=w.get("mean_step_ms"),
        w1_sample_call_ms_per_step=w.get("host_sample_call_ms_per_step"), b1_tok_s=l.get("tok_s"), b1_step_ms=l.get("step_ms"),
        warmup_background_s=d.get("startup", {}).get("warmup_background_s"))
for build, cfgs in rows.items():
    g = cfgs.get("greedy", {})
    for c, v in cfgs.items():
        for k in ("w1_output_tok_s", "b1_tok_s"):
            if c != "greedy" and v.get(k) and g.get(k):
                v[k + "_vs_greedy"] = round(v[k] / g[k], 4)
json.dump(dict(benchmark="sampled_vs_greedy", target_vs_greedy=0.97, builds=rows), open(os.path.join(out, "sampled_vs_greedy.json"), "w"), indent=1)
for build, cfgs in rows.items():
    for c, v in cfgs.items():
        print(build, c, {k: v.get(k) for k in ("w1_output_tok_s", "w1_output_tok_s_vs_greedy", "b1_tok_s", "b1_tok_s_vs_greedy", "w1_sample_call_ms_per_step")})
PY
echo "[total $(el)s]"
