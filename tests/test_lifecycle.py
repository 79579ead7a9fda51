"""Device-memory lifecycle, KV donation, zero compiles after warm-up, streaming through the engine."""
import gc
import warnings

import jax
import numpy as np

from jvllm import LLM, RequestOutputKind, SamplingParams


def _live_bytes():
    return sum(a.nbytes for a in jax.live_arrays() if not a.is_deleted())


def _llm(path, **kw):
    return LLM(path, dtype="float32", max_model_len=128, max_num_batched_tokens=32, max_num_seqs=8,
               token_buckets=(8, 32), use_tqdm_on_load=False, **kw)


def test_shutdown_frees_device_memory_and_second_llm_loads(ckpt_dir):
    gc.collect()
    base = _live_bytes()
    llm = _llm(ckpt_dir("llama"), num_gpu_blocks_override=1000)
    held = _live_bytes() - base
    kv_bytes = llm.llm_engine.kv_bytes_per_block() * llm.get_stats()["num_blocks"]
    assert held >= kv_bytes > 4 * 2**20  # weights + pool are live
    llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=4), use_tqdm=False)
    llm.shutdown()
    gc.collect()
    assert _live_bytes() - base < 2**20
    # del + gc works too, and two LLMs can live side by side
    a = _llm(ckpt_dir("llama"))
    b = _llm(ckpt_dir("qwen3"))
    oa = a.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
    ob = b.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
    assert len(oa[0].outputs[0].token_ids) == len(ob[0].outputs[0].token_ids) == 3
    del a, b
    gc.collect()
    assert _live_bytes() - base < 2**20


def test_kv_pool_is_donated_and_updated_in_place(ckpt_dir):
    llm = _llm(ckpt_dir("llama"))
    runner = llm.llm_engine.runner
    ptrs = [k.unsafe_buffer_pointer() for k, _ in runner.kv]
    n_live = len(jax.live_arrays())
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        llm.generate([{"prompt_token_ids": list(range(3, 30))}] * 3, SamplingParams(max_tokens=5), use_tqdm=False)
    assert not [x for x in w if "donat" in str(x.message).lower()]
    assert [k.unsafe_buffer_pointer() for k, _ in runner.kv] == ptrs  # same buffers: updated in place
    assert len(jax.live_arrays()) <= n_live  # no second copy of the pool (or anything else) kept alive
    llm.shutdown()


def test_no_compiles_after_warmup_on_random_workload(ckpt_dir):
    llm = _llm(ckpt_dir("llama", tokenizer=True))
    llm.llm_engine.wait_for_warmup()  # compiles count from the end of the background warm-up
    rng = np.random.default_rng(3)
    prompts, params = [], []
    for i in range(24):
        prompts.append({"prompt_token_ids": rng.integers(3, 49152, int(rng.integers(1, 70))).tolist()})
        params.append(SamplingParams(
            max_tokens=int(rng.integers(2, 20)), temperature=float(rng.choice([0.0, 0.7, 1.2])),
            top_k=int(rng.choice([0, 5])), top_p=float(rng.choice([1.0, 0.9])), n=int(rng.choice([1, 1, 2])),
            repetition_penalty=float(rng.choice([1.0, 1.2])), logprobs=[None, 2][i % 2],
            prompt_logprobs=[None, 1][i % 3 == 0], min_tokens=int(rng.choice([0, 2])), stop=["the"] if i % 5 else None,
            seed=int(rng.integers(0, 1000)) if i % 2 else None))
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert all(o.finished for o in outs)
    stats = llm.get_stats()
    assert stats["compiles_after_warmup"] == 0, stats
    assert stats["num_free_blocks"] == stats["num_blocks"] - 1
    llm.shutdown()


def test_streaming_engine_api_and_abort(ckpt_dir):
    llm = _llm(ckpt_dir("llama", tokenizer=True))
    eng = llm.llm_engine
    eng.add_request("s", "Hello world, this is", SamplingParams(max_tokens=8, temperature=0, ignore_eos=True,
                                                             output_kind=RequestOutputKind.DELTA))
    eng.add_request("x", {"prompt_token_ids": list(range(10, 50))}, SamplingParams(max_tokens=100, ignore_eos=True))
    deltas, steps = [], 0
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.request_id == "s":
                deltas.append(out.outputs[0])
        steps += 1
        if steps == 3:
            eng.abort_request("x")
            assert eng.get_stats()["num_running"] == 1
    assert deltas[-1].finish_reason == "length"
    tokens = [t for d in deltas for t in d.token_ids]
    assert len(tokens) == 8
    full = llm.generate("Hello world, this is", SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    assert tokens == full.token_ids and "".join(d.text for d in deltas) == full.text
    stats = eng.get_stats()
    assert stats["num_free_blocks"] == stats["num_blocks"] - 1
    llm.shutdown()


def test_compile_report_cli(ckpt_dir, tmp_path):
    import json

    from jvllm.cli import main

    out = tmp_path / "report.json"
    main(["compile-report", "--model", ckpt_dir("llama"), "--max-model-len", "64", "--max-num-batched-tokens", "16",
          "--max-num-seqs", "4", "--token-buckets", "8,16", "--dtype", "float32", "--output-json", str(out)])
    rep = json.load(open(out))
    steps = [r for r in rep["programs"] if r["kind"] == "step"]
    assert sorted(r["key"] for r in steps) == ["(0, 16, False)", "(0, 8, False)", "(0, 8, True)"]
    assert all(r["flops"] > 0 and r["fusions"] > 0 for r in steps)


def test_executable_cache_warm_start(ckpt_dir, tmp_path):
    """jvllm's executable cache: the second engine loads every program instead of tracing and
    compiling it, and generates the same tokens; a corrupt entry falls back to compiling."""
    import glob

    import jax

    from jvllm import compilation as jc

    path = ckpt_dir("llama")
    kw = dict(dtype="float32", max_model_len=64, max_num_batched_tokens=16, max_num_seqs=4, token_buckets=(8, 16),
              use_tqdm_on_load=False, compilation_cache_dir=str(tmp_path / "xla"), warmup="all")
    prompts = [{"prompt_token_ids": [5, 6, 7, 8, 9]}, {"prompt_token_ids": [11, 12]}]
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    try:
        outs, stats = [], []
        for i in range(3):
            s0 = jc.executable_cache_stats()
            llm = LLM(path, **kw)
            llm.llm_engine.wait_for_warmup()
            n_programs = sum(map(len, llm.llm_engine.runner.warmup_keys()))
            outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)])
            llm.shutdown()
            s1 = jc.executable_cache_stats()
            stats.append({k: s1[k] - s0[k] for k in s1})
            if i == 1:  # damage one entry: the next start must compile that program again
                victim = sorted(glob.glob(str(tmp_path / "xla" / "executables" / "*.exe")))[0]
                with open(victim, "wb") as f:
                    f.write(b"not an executable")
    finally:
        jc.disable_persistent_cache()
    assert stats[0] == dict(loaded=0, stored=n_programs, failed=0, skipped=0)
    assert stats[1] == dict(loaded=n_programs, stored=0, failed=0, skipped=0)
    assert stats[2] == dict(loaded=n_programs - 1, stored=1, failed=1, skipped=0)
    assert outs[0] == outs[1] == outs[2]
