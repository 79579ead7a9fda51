#!/usr/bin/env bash
# Issue 25 item 3: S1 (benchmarks/serve_bench.py against `jvllm serve`, random:llama3-8b bf16) at
# 4, 8 and 16 req/s and a burst, on this build and, with BEFORE (a folder holding `git archive` of
# the build before, carried with the call), on that one too in the same call; each build installed
# into its own --target folder with its own compile cache (as ab_builds.sh does).
#   RATES (default 4,8,16,inf), N (requests per rate, default 64), BUILDS (default "after", or
#   "before after" with BEFORE), MODEL, LIMIT (seconds per build, default 280: server start,
#   warm-up and every rate; two builds fit one 600 s call only with a warm compile cache or a
#   smaller N), BEFORE_COMMIT / AFTER_COMMIT, SERVE_ARGS (extra `jvllm serve` flags), S1_ARGS
#   (extra serve_bench.py flags, e.g. "--input-len 8 32 --output-len 4 16" for a CPU dry run),
#   SHARED_CACHE=1 (one compile cache for both builds: when their programs are the same, the
#   second start finds XLA's executables in jax's persistent cache and only lowers). A build named
#   "args" in BUILDS is this tree again with SERVE_ARGS2 added (e.g. --fit-chunks-to-buckets: that
#   option's A/B), sharing "after"'s install and compile cache; it runs only if time is left.
# Writes $OUT/s1_all.tgz (<build>_s1.json, logs, server logs, PNGs) and $OUT/s1_summary.json: per build and rate
# TTFT / TPOT p50 and p99 (ms), output tok/s, failures, compiles after warm-up, and the targets
# (TTFT p99 at 8 req/s <= 100 ms, TPOT p99 <= 10 ms at 8 req/s and at every rate) as booleans.
set -u
source "$(dirname "$0")/device_env.sh"  # OUT, el, install, wheels (fastapi, uvicorn...), cache dir
MODEL=${MODEL:-random:llama3-8b}
if [ -n "${BEFORE:-}" ]; then BUILDS=${BUILDS:-"before after"}; else BUILDS=${BUILDS:-after}; fi
SB=$PWD/benchmarks/serve_bench.py
install() {  # install <src> <target>
  python -m pip install -q --no-deps --no-build-isolation --no-compile --target "$2" "$1" > "$OUT/pip_$(basename $2).log" 2>&1 \
    || { echo "pip failed for $1"; tail -5 "$OUT/pip_$(basename $2).log"; exit 1; }
}
for b in $BUILDS; do
  src=$PWD; [ "$b" = before ] && src=$(realpath "$BEFORE")
  site=$b; [ "$b" = args ] && site=after
  [ -d /tmp/site_$site ] || install "$src" /tmp/site_$site
done
for b in $BUILDS; do
  left=$(( ${END_S:-590} - $(el) )); lim=${LIMIT:-280}; [ $left -lt $lim ] && lim=$left
  [ $lim -lt 90 ] && { echo "[$(el)s] no time left for $b"; continue; }
  commit=${AFTER_COMMIT:-unknown}; [ "$b" = before ] && commit=${BEFORE_COMMIT:-unknown}
  site=$b; extra=; [ "$b" = args ] && { site=after; extra=${SERVE_ARGS2:-}; }
  echo "[$(el)s] $b S1 rates ${RATES:-4,8,16,inf} $extra"
  mkdir -p "$OUT/s1_$b"
  (cd /tmp && JVLLM_GIT_COMMIT=$commit PYTHONPATH=/tmp/site_$site${PYTHONPATH:+:$PYTHONPATH} JVLLM_CACHE_DIR=/tmp/cache_${SHARED_CACHE:+shared}${SHARED_CACHE:-$site} \
    timeout $lim python "$SB" "$MODEL" --num-prompts ${N:-64} --request-rates ${RATES:-4,8,16,inf} ${S1_ARGS:-} \
      --serve-args="--max-model-len ${MAXLEN:-4096} --dtype ${DTYPE:-bfloat16} ${SERVE_ARGS:-} $extra" \
      --output-json "$OUT/s1_$b/${b}_s1.json" > "$OUT/${b}_s1.log" 2>&1)
  echo "rc=$?"; grep -E "^(server|rate)" "$OUT/${b}_s1.log" | cut -c1-220
done
python - "$OUT" <<'PY'
import glob, json, os, sys
out = sys.argv[1]
summary = {}
for f in sorted(glob.glob(os.path.join(out, "s1_*", "*_s1.json"))):
    build = os.path.basename(f)[:-len("_s1.json")]
    d = json.load(open(f))
    rates = {r["request_rate"]: {k: r.get(k) for k in ("completed", "failed", "request_throughput", "output_throughput",
                                                      "ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p99")}
             for r in d["results"]}
    r8 = rates.get("8") or {}
    commit = os.environ.get("BEFORE_COMMIT" if build == "before" else "AFTER_COMMIT")
    summary[build] = dict(commit=commit, serve_args=d["config"].get("serve_args"),
                          compiles_after_warmup=d.get("compiles_after_warmup"),
                          server_startup=d.get("server_startup"), rates=rates,
                          ttft_p99_at_8_le_100ms=(r8.get("ttft_ms_p99") or 1e9) <= 100,
                          tpot_p99_at_8_le_10ms=(r8.get("tpot_ms_p99") or 1e9) <= 10,
                          tpot_p99_le_10ms_all_rates=all((r.get("tpot_ms_p99") or 1e9) <= 10 for r in rates.values()))
json.dump(dict(benchmark="S1", targets=dict(ttft_ms_p99_at_8=100, tpot_ms_p99=10), builds=summary),
          open(os.path.join(out, "s1_summary.json"), "w"), indent=1)
print(json.dumps({b: {k: v for k, v in s.items() if k.endswith("ms") or k.endswith("rates")} for b, s in summary.items()}))
PY
# at most 8 files come back from a call: everything but the summary and console.log in one archive
(cd "$OUT" && keep=$(ls -A | grep -v -x -e s1_summary.json -e console.log) && tar -czf /tmp/s1_all.tgz $keep \
  && rm -rf $keep && mv /tmp/s1_all.tgz .)
echo "[total $(el)s]"
