"""The batched engine against transformers' greedy generation, token for token: the real SmolLM2
and random checkpoints of each family, under preemption, chunked prefill and prefix-cache hits."""
import numpy as np
import pytest

from jvllm import LLM, SamplingParams
from tests.helpers import hf_greedy, hf_model

N_NEW = 12


def _prompts(rng, vocab, n=5, lo=3, hi=40):
    return [rng.integers(3, vocab, int(k)).tolist() for k in rng.integers(lo, hi, n)]


def _greedy(llm, prompts, n_new=N_NEW):
    sp = SamplingParams(max_tokens=n_new, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _small_llm(path, **kw):
    kw.setdefault("max_model_len", 128)
    kw.setdefault("max_num_batched_tokens", 32)
    kw.setdefault("max_num_seqs", 8)
    kw.setdefault("token_buckets", (8, 32))
    return LLM(path, dtype="float32", use_tqdm_on_load=False, **kw)


def test_smollm2_greedy_matches_transformers(smollm2_llm, smollm2_hf_dir):
    tok = smollm2_llm.get_tokenizer()
    texts = ["The capital of France is", "def add(a, b):", "Water boils at", "My favourite colour is"]
    prompts = [tok(t)["input_ids"] for t in texts]
    ours = _greedy(smollm2_llm, prompts, 16)
    ref = hf_model(smollm2_hf_dir)
    for p, o in zip(prompts, ours):
        assert o == hf_greedy(ref, p, 16)
    assert smollm2_llm.get_stats()["num_free_blocks"] == smollm2_llm.get_stats()["num_blocks"] - 1


@pytest.mark.parametrize("arch", ["llama3", "mistral", "qwen2", "qwen3", "smollm2"])
def test_family_greedy_batched(ckpt_dir, arch):
    path = ckpt_dir(arch)
    prompts = _prompts(np.random.default_rng(1), 256, n=4, lo=3, hi=30)
    llm = _small_llm(path)
    try:
        assert llm.get_tokenizer() is None  # no tokenizer files: detected automatically
        ours = _greedy(llm, prompts)
        outs = llm.generate({"prompt_token_ids": prompts[0]}, SamplingParams(max_tokens=2), use_tqdm=False)
        assert outs[0].outputs[0].text == ""
    finally:
        llm.shutdown()
    ref = hf_model(path)
    for p, o in zip(prompts, ours):
        assert o == hf_greedy(ref, p, N_NEW), (arch, p)


@pytest.fixture(scope="module")
def llama_ref(ckpt_dir):
    path = ckpt_dir("llama")
    rng = np.random.default_rng(2)
    shared = rng.integers(3, 256, 35).tolist()
    prompts = _prompts(rng, 256, n=6, lo=20, hi=60) + [shared + [5, 6], shared + [9, 9, 9]]
    ref = hf_model(path)
    return path, prompts, [hf_greedy(ref, p, N_NEW) for p in prompts]


@pytest.mark.parametrize("case", ["preemption", "chunked_prefill", "bucket_cuts", "prefix_cache", "no_prefix_cache"])
def test_engine_modes_match_transformers(llama_ref, case, monkeypatch):
    path, prompts, expected = llama_ref
    kw = {}
    if case == "bucket_cuts":  # every program costs its tokens: prefill chunks cut at bucket edges
        monkeypatch.setattr("jvllm.engine.llm_engine.FLAT_TOKENS", 0)
        kw = dict(max_num_batched_tokens=64, token_buckets=(8, 16, 32, 64), max_num_seqs=4, fit_chunks_to_buckets=True)
    if case == "preemption":  # 12 usable blocks of 8 tokens: 8 requests of up to 70 tokens cannot all run
        kw = dict(num_gpu_blocks_override=13, block_size=8, max_model_len=96)
    elif case == "chunked_prefill":
        kw = dict(max_num_batched_tokens=16, token_buckets=(8, 16), max_num_seqs=4)
    elif case == "no_prefix_cache":
        kw = dict(enable_prefix_caching=False)
    llm = _small_llm(path, **kw)
    llm.llm_engine.wait_for_warmup()
    try:
        ours = _greedy(llm, prompts)
        if case == "prefix_cache":
            again = _greedy(llm, prompts)  # every prompt's full blocks now come from the cache
            assert again == ours
        stats = llm.get_stats()
    finally:
        llm.shutdown()
    assert ours == expected
    assert stats["num_free_blocks"] == stats["num_blocks"] - 1  # no leaks
    if case == "preemption":
        assert stats["num_preemptions"] > 0
    assert (stats["num_bucket_cuts"] > 0) == (case == "bucket_cuts")
    if case == "prefix_cache":
        assert stats["prefix_cache_hit_rate"] > 0.3
    if case == "no_prefix_cache":
        assert stats["prefix_cache_hit_rate"] == 0.0
    assert stats["compiles_after_warmup"] == 0


def test_bad_engine_options_fail_before_loading(ckpt_dir, monkeypatch):
    from jvllm import converters

    path = ckpt_dir("llama")
    monkeypatch.setattr(converters, "load_checkpoint", lambda *a, **k: pytest.fail("loaded the weights first"))
    with pytest.raises(ValueError, match=r"async_scheduling needs an engine that is not a data-parallel replica .*data-parallel device slice"):
        _small_llm(path, async_scheduling=True, data_parallel_size=2)
    with pytest.raises(ValueError, match=r"attention_backend must be auto or one of xla, .* got 'flash'"):
        _small_llm(path, attention_backend="flash")


def test_max_model_len_beyond_the_config_fails_before_loading(ckpt_dir, monkeypatch):
    """max_model_len over what the checkpoint's config allows fails from config.json alone."""
    import time

    from jvllm import converters

    monkeypatch.setattr(converters, "load_checkpoint", lambda *a, **k: pytest.fail("loaded the weights first"))
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=r"max_model_len \(100000\) exceeds the model's max_position_embeddings \(\d+\)"):
        _small_llm(ckpt_dir("llama"), max_model_len=100000)
    assert time.perf_counter() - t0 < 20  # no weights, no compiles (a few ms on the CPU)


def test_request_that_can_never_fit_is_rejected_at_start(ckpt_dir):
    with pytest.raises(ValueError, match=r"max_model_len \(128\) needs 8 KV blocks of 16 tokens but the pool has 3"):
        _small_llm(ckpt_dir("llama"), num_gpu_blocks_override=4)


def test_pallas_kernels_match_xla(llama_ref):
    """Decode steps through JAX's Pallas paged-attention kernel and mixed steps (prefill chunks,
    continuations, decodes together) through jvllm's ragged kernel, interpret mode on the CPU."""
    path, prompts, expected = llama_ref
    llm = _small_llm(path, attention_backend="pallas_interpret", token_buckets=(8, 32), max_num_seqs=8)
    try:
        assert _greedy(llm, prompts[:3], 6) == [e[:6] for e in expected[:3]]
    finally:
        llm.shutdown()


@pytest.mark.parametrize("arch,backend", [("mistral", "ragged_interpret"), ("qwen3", "ragged_split_interpret")])
def test_ragged_kernel_engine_matches_transformers(ckpt_dir, arch, backend):
    """Every step (decode-only too) through the ragged kernel: sliding windows (mistral), qk-norm
    (qwen3, decode steps split-K), chunked prefill with a 16-token budget so continuations attend
    to cached pages."""
    path = ckpt_dir(arch)
    prompts = _prompts(np.random.default_rng(3), 256, n=3, lo=10, hi=40)
    llm = _small_llm(path, attention_backend=backend, max_num_batched_tokens=16, token_buckets=(8, 16))
    try:
        ours = _greedy(llm, prompts, 6)
    finally:
        llm.shutdown()
    ref = hf_model(path)
    for p, o in zip(prompts, ours):
        assert o == hf_greedy(ref, p, 6), (arch, p)


def test_memory_sizing_from_device_stats(ckpt_dir, monkeypatch):
    """The accelerator sizing rule (utilization x limit - weights - XLA's activation peak of the
    largest step), exercised on the CPU with fake allocator stats."""
    from jvllm.memory import sizing as eng_mod

    limit, used = 64 * 2**20, 4 * 2**20
    monkeypatch.setattr("jvllm.memory.device._claimed", None)  # JAX's own pool: utilization applies inside it
    monkeypatch.setattr(eng_mod, "device_memory_stats", lambda: dict(bytes_limit=limit, bytes_in_use=used))
    llm = _small_llm(ckpt_dir("llama"), max_num_seqs=32, max_model_len=512, gpu_memory_utilization=0.5)
    try:
        eng = llm.llm_engine
        per_block = eng.kv_bytes_per_block()
        n = eng.runner.num_blocks
        assert 2 < n < (0.5 * limit - used) // per_block + 1, (n, per_block)
        assert _greedy(llm, [[5, 6, 7]], 3)[0] and len(_greedy(llm, [[5, 6, 7]], 3)[0]) == 3
    finally:
        llm.shutdown()


def test_async_scheduling_matches_sync(ckpt_dir):
    """Dispatching step N+1 before reading step N (pending tokens fed on the device) gives exactly
    the outputs of the synchronous loop: greedy and seeded sampling, n > 1, logprobs, EOS-like stop
    ids and stop strings hit mid-flight, max_tokens of 1, and a pool too small for all requests."""
    from jvllm.worker.model_runner import ModelRunner

    path = ckpt_dir("llama", tokenizer=True)
    rng = np.random.default_rng(5)
    prompts = _prompts(rng, 2000, n=6, lo=5, hi=40)

    def run(async_on, params_list):
        llm = _small_llm(path, async_scheduling=async_on, num_gpu_blocks_override=20, block_size=8, max_model_len=96)
        llm.llm_engine.wait_for_warmup()
        ahead = []
        orig = ModelRunner.dispatch
        llm.llm_engine.runner.dispatch = lambda sched, prev=None: (ahead.append(prev is not None), orig(llm.llm_engine.runner, sched, prev))[1]
        try:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params_list, use_tqdm=False)
            st = llm.get_stats()
        finally:
            llm.shutdown()
        assert st["num_free_blocks"] == st["num_blocks"] - 1
        return [[(c.token_ids, c.text, c.finish_reason,
                  [sorted((k, round(v.logprob, 4)) for k, v in e.items()) for e in (c.logprobs or [])])
                 for c in o.outputs] for o in outs], sum(ahead), st

    greedy = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)
    base, _, _ = run(False, greedy)
    stop_id = base[0][0][0][5]           # a token request 0 produces mid-way
    stop_str = base[1][0][1][4:7]        # a piece of request 1's text
    params = [
        SamplingParams(max_tokens=14, temperature=0.0, stop_token_ids=[stop_id]),
        SamplingParams(max_tokens=14, temperature=0.0, stop=[stop_str] if stop_str.strip() else None, logprobs=3),
        SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=11),
        SamplingParams(max_tokens=9, temperature=1.0, top_k=20, seed=3, n=2),
        SamplingParams(max_tokens=1, temperature=0.0),
        SamplingParams(max_tokens=13, temperature=0.7, seed=5, logprobs=2),
    ]
    sync_out, sync_ahead, _ = run(False, params)
    async_out, async_ahead, st = run(True, params)
    assert sync_ahead == 0 and async_ahead > 5, (sync_ahead, async_ahead)
    assert async_out == sync_out
    assert async_out[0][0][2] == "stop" and async_out[0][0][0][-1] == stop_id
    assert st["compiles_after_warmup"] == 0
