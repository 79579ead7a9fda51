"""Warm start-up: jvllm's executable cache keyed by program fingerprints (no trace, no lowering on
a warm start), the KV-sizing probe read from the cache, and the proof that a fingerprint can go
stale through none of source, config, flags or versions."""
from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import pytest

from jvllm import LLM, SamplingParams
from jvllm import compilation as jc
from jvllm.compilation import fingerprint as fpm
from jvllm.compilation.registry import ProgramKind, Programs, Signature, register

KW = dict(dtype="float32", max_model_len=64, max_num_batched_tokens=16, max_num_seqs=4, token_buckets=(8, 16),
          use_tqdm_on_load=False)
PROMPTS = [{"prompt_token_ids": [5, 6, 7, 8, 9]}, {"prompt_token_ids": [11, 12]}]
SP = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)


@pytest.fixture
def cache_dir(tmp_path):
    yield str(tmp_path / "xla")
    jc.disable_persistent_cache()


def _start(path, cache, **kw):
    """(tokens, executable-cache stats delta, programs lowered, num_blocks) of one engine start."""
    s0, l0 = jc.executable_cache_stats(), jc.lowering_count()
    llm = LLM(path, compilation_cache_dir=cache, **{**KW, **kw})
    try:
        llm.llm_engine.wait_for_warmup()
        toks = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, SP, use_tqdm=False)]
        n = llm.llm_engine.runner.num_blocks
    finally:
        llm.shutdown()
    s1 = jc.executable_cache_stats()
    return toks, {k: s1[k] - s0[k] for k in s1}, jc.lowering_count() - l0, n


def test_warm_start_neither_traces_nor_lowers(ckpt_dir, cache_dir):
    path = ckpt_dir("llama")
    cold = _start(path, cache_dir)
    warm = _start(path, cache_dir)
    assert cold[1]["stored"] > 0 and cold[2] >= cold[1]["stored"]
    assert warm[1] == dict(loaded=cold[1]["stored"], stored=0, failed=0, skipped=0)
    assert warm[2] == 0  # every program came from its fingerprint
    assert warm[0] == cold[0]
    other = _start(path, cache_dir, block_size=8)  # another page size: new steps; the samplers are shared
    assert 0 < other[1]["stored"] and 0 < other[1]["loaded"] < cold[1]["stored"] and other[0] == cold[0]


def test_kv_sizing_probe_reads_the_cache(ckpt_dir, cache_dir, monkeypatch):
    """With the device-memory rule (a device with allocator stats), the activation probe compiles
    the largest step once; a warm start reads its temp bytes from the entry and lowers nothing."""
    from jvllm.memory import sizing

    monkeypatch.setattr(sizing, "device_memory_stats", lambda: dict(bytes_limit=64 << 20, bytes_in_use=0))
    path = ckpt_dir("llama")
    cold, warm = _start(path, cache_dir), _start(path, cache_dir)
    assert warm[2] == 0 and warm[1]["stored"] == 0 and warm[1]["failed"] == 0
    assert warm[1]["loaded"] < cold[1]["stored"]  # the probe's programs were not even loaded
    assert warm[3] == cold[3] and warm[0] == cold[0]


def _runner(ck, cfg=None, dtype=jnp.float32, **kw):
    from jvllm.models import bind
    from jvllm.worker.model_runner import ModelRunner

    cfg = cfg or ck.config
    g, s = bind(cfg, ck.params, dtype)
    head = ck.params["embed"] if cfg.tie_word_embeddings else ck.params["lm_head"]
    args = dict(block_size=16, num_blocks=4, max_model_len=32, max_num_seqs=2, token_buckets=(8,))
    return ModelRunner(cfg, g, s, head, dtype=dtype, **{**args, **kw})


def test_fingerprint_changes_exactly_when_the_lowered_module_does(ckpt_dir):
    """Over configurations that change the program (and one that does not: the same config
    again), two fingerprints are equal exactly when the two lowered modules are."""
    from jvllm.converters import load_checkpoint

    ck = load_checkpoint(ckpt_dir("llama"))
    variants = [
        _runner(ck),
        _runner(ck),  # the same again
        _runner(ck, cfg=dataclasses.replace(ck.config, rms_norm_eps=1e-3)),
        _runner(ck, cfg=dataclasses.replace(ck.config, rope_theta=500.0)),
        _runner(ck, block_size=8, num_blocks=8),
        _runner(ck, num_blocks=6),
        _runner(ck, max_num_seqs=3),
        _runner(ck, kv_chunk_blocks=1),
        _runner(ck, query_tile=4),
    ]
    from jvllm.sampling import SamplerVariant

    keys = [("step", (0, 8, False)), ("greedy", 2), ("sample", (2, SamplerVariant(3, True, extras=True))),
            ("sample", (2, SamplerVariant(1, False, mask=True)))]
    for name, key in keys:
        fps = [r.programs.fingerprint(name, key) for r in variants]
        low = [r.programs.cache_key(name, key) for r in variants]
        assert all(f is not None for f in fps)
        for i in range(len(variants)):
            for j in range(i + 1, len(variants)):
                assert (fps[i] == fps[j]) == (low[i] == low[j]), (name, i, j)
        assert fps[0] == fps[1]
    step = [r.programs.fingerprint("step", (0, 8, False)) for r in variants]
    assert len(set(step)) == len(variants) - 1  # every change reaches the step program
    assert variants[0].programs.fingerprint("step", (0, 8, True)) != step[0]  # the key is part of it


def test_fingerprint_follows_source_versions_flags_and_jax_config(ckpt_dir, monkeypatch):
    from jvllm.converters import load_checkpoint

    r = _runner(load_checkpoint(ckpt_dir("llama")))
    base = r.programs.fingerprint("step", (0, 8, False))
    assert r.programs.fingerprint("step", (0, 8, False)) == base
    src, jaxv, jaxlibv, libs = fpm._process_constants()
    for changed in [("0" * 64, jaxv, jaxlibv, libs), (src, jaxv + ".post1", jaxlibv, libs),
                    (src, jaxv, jaxlibv, libs + (("flax", "0.0.1"),))]:
        monkeypatch.setitem(fpm._static, "v", changed)
        assert r.programs.fingerprint("step", (0, 8, False)) != base
    monkeypatch.setitem(fpm._static, "v", (src, jaxv, jaxlibv, libs))
    assert r.programs.fingerprint("step", (0, 8, False)) == base
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", "") + " --xla_cpu_enable_fast_math=false")
    assert r.programs.fingerprint("step", (0, 8, False)) != base
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", "").replace(" --xla_cpu_enable_fast_math=false", ""))
    with jax.default_matmul_precision("highest"):
        assert r.programs.fingerprint("step", (0, 8, False)) != base
    assert r.programs.fingerprint("step", (0, 8, False)) == base


def test_source_digest_sees_every_python_file(tmp_path):
    (tmp_path / "pkg" / "__pycache__").mkdir(parents=True)
    (tmp_path / "pkg" / "a.py").write_text("x = 1\n")
    (tmp_path / "pkg" / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"junk")
    d0 = fpm.source_digest([str(tmp_path / "pkg")])
    (tmp_path / "pkg" / "__pycache__" / "b.pyc").write_bytes(b"more junk")
    (tmp_path / "pkg" / "notes.txt").write_text("not code")
    assert fpm.source_digest([str(tmp_path / "pkg")]) == d0
    (tmp_path / "pkg" / "a.py").write_text("x = 2\n")
    d1 = fpm.source_digest([str(tmp_path / "pkg")])
    assert d1 != d0
    (tmp_path / "pkg" / "sub").mkdir()
    (tmp_path / "pkg" / "sub" / "b.py").write_text("")
    assert fpm.source_digest([str(tmp_path / "pkg")]) not in (d0, d1)


def _user_fn(x):  # a function outside jvllm and the pinned libraries
    return x * 2


register(ProgramKind("test_startup_user", lambda ctx, key: Signature(
    jax.jit(_user_fn), (jax.ShapeDtypeStruct((key,), jnp.float32),), (jax.devices()[0],)),
    lambda ctx: [], family="test_startup"))


def test_unfingerprintable_programs_fall_back_to_the_lowered_key(cache_dir):
    """A program closing over code outside jvllm (a user's function) gets no fingerprint, and goes
    through the cache under its lowered module's key: loaded on the next start, still correct."""
    jc.enable_persistent_cache(cache_dir)
    progs = Programs(object(), family="test_startup")
    assert progs.fingerprint("test_startup_user", 4) is None
    with pytest.raises(fpm.Unfingerprintable, match="_user_fn"):
        fpm.fingerprint("test_startup_user", 4, Signature(jax.jit(_user_fn), (), (jax.devices()[0],)))
    s0 = jc.executable_cache_stats()
    out = progs.get("test_startup_user", 4)(jnp.ones(4, jnp.float32))
    again = Programs(object(), family="test_startup").get("test_startup_user", 4)(jnp.ones(4, jnp.float32))
    s1 = jc.executable_cache_stats()
    assert (out == 2).all() and (again == 2).all()
    assert {k: s1[k] - s0[k] for k in s1} == dict(loaded=1, stored=1, failed=0, skipped=0)
    assert os.path.isfile(os.path.join(cache_dir, "executables", progs.cache_key("test_startup_user", 4) + ".exe"))


def test_describe_refuses_what_it_cannot_pin():
    import numpy as np

    with pytest.raises(fpm.Unfingerprintable, match="numpy array"):
        fpm._describe(np.zeros(1 << 20, np.float32), set())
    with pytest.raises(fpm.Unfingerprintable, match="object"):
        fpm._describe(object(), set())

    class Local:
        pass

    with pytest.raises(fpm.Unfingerprintable, match="Local"):
        fpm._describe(Local, set())  # a class outside jvllm: its code is pinned by nothing
    assert fpm._describe(jnp.float32, set()) != fpm._describe(jnp.bfloat16, set())
    assert fpm._describe(np.arange(4), set()) != fpm._describe(np.arange(1, 5), set())
    assert fpm._describe((1, 2.0), set()) != fpm._describe((1, 2), set())  # types are part of it


def test_gguf_header_is_parsed_once_per_file_version(tmp_path, smollm2_path):
    """Config, tokenizer and weights of one start-up share one parse of the GGUF header; a file
    changed since (size or mtime) is parsed again."""
    import shutil

    from jvllm.converters import gguf

    p = tmp_path / "m.gguf"
    shutil.copy(smollm2_path, p)
    a = gguf._reader(str(p))
    assert gguf._reader(str(p)) is a
    st = os.stat(p)
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    b = gguf._reader(str(p))
    assert b is not a and b.fields == a.fields


_JAX_CACHE_HIT = r"""
import sys, jax, jax.numpy as jnp
from jvllm.compilation import counter, executable_cache as ec
jax.config.update("jax_compilation_cache_dir", sys.argv[1])  # a user's own JAX cache
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
counter.enable_persistent_cache(sys.argv[2])
assert jax.config.jax_compilation_cache_dir == sys.argv[1]  # jvllm leaves the user's setting alone on CPU
f = lambda x: jnp.tanh(x @ x.T + jnp.broadcast_to(x.sum(0), x.shape)[:, :8]).sum(1)
x, devs = jnp.ones((8, 16)), jax.devices()[:1]
want = f(x)
fresh, ok = ec.compile_for_cache(jax.jit(f).lower(x), devs)      # compiled: JAX's cache stores it
jax.clear_caches()
served, ok2 = ec.compile_for_cache(jax.jit(f).lower(x), devs)    # served by JAX's cache
assert (ok, ok2) == (True, False) and ec.stats()["skipped"] == 1, (ok, ok2, ec.stats())
assert ec.store("fresh", fresh) and ec.store("served", served)
assert bool(jnp.allclose(ec.load("fresh", devs)(x), want))
try:  # the XLA:CPU hazard the refusal guards against
    ec.load("served", devs)(x).block_until_ready()
    print("SERVED_COPY_WORKS")
except Exception as e:
    print("SERVED_COPY_BROKEN", type(e).__name__, str(e)[:120])
"""


def test_jax_cache_served_cpu_executables_are_not_stored(tmp_path):
    """On CPU an executable that JAX's persistent cache served serializes without its kernels (the
    next start failed at its first call: "Function ... not found"): jvllm keeps JAX's cache off on
    CPU, and where a user turned it on, compile_for_cache refuses to store what it served. The
    subprocess also shows the hazard is real; if a jax release fixes it, this test says so."""
    import subprocess
    import sys

    env = dict(os.environ, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-c", _JAX_CACHE_HIT, str(tmp_path / "jax"), str(tmp_path / "jvllm")],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "SERVED_COPY_BROKEN" in r.stdout, r.stdout + r.stderr[-2000:]


def test_cpu_engines_keep_jax_cache_off(cache_dir):
    """jvllm's cache on a CPU does not point JAX's persistent cache at itself; 'off' turns both off."""
    assert jc.enable_persistent_cache(cache_dir) == cache_dir
    from jvllm.compilation import executable_cache

    assert jax.config.jax_compilation_cache_dir is None
    assert executable_cache.cache_dir() == os.path.join(cache_dir, "executables")
    assert jc.enable_persistent_cache("off") is None and executable_cache.cache_dir() is None
