# Sourced by the benchmarks/scripts/*.sh device scripts: $OUT, an elapsed-seconds helper `el` and
# a stage-limit helper `left`, jvllm installed from this copy (editable; the device image has jax
# but not jvllm), the server's wheels carried in .whl/ (the image lacks fastapi, starlette, uvicorn,
# pydantic) on PYTHONPATH, and one compile cache directory for every run of the call.
# REQUIRE_CARD (e.g. H200): exit 3 at once, before installing anything, unless the GPU's name
# holds it (a call naming `nvidia-h200` may be given an H100).
if [ -n "${REQUIRE_CARD:-}" ]; then
  card=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
  case "$card" in *"$REQUIRE_CARD"*) ;; *) echo "REQUIRE_CARD=$REQUIRE_CARD but the GPU is '${card:-none}': exit"; exit 3 ;; esac
fi
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
# seconds a stage may run: min(its cap $1, what is left until END, else END_S, else 590)
left() { local l=$(( ${END:-${END_S:-590}} - $(el) )); [ "$1" -lt "$l" ] && l=$1; echo $l; }
python -m pip install --no-deps --no-build-isolation -q -e . > "$OUT/pip.log" 2>&1 || { echo "pip failed"; tail "$OUT/pip.log"; }
if ls .whl/*.whl > /dev/null 2>&1; then
  python -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >> "$OUT/pip.log" 2>&1
  export PYTHONPATH=/tmp/site
fi
export JVLLM_CACHE_DIR=/tmp/jvllm_xla_cache
