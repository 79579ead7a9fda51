"""The core's structure: host modules import no jax; the program registry compiles a key once
across threads; jvllm's executable cache keys programs by what they are."""
import subprocess
import sys
import threading

import numpy as np
import pytest

HOST_MODULES = ["jvllm.engine.llm_engine", "jvllm.engine.engine", "jvllm.engine.loop", "jvllm.engine.input_processor",
                "jvllm.engine.output_processor", "jvllm.engine.engine_config", "jvllm.engine.scheduler",
                "jvllm.engine.request", "jvllm.engine.data_parallel", "jvllm.memory.block_pool", "jvllm.llm", "jvllm"]


def test_engine_modules_do_not_import_jax():
    code = ("import sys\n" + "".join(f"import {m}\n" for m in HOST_MODULES)
            + "bad = sorted(m for m in sys.modules if m == 'jax' or m.startswith('jax.'))\nprint(bad[:5])\n"
              "sys.exit(1 if bad else 0)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr


def _counting_kind(name, calls, body):
    import jax

    from jvllm.compilation.registry import ProgramKind, Signature, register

    def sig(ctx, key):
        calls.append(key)
        return Signature(jax.jit(body), (jax.ShapeDtypeStruct((key,), np.float32),), tuple(jax.devices()[:1]))

    return register(ProgramKind(name, sig, lambda ctx: [4, 8], family="test"))


def test_registry_compiles_each_key_once_across_threads():
    from jvllm.compilation.registry import Programs

    calls = []
    _counting_kind("test_double", calls, lambda x: x * 2)
    progs = Programs(object(), family="test")
    assert progs.keys() == [("test_double", 4), ("test_double", 8)]
    barrier = threading.Barrier(4)
    got = []

    def ask():
        barrier.wait()
        got.append(progs.get("test_double", 4))

    threads = [threading.Thread(target=ask) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert calls == [4] and len({id(e) for e in got}) == 1
    h = progs.warm_up(progs.keys(), background=True)
    h.wait(60)
    assert h.done() and calls == [4, 8] and h.compile_count_at_end is not None
    np.testing.assert_array_equal(np.asarray(progs.get("test_double", 8)(np.ones(8, np.float32))), 2 * np.ones(8))
    with pytest.raises(KeyError, match="no program kind of family 'nope' is registered"):
        Programs(object(), family="nope")


def test_background_warm_up_compiles_every_key_once_with_several_threads(monkeypatch):
    """JVLLM_COMPILE_THREADS=3: three threads share one ordered key list; each key compiles once,
    the handle finishes after the last thread, and a failing key's error reaches wait()."""
    import jax

    from jvllm.compilation.registry import Programs, ProgramKind, Signature, compile_threads, register

    monkeypatch.setenv("JVLLM_COMPILE_THREADS", "3")
    assert compile_threads() == 3
    calls, names = [], []
    keys = list(range(1, 10))

    def sig(ctx, key):
        calls.append(key)
        names.append(threading.current_thread().name)
        if key == 99:
            raise RuntimeError("bad key 99")
        return Signature(jax.jit(lambda x: x + 1), (jax.ShapeDtypeStruct((key,), np.float32),), tuple(jax.devices()[:1]))

    register(ProgramKind("test_threads", sig, lambda ctx: keys, family="test_threads"))
    progs = Programs(object(), family="test_threads")
    h = progs.warm_up(progs.keys(), background=True)
    h.wait(120)
    assert sorted(calls) == keys and len(progs.compiled()) == len(keys)
    assert {n for n in names} <= {f"jvllm-warmup-{i}" for i in range(3)}
    bad = progs.warm_up([("test_threads", 99)], background=True)
    with pytest.raises(RuntimeError, match="bad key 99"):
        bad.wait(60)
    for v in ("0", "x"):
        monkeypatch.setenv("JVLLM_COMPILE_THREADS", v)
        with pytest.raises(ValueError, match="JVLLM_COMPILE_THREADS must be an integer >= 1"):
            compile_threads()


def test_executable_key_tells_models_with_equal_inputs_apart(ckpt_dir):
    """Two tiny models with identical input shapes (only rms_norm_eps differs) lower to different
    modules, so their step programs get different executable-cache keys; the same model twice
    gets the same key."""
    import dataclasses

    import jax.numpy as jnp

    from jvllm.converters import load_checkpoint
    from jvllm.models import bind
    from jvllm.models.layers import head_of
    from jvllm.worker.model_runner import ModelRunner

    ck = load_checkpoint(ckpt_dir("llama"))
    keys = []
    for eps in (1e-5, 1e-3, 1e-5):
        cfg = dataclasses.replace(ck.config, rms_norm_eps=eps)
        g, s = bind(cfg, ck.params)
        head = head_of(cfg, ck.params)
        r = ModelRunner(cfg, g, s, head, dtype=jnp.float32, block_size=16, num_blocks=4,
                        max_model_len=32, max_num_seqs=2, token_buckets=(8,))
        keys.append(r.programs.cache_key("step", (0, 8, False)))
    assert keys[0] != keys[1] and keys[0] == keys[2]


def test_executable_key_tells_argument_trees_apart():
    """An argument the program does not use is pruned from the lowered module: None there and an
    array there lower to the same text, yet an executable only takes the tree it was compiled
    with (the greedy spec_verify with and without draft probabilities), so the keys differ."""
    import jax
    import jax.numpy as jnp

    from jvllm.compilation.executable_cache import executable_key

    f = jax.jit(lambda x, unused: x + 1)
    x = jax.ShapeDtypeStruct((4,), jnp.float32)
    a, b = f.lower(x, None), f.lower(x, jax.ShapeDtypeStruct((3,), jnp.float32))
    assert a.as_text() == b.as_text()
    devs = jax.devices()[:1]
    assert executable_key(a, devs) != executable_key(b, devs)
    assert executable_key(a, devs) == executable_key(f.lower(x, None), devs)


def test_background_warmup_compiles_the_first_request_programs_first(ckpt_dir):
    """LLM(...) returns with the programs every request needs compiled (the smallest decode step and
    its greedy sampler); the rest compile in the background, prefill steps from the smallest bucket
    up first, and after wait_for_warmup every program is in and serving compiles nothing."""
    from jvllm import LLM, SamplingParams

    llm = LLM(ckpt_dir("llama"), dtype="float32", max_model_len=128, max_num_batched_tokens=32, max_num_seqs=8,
              token_buckets=(8, 16, 32), use_tqdm_on_load=False, warmup="all")
    try:
        eng = llm.llm_engine
        first, rest = eng.runner.warmup_keys()
        assert set(first) == {("step", (0, 8, True)), ("greedy", 8)}, first
        assert set(first) <= set(eng.worker.compiled_programs())
        assert rest and not set(first) & set(rest)
        # max_num_seqs 8: every bucket's greedy sampler is greedy[8], already in `first`
        assert rest[:3] == [("step", (0, 8, False)), ("step", (0, 16, False)), ("step", (0, 32, False))], rest
        eng.wait_for_warmup()
        # every registered program, plus the masked sampler twins where llguidance is installed
        assert set(eng.worker.compiled_programs()) == set(first) | set(rest) >= set(eng.runner.programs.keys())
        st0 = llm.get_stats()
        assert not st0["warmup_pending"] and st0["compiles_after_warmup"] == 0
        llm.generate([{"prompt_token_ids": list(range(3, 3 + n))} for n in (3, 20)],
                     SamplingParams(max_tokens=5, temperature=0.8, seed=1, logprobs=1), use_tqdm=False)
        assert llm.get_stats()["compiles_after_warmup"] == 0
    finally:
        llm.shutdown()


def test_warmup_first_compiles_the_rest_on_first_use(ckpt_dir, monkeypatch):
    """warmup="first": only the first request's programs compile at start-up; the others on their
    first use, counted as deferred_compiles and not as compiles_after_warmup (which still counts a
    compile outside the plan); the same tokens as warmup="all". A bad value names itself; the env
    variable sets the default and --warmup reaches the config."""
    import argparse

    from jvllm import LLM, SamplingParams
    from jvllm.cli import add_engine_args, engine_kwargs
    from jvllm.compilation import compile_count
    from jvllm.engine.engine_config import EngineConfig

    kw = dict(dtype="float32", max_model_len=128, max_num_batched_tokens=32, max_num_seqs=8, token_buckets=(8, 16, 32),
              use_tqdm_on_load=False)
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (3, 20)]
    sp = SamplingParams(max_tokens=5, temperature=0.8, seed=1, logprobs=1)
    outs = []
    for mode in ("first", "all"):
        llm = LLM(ckpt_dir("llama"), warmup=mode, **kw)
        try:
            eng = llm.llm_engine
            first, rest = eng.runner.warmup_keys()
            if mode == "first":
                assert set(eng.worker.compiled_programs()) == set(first) and llm.get_stats()["deferred_compiles"] == 0
            eng.wait_for_warmup()
            outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)])
            st = llm.get_stats()
            assert st["compiles_after_warmup"] == 0, st
            assert (st["deferred_compiles"] > 0) == (mode == "first"), st
            if mode == "first":
                assert set(first) < set(eng.worker.compiled_programs()) <= set(first) | set(rest)
                import jax
                import jax.numpy as jnp

                c0 = compile_count()
                jax.jit(lambda x: x * 3 + 1)(jnp.zeros(13))  # a new function: a program outside the plan counts
                assert llm.get_stats()["compiles_after_warmup"] == compile_count() - c0 > 0
        finally:
            llm.shutdown()
    assert outs[0] == outs[1]
    with pytest.raises(ValueError, match="warmup must be one of .*'lazy'"):
        LLM(ckpt_dir("llama"), warmup="lazy", **kw)
    monkeypatch.setenv("JVLLM_WARMUP", "all")
    assert EngineConfig().warmup == "all"
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2")
    add_engine_args(p)
    assert engine_kwargs(p.parse_args(["--warmup", "first"]))["warmup"] == "first"
    assert "warmup" not in engine_kwargs(p.parse_args([]))


def test_background_compile_flag_reaches_the_engine_config():
    """--no-background-compile (every program before serving) and the default both reach EngineConfig."""
    import argparse

    from jvllm.cli import add_engine_args, engine_kwargs

    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2")
    add_engine_args(p)
    assert engine_kwargs(p.parse_args([]))["background_compile"] is True
    assert engine_kwargs(p.parse_args(["--no-background-compile"]))["background_compile"] is False
    # `jvllm serve` compiles everything before /health answers (vLLM's readiness); generate does not
    from jvllm.cli import build_parser

    ap = build_parser()
    serve = ap.parse_args(["serve", "smollm2"])
    assert engine_kwargs(serve)["background_compile"] is False
    assert engine_kwargs(ap.parse_args(["serve", "smollm2", "--background-compile"]))["background_compile"] is True
    assert engine_kwargs(ap.parse_args(["generate", "hi"]))["background_compile"] is True


def test_cpu_default_buckets_begin_with_one_token(ckpt_dir):
    """On a CPU the default token buckets begin with a 1-token one (one prompt's decode steps run
    as matrix-vector products there); its greedy tokens are the 8-token bucket's."""
    from jvllm import LLM, SamplingParams

    kw = dict(dtype="float32", max_model_len=64, max_num_batched_tokens=16, max_num_seqs=4, use_tqdm_on_load=False)
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    toks = []
    for buckets in (None, (8, 16)):
        llm = LLM(ckpt_dir("llama"), token_buckets=buckets, **kw)
        try:
            eng = llm.llm_engine
            assert eng.runner.token_buckets == (buckets or (1, 8, 16))
            if buckets is None:  # the background warm-up meets the 8-token prefill step first, the 1-token one last
                steps = [k for k in eng.runner.warmup_keys()[1] if k[0] == "step"]
                assert steps[:3] == [("step", (0, 8, False)), ("step", (0, 16, False)), ("step", (0, 1, False))], steps
            toks.append(llm.generate([{"prompt_token_ids": [5, 6, 7, 8, 9]}], sp, use_tqdm=False)[0].outputs[0].token_ids)
            assert (("step", (0, 1, True)) in eng.worker.compiled_programs()) == (buckets is None)
        finally:
            llm.shutdown()
    assert toks[0] == toks[1] and len(toks[0]) == 6
