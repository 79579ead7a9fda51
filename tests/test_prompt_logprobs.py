"""Prompt logprobs are complete and equal to an uncached run whatever the prefix cache, chunked
prefill or preemption did (a cache hit position has no logits, so such requests get no hit on
positions they still owe)."""
import numpy as np
import pytest

from jvllm import LLM, SamplingParams
from jvllm.engine.request import Request


def _plp(out):
    """[(token, logprob)] for every prompt position after the first, checking completeness."""
    P = len(out.prompt_token_ids)
    plp = out.prompt_logprobs
    assert plp is not None and len(plp) == P and plp[0] is None
    return np.array([plp[j][out.prompt_token_ids[j]].logprob for j in range(1, P)])


def _run(llm, prompts, **kw):
    kw.setdefault("max_tokens", 1)
    sp = SamplingParams(temperature=0.0, prompt_logprobs=kw.pop("prompt_logprobs", 0), **kw)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)


def test_cache_hit_keeps_prompt_logprobs(smollm2_llm):
    """The issue's case: the same 20-token prompt twice; then a prompt sharing a cached prefix."""
    rng = np.random.default_rng(19)
    V = smollm2_llm.llm_engine.model_config.vocab_size
    prompt = rng.integers(100, V, 20).tolist()
    first = _run(smollm2_llm, [prompt], prompt_logprobs=2)[0]
    plain = _run(smollm2_llm, [prompt], prompt_logprobs=None)[0]
    assert plain.num_cached_tokens == 16  # the block is cached: without prompt logprobs it is a hit
    second = _run(smollm2_llm, [prompt], prompt_logprobs=2)[0]
    assert second.num_cached_tokens == 0
    np.testing.assert_allclose(_plp(second), _plp(first), atol=1e-5)
    for a, b in zip(first.prompt_logprobs[1:], second.prompt_logprobs[1:]):
        assert set(a) == set(b) and all(a[t].rank == b[t].rank for t in a)

    longer = prompt + rng.integers(100, V, 9).tolist()  # its first block is cached
    ref = _run(smollm2_llm, [longer])[0]
    np.testing.assert_allclose(_plp(ref)[:19], _plp(first), atol=1e-5)


def test_n_siblings_share_the_prompt(smollm2_llm):
    rng = np.random.default_rng(20)
    V = smollm2_llm.llm_engine.model_config.vocab_size
    prompt = rng.integers(100, V, 37).tolist()
    ref = _run(smollm2_llm, [prompt])[0]
    hits0 = smollm2_llm.llm_engine.kv_manager.pool.prefix_hits
    out = smollm2_llm.generate({"prompt_token_ids": prompt},
                               SamplingParams(n=3, max_tokens=2, temperature=1.0, seed=5, prompt_logprobs=1),
                               use_tqdm=False)[0]
    assert len(out.outputs) == 3
    np.testing.assert_allclose(_plp(out), _plp(ref), atol=1e-5)
    # the first sequence computes the prompt; its siblings take its two full blocks from the cache
    assert smollm2_llm.llm_engine.kv_manager.pool.prefix_hits - hits0 >= 2 * 32


def test_max_prefix_hit_tokens():
    p = list(range(40))
    r = Request("a", p, SamplingParams(prompt_logprobs=0), seed=0)
    assert r.max_prefix_hit_tokens == 0
    r.prompt_logprobs += [{}] * 20  # entries for positions 0..19 recorded (e.g. before a preemption)
    assert r.max_prefix_hit_tokens == 20
    r.prompt_logprobs += [{}] * 19
    assert not r.needs_prompt_logprobs and r.max_prefix_hit_tokens == 39
    assert Request("b", p, SamplingParams(), seed=0).max_prefix_hit_tokens == 39
    sib = Request("1_c", p, SamplingParams(n=2, prompt_logprobs=0), seed=0, group_id="c", index=1)
    assert sib.prompt_logprobs is None and sib.max_prefix_hit_tokens == 39


@pytest.fixture(scope="module")
def tiny_prompts(ckpt_dir):
    rng = np.random.default_rng(3)
    shared = rng.integers(3, 256, 24).tolist()
    prompts = [rng.integers(3, 256, int(k)).tolist() for k in (17, 22, 19, 30)]
    prompts += [shared + [7, 8, 9], shared + rng.integers(3, 256, 10).tolist()]
    return ckpt_dir("llama"), prompts


def _tiny(path, **kw):
    kw.setdefault("max_model_len", 128)
    kw.setdefault("max_num_seqs", 8)
    return LLM(path, dtype="float32", use_tqdm_on_load=False, **kw)


@pytest.fixture(scope="module")
def tiny_ref(tiny_prompts):
    """Uncached, unchunked prompt logprobs (each prompt in one step, no prefix cache)."""
    path, prompts = tiny_prompts
    llm = _tiny(path, enable_prefix_caching=False, max_num_batched_tokens=128, token_buckets=(8, 128))
    try:
        return [_plp(o) for o in _run(llm, prompts)]
    finally:
        llm.shutdown()


@pytest.mark.parametrize("case", ["chunked_prefill", "preemption", "row_chunks"])
def test_prompt_logprobs_across_modes(tiny_prompts, tiny_ref, case, monkeypatch):
    path, prompts = tiny_prompts
    if case == "row_chunks":  # the prompt-logprobs program over 16-row chunks of its 128-token step
        from jvllm.worker import programs

        monkeypatch.setattr(programs, "PROMPT_LP_CHUNK_ELEMS", 16 * 256)  # vocab 256
        llm = _tiny(path, enable_prefix_caching=False, max_num_batched_tokens=128, token_buckets=(8, 128))
    elif case == "chunked_prefill":  # 16-token chunks, prefix cache on, every prompt run twice
        llm = _tiny(path, max_num_batched_tokens=16, token_buckets=(8, 16))
    else:  # 12 usable blocks of 8 tokens: six prompts of 17-34 tokens generating 24 cannot all run
        llm = _tiny(path, num_gpu_blocks_override=13, block_size=8, max_model_len=96,
                    max_num_batched_tokens=128, token_buckets=(8, 128))
    try:
        outs = _run(llm, prompts, max_tokens=24, ignore_eos=True)
        again = _run(llm, prompts, max_tokens=2) if case == "chunked_prefill" else []
        stats = llm.get_stats()
        if case == "row_chunks":  # the engine's program took the patched budget (16-row chunks at T=128)
            assert llm.llm_engine.runner.jit_cache["prompt_lp"].__wrapped__.keywords["budget"] == 16 * 256
    finally:
        llm.shutdown()
    for o, ref in zip(outs, tiny_ref):
        np.testing.assert_allclose(_plp(o), ref, atol=1e-4)
    for o, ref in zip(again, tiny_ref):
        np.testing.assert_allclose(_plp(o), ref, atol=1e-4)
    if case == "preemption":
        assert stats["num_preemptions"] > 0
    assert stats["num_free_blocks"] == stats["num_blocks"] - 1


def test_prompt_lp_row_chunks_match_one_pass():
    """prompt_lp_body over padded row chunks gives each row what one pass over all rows gives."""
    import jax
    import jax.numpy as jnp

    from jvllm.models.layers import LMHead
    from jvllm.worker.programs import prompt_lp_body, prompt_lp_rows

    assert prompt_lp_rows(8192, 151936) == 256 and prompt_lp_rows(512, 49152) == 512
    assert prompt_lp_rows(100, 1000, budget=99_999) == 64 and prompt_lp_rows(5, 10**9) == 8
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    T, D, V = 50, 16, 300
    w, h = jax.random.normal(k1, (D, V)), jax.random.normal(k2, (T, D))
    t = jax.random.randint(k3, (T,), 0, V)
    head = LMHead(tied=False)
    one = prompt_lp_body(w, h, t, head=head, budget=T * V)
    chunked = jax.jit(lambda w, h, t: prompt_lp_body(w, h, t, head=head, budget=8 * V))(w, h, t)  # 7 chunks, 6 rows padded
    for a, b in zip(one, chunked):
        assert a.shape == b.shape
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
    assert np.array_equal(np.asarray(one[2]), np.asarray(chunked[2])) and jnp.all(one[1] == chunked[1])


def test_scheduler_caps_hits_to_recorded_prompt_logprobs():
    """A request recomputed after a preemption mid-prompt gets hits only over recorded positions."""
    from jvllm.memory.block_pool import KVCacheManager

    kv = KVCacheManager(16, 8)
    prompt = list(range(40))
    warm = Request("w", prompt, SamplingParams(), seed=0)
    assert kv.allocate_slots(warm, 40)
    kv.cache_full_blocks(warm, 40)
    kv.free(warm)  # 5 full blocks cached, free
    r = Request("r", prompt, SamplingParams(prompt_logprobs=0), seed=0)
    assert kv.get_computed_blocks(r, r.max_prefix_hit_tokens) == ([], 0)
    r.prompt_logprobs += [{}] * 19  # positions 0..18 recorded: blocks 0-1 (16 tokens) may be hits
    assert kv.get_computed_blocks(r, r.max_prefix_hit_tokens)[1] == 16
    assert kv.get_computed_blocks(Request("p", prompt, SamplingParams(), seed=0))[1] == 32  # all but the last
    with pytest.raises(ValueError, match="max_tokens must be >= 0, got -1"):
        kv.get_computed_blocks(r, -1)
