"""fp8 KV cache (`kv_cache_dtype="fp8"`, issue 21 item 3): the number format, every attention path
on fp8 pages, the pool's capacity, and engines under preemption, prefix caching, sleep, tensor and
pipeline parallelism. Real-model agreement: tests/test_kv_fp8_models.py."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jvllm import LLM, SamplingParams
from jvllm.memory import kv_cache
from jvllm.ops import kv_quant
from jvllm.ops.attention import example_metadata, paged_attention, pallas_decode_attention, write_kv
from jvllm.ops.kv_quant import QuantizedPages
from jvllm.ops.pallas_attention import ragged_paged_attention

SP = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


# ---------------------------------------------------------------------------- the format
def test_quantize_round_trip_within_e4m3_error():
    """Rows spanning 2^-20 .. 2^20 in scale: every element within half an e4m3 step of itself
    (relative 2^-4) or, below e4m3's normal range, within half its smallest subnormal of the
    scaled row; each scale is the smallest bfloat16 >= the row's max / 448, so the max maps to
    (448 (1 - 2^-7), 448]; zero rows stay 0."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 4, 32)) * np.exp2(rng.integers(-20, 21, (64, 4, 1)))
    x[3, 1] = 0.0
    x = jnp.asarray(x, jnp.float32)
    q, s = kv_quant.quantize(x)
    assert q.dtype == jnp.float8_e4m3fn and s.dtype == jnp.bfloat16 and q.shape == x.shape and s.shape == x.shape[:2]
    s32 = np.asarray(s, np.float32)
    amax = np.abs(np.asarray(x)).max(-1)
    nz = amax > 0
    ratio = amax[nz] / s32[nz]
    assert ratio.min() > 448 * (1 - 2.0 ** -7) and ratio.max() <= 448
    # the smallest bfloat16 at or above max / 448: one bfloat16 step down is below it
    below = (s32.view(np.uint32) - (1 << 16)).view(np.float32)
    assert np.all(amax[nz] / below[nz] > 448)
    # the row's max element is stored as +-448 exactly
    qa = np.abs(np.asarray(q, np.float32)).max(-1)
    assert np.all(qa[nz] == 448)
    d = np.asarray(kv_quant.dequantize(q, s))
    err = np.abs(d - np.asarray(x))
    bound = np.maximum(np.abs(np.asarray(x)) * 2.0 ** -4, s32[..., None] * 2.0 ** -10)
    assert np.all(err <= bound * (1 + 1e-6))
    assert not d[3, 1].any()
    # float32 dequantization is exact: an fp8 value times a bfloat16 scale
    assert np.array_equal(d, np.asarray(q, np.float64) * s32.astype(np.float64)[..., None])


def test_write_kv_quantizes_rows_into_their_slots():
    KH, NB, bs, D = 2, 6, 4, 8
    pages = QuantizedPages(jnp.zeros((KH, NB, bs, D), kv_quant.FP8), jnp.zeros((KH, NB, bs), kv_quant.SCALE_DTYPE))
    rng = np.random.default_rng(1)
    new = jnp.asarray(rng.standard_normal((3, KH, D)) * 5, jnp.float32)
    slots = jnp.asarray([5, 17, NB * bs], jnp.int32)  # the last is padding: dropped
    out = write_kv(pages, new, slots)
    q, s = kv_quant.quantize(new)
    data, scale = np.asarray(out.data, np.float32), np.asarray(out.scale, np.float32)
    for t, slot in enumerate([5, 17]):
        b, o = divmod(slot, bs)
        assert np.array_equal(data[:, b, o], np.asarray(q[t], np.float32))
        assert np.array_equal(scale[:, b, o], np.asarray(s[t], np.float32))
    assert np.count_nonzero(scale) == 2 * KH  # nothing else written
    assert out.nbytes == KH * NB * bs * (D + 2)


def test_kv_cache_dtype_values():
    assert kv_cache.resolve_dtype("auto", jnp.bfloat16) == jnp.bfloat16
    assert kv_cache.resolve_dtype("auto", jnp.float32) == jnp.float32
    assert kv_cache.resolve_dtype("fp8", jnp.bfloat16) == jnp.float8_e4m3fn
    assert kv_cache.resolve_dtype("fp8_e4m3", jnp.float32) == jnp.float8_e4m3fn
    for bad in ("fp8_e5m2", "int8", "bfloat16", None):
        with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of auto, fp8, fp8_e4m3; got " + repr(bad)):
            kv_cache.resolve_dtype(bad, jnp.float32)


def test_bad_kv_cache_dtype_fails_before_loading(ckpt_dir, monkeypatch):
    from jvllm import converters

    monkeypatch.setattr(converters, "load_checkpoint", lambda *a, **k: pytest.fail("loaded the weights first"))
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of auto, fp8, fp8_e4m3; got 'fp8_e5m2'"):
        LLM(ckpt_dir("llama"), kv_cache_dtype="fp8_e5m2", use_tqdm_on_load=False)


def test_cli_flag():
    import argparse

    from jvllm.cli import add_engine_args

    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert p.parse_args([]).kv_cache_dtype == "auto"
    assert p.parse_args(["--kv-cache-dtype", "fp8"]).kv_cache_dtype == "fp8"


# ---------------------------------------------------------------------------- attention paths
def _fp8_inputs(H, KH, D, bs, Qt, spans, T=48, R=8, W=16, NB=80, seed=0):
    """Metadata, q, fp8 pages and the same pages dequantized to float32 (the oracle's input)."""
    rng = np.random.default_rng(seed)
    md = example_metadata(spans, T=T, R=R, query_tile=Qt, block_size=bs, table_width=W, num_blocks=NB, seed=seed)
    q = jnp.asarray(rng.standard_normal((T, H, D)), jnp.float32)
    pages = []
    for _ in range(2):  # rows of very different ranges: per-token scales must follow them
        x = rng.standard_normal((KH, NB, bs, D)) * np.exp2(rng.integers(-6, 7, (KH, NB, bs, 1)))
        pages.append(QuantizedPages(*kv_quant.quantize(jnp.asarray(x, jnp.float32))))
    deq = [kv_quant.dequantize(p.data, p.scale) for p in pages]
    return md, q, pages, deq


CASES = [  # H, KH, D, block, Qt, window, softcap, spans (start, n)
    (8, 2, 32, 4, 8, None, None, [(0, 13), (5, 1), (20, 7), (0, 1)]),   # mixed: prefill, decode, continuation
    (9, 3, 16, 4, 8, None, None, [(3, 17), (40, 1)]),                  # G=3 (SmolLM2-like)
    (4, 4, 16, 8, 4, 6, 5.0, [(0, 30), (17, 1), (9, 5)]),              # sliding window + soft-cap
    (8, 2, 32, 4, 1, None, None, [(0, 1), (7, 1), (33, 1), (60, 1)]),  # decode-only tiles
]


@pytest.mark.parametrize("case", CASES, ids=["mixed", "g3", "window_softcap", "decode"])
def test_attention_on_fp8_pages_equals_attention_on_dequantized_pages(case):
    """The XLA reference and the ragged Pallas kernel (interpret mode; plain and split-K) read fp8
    pages as the reference reads the same pages dequantized to float32. Tolerance: rows scaled by
    up to 2^6 give scores in the hundreds, where folding the scale into the scores instead of the
    rows moves float32 results by ~1e-4 relative."""
    H, KH, D, bs, Qt, window, cap, spans = case
    md, q, (kq, vq), (kd, vd) = _fp8_inputs(H, KH, D, bs, Qt, spans)
    kw = dict(scale=D ** -0.5, window=window, softcap=cap)
    oracle = np.asarray(paged_attention(q, kd, vd, md, kv_chunk_blocks=4, **kw))
    valid = np.asarray(md.positions) >= 0
    outs = {"xla": paged_attention(q, kq, vq, md, kv_chunk_blocks=4, **kw),
            "ragged": ragged_paged_attention(q, kq, vq, md, interpret=True, pages_per_block=2, **kw),
            "ragged_split": ragged_paged_attention(q, kq, vq, md, interpret=True, pages_per_block=1, num_splits=3, **kw)}
    for name, out in outs.items():
        np.testing.assert_allclose(np.asarray(out)[valid], oracle[valid], atol=5e-4, rtol=5e-4, err_msg=name)


def test_pallas_decode_kernel_on_fp8_pages():
    """JAX's Pallas GPU decode kernel (interpret mode) takes the fp8 pages with their scales."""
    md, q, (kq, vq), (kd, vd) = _fp8_inputs(8, 2, 32, 4, 1, [(0, 1), (7, 1), (33, 1), (60, 1)], T=8, R=8)
    ref = np.asarray(paged_attention(q, kd, vd, md, scale=32 ** -0.5, kv_chunk_blocks=4))
    out = np.asarray(pallas_decode_attention(q, kq, vq, md, scale=32 ** -0.5, interpret=True))
    np.testing.assert_allclose(out[:4], ref[:4], atol=2e-5, rtol=2e-5)


# ---------------------------------------------------------------------------- capacity
def test_bytes_per_block_formula():
    from jvllm.config import ModelConfig

    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=128, hidden_size=256, intermediate_size=512,
                      num_layers=4, num_heads=4, num_kv_heads=2, head_dim=128)
    bf16 = kv_cache.bytes_per_block(cfg, jnp.bfloat16, 16)
    fp8 = kv_cache.bytes_per_block(cfg, jnp.float8_e4m3fn, 16)
    assert bf16 == 2 * 4 * 16 * 2 * 128 * 2 and fp8 == 2 * 4 * 16 * 2 * (128 + 2)
    assert kv_cache.bytes_per_block(cfg, jnp.float8_e4m3fn, 16, num_layers=2, tensor_parallel_size=2) == fp8 // 4


def test_fp8_pool_holds_twice_the_tokens(ckpt_dir):
    """Same KV byte budget, bfloat16 model: the fp8 pool holds 2 * 128 / (128 + 2) = 1.97x the
    tokens (head_dim 128); the runner allocates exactly bytes_per_block per block; the bench's
    memory table reports the pool's dtype and tokens."""
    from jvllm.bench import memory_report

    path = ckpt_dir("llama", head_dim=128)
    budget = 8 * 2**20  # bf16: 256 blocks, fp8: 504 (both under 32 x 512 tokens' 1025 blocks)
    got = {}
    for kv in ("auto", "fp8"):
        llm = LLM(path, dtype="bfloat16", max_model_len=512, max_num_seqs=32, max_num_batched_tokens=64,
                  token_buckets=(64,), kv_cache_memory_bytes=budget, kv_cache_dtype=kv, use_tqdm_on_load=False)
        try:
            e = llm.llm_engine
            per_block = e.kv_bytes_per_block()
            n = e.get_stats()["num_blocks"]
            pool = sum(a.nbytes for pair in e.runner.kv for a in pair)
            assert pool == n * per_block, (kv, pool, n, per_block)
            assert n == budget // per_block + 1  # the budget decides, not the cap of max_num_seqs x max_model_len
            mem = memory_report(llm)
            got[kv] = mem["kv_tokens"]
            assert mem["kv_cache_dtype"] == ("float8_e4m3fn" if kv == "fp8" else "bfloat16")
            assert mem["kv_tokens"] == (n - 1) * 16 and mem["kv_pool_bytes_global"] == pool
        finally:
            llm.shutdown()
    assert got["fp8"] / got["auto"] == pytest.approx(256 / 130, rel=0.01)


# ---------------------------------------------------------------------------- engines
def _prompts():
    rng = np.random.default_rng(2)
    shared = rng.integers(3, 256, 35).tolist()
    return [rng.integers(3, 256, int(k)).tolist() for k in rng.integers(20, 60, 6)] + \
        [shared + [5, 6], shared + [9, 9, 9]]


def _llm(path, **kw):
    kw = dict(dict(dtype="float32", max_model_len=96, max_num_batched_tokens=32, max_num_seqs=8,
                   token_buckets=(8, 32), block_size=8, use_tqdm_on_load=False, kv_cache_dtype="fp8"), **kw)
    return LLM(path, **kw)


def _greedy(llm, prompts):
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], SP, use_tqdm=False)]


@pytest.fixture(scope="module")
def fp8_ref(ckpt_dir):
    """fp8 KV, no prefix caching, a pool with room for everything: (path, prompts, tokens)."""
    path = ckpt_dir("llama")
    prompts = _prompts()
    llm = _llm(path, enable_prefix_caching=False, enable_sleep_mode=True)
    llm.llm_engine.wait_for_warmup()
    try:
        out = _greedy(llm, prompts)
        e = llm.llm_engine
        assert e.get_stats()["num_preemptions"] == 0
        # sleep / wake: the freed bytes are the pool's (pages and scales); same tokens afterwards
        pool = sum(a.nbytes for pair in e.runner.kv for a in pair)
        assert pool == e.get_stats()["num_blocks"] * e.kv_bytes_per_block()
        assert llm.sleep(level=1) == pool
        llm.wake_up()
        assert _greedy(llm, prompts) == out
        assert e.get_stats()["compiles_after_warmup"] == 0
    finally:
        llm.shutdown()
    return path, prompts, out


def test_tiny_model_logits_fp8_vs_f32_kv(fp8_ref):
    """One sequence's float32 logits with fp8 KV against float32 KV (same weights): within 0.05
    (this random model's logits span about +-1; e4m3 rows are within 2^-4 of themselves)."""
    path, prompts, _ = fp8_ref
    ids = prompts[0] + prompts[1]
    logits = {}
    for kv in ("auto", "fp8"):
        llm = _llm(path, kv_cache_dtype=kv)
        try:
            logits[kv] = llm.llm_engine.runner.sequence_logits(ids)
        finally:
            llm.shutdown()
    diff = np.abs(logits["fp8"] - logits["auto"]).max()
    assert 0 < diff < 0.05, diff
    assert np.mean(logits["fp8"].argmax(-1) == logits["auto"].argmax(-1)) >= 0.9


def test_preemption_and_prefix_cache_equal_plain_fp8_run(fp8_ref):
    """12 usable blocks of 8 tokens (preemption) with prefix caching, the prompts twice (the second
    time their full blocks come from the cache): the tokens of the plain fp8 run."""
    path, prompts, expected = fp8_ref
    llm = _llm(path, num_gpu_blocks_override=13)
    llm.llm_engine.wait_for_warmup()  # compiles count from the end of the background warm-up
    try:
        first = _greedy(llm, prompts)
        again = _greedy(llm, prompts)
        stats = llm.get_stats()
    finally:
        llm.shutdown()
    assert first == expected and again == expected
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hit_rate"] > 0.1
    assert stats["num_free_blocks"] == stats["num_blocks"] - 1 and stats["compiles_after_warmup"] == 0


@pytest.mark.parametrize("kw", [dict(tensor_parallel_size=2, pipeline_parallel_size=2),
                                dict(tensor_parallel_size=4, attention_backend="ragged_interpret")],
                         ids=["tp2pp2", "tp4_kv_replicated_ragged"])
def test_parallel_fp8_equals_one_device(fp8_ref, kw):
    """Tensor parallel (KV heads and their scales sharded; with 4 devices over 2 KV heads the
    pools are replicated and each device slices its head) and pipeline stages: the tokens of one
    device; every device holds its share of the pages and of the scales."""
    path, prompts, expected = fp8_ref
    llm = _llm(path, enable_prefix_caching=False, **kw)
    llm.llm_engine.wait_for_warmup()
    try:
        out = _greedy(llm, prompts)
        k = llm.llm_engine.runner.stages[0].kv[0][0]
        assert isinstance(k, QuantizedPages)
        assert k.data.sharding.spec[:1] == k.scale.sharding.spec[:1]
        assert len(k.scale.sharding.device_set) == kw["tensor_parallel_size"]
        assert llm.get_stats()["compiles_after_warmup"] == 0
    finally:
        llm.shutdown()
    assert out == expected
