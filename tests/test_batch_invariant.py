"""Batch-invariant mode (issue 23 item 6, jvllm.worker.batch_invariant): one request's tokens and
logprobs bit-equal alone, in batches of other compositions, chunked differently, with its prefix
from the prefix cache, and with its steps in different token buckets (8, 16 and 32 here); the same
comparisons differ with the mode off."""
import numpy as np
import pytest

from jvllm import LLM, SamplingParams
from jvllm.compilation import compile_count
from jvllm.engine.engine_config import EngineConfig
from jvllm.models.layers import FIXED_TILE_DENSE, FixedTileDense, LMHead
from jvllm.sampling import SamplerVariant
from jvllm.worker.batch_invariant import StepVariants

RNG = np.random.default_rng(7)
TARGET = [int(x) for x in RNG.integers(3, 250, 37)]       # 3 KV chunks of 16 tokens once decoded
OTHERS = [[int(x) for x in RNG.integers(3, 250, n)] for n in (27, 5, 90, 13, 3)]
N_OUT = 8


BUCKETS = (8, 16, 32)
# wider than the default tiny model: XLA's CPU dot changes rows with M from [128, 512] up (K x N),
# so the mode-off engine really differs (tests/test_batch_invariant_matmul.py)
MODEL = dict(hidden_size=128, intermediate_size=512, num_attention_heads=8)


def _engine(ckpt_dir, batch_invariant: bool):
    # kv_chunk_blocks=1: 16-key attention chunks, so contexts span several chunks and a neighbour's
    # longer context adds chunks to the attention loop; budget 32 chunks the 37-token prompt
    return LLM(ckpt_dir("llama", **MODEL), dtype="float32", max_model_len=128, max_num_batched_tokens=32, max_num_seqs=8,
               token_buckets=BUCKETS, kv_chunk_blocks=1, batch_invariant=batch_invariant, use_tqdm_on_load=False,
               background_compile=False)


@pytest.fixture(scope="module")
def inv(ckpt_dir):
    llm = _engine(ckpt_dir, True)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def default(ckpt_dir):
    llm = _engine(ckpt_dir, False)
    yield llm
    llm.shutdown()


def _params(temperature: float) -> SamplingParams:
    return SamplingParams(max_tokens=N_OUT, temperature=temperature, seed=11, ignore_eos=True, logprobs=5,
                          prompt_logprobs=3)


def _run(llm, prompts, target_params, other_params=None):
    """(token ids, [(token, logprob) per top entry, per step], prompt logprobs, cached tokens) of TARGET
    inside a batch of `prompts` (which holds it once)."""
    other_params = other_params or SamplingParams(max_tokens=6, ignore_eos=True)
    sps = [target_params if p is TARGET else other_params for p in prompts]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sps, use_tqdm=False)
    o = outs[[i for i, p in enumerate(prompts) if p is TARGET][0]]
    c = o.outputs[0]
    lps = [[(t, lp.logprob, lp.rank) for t, lp in d.items()] for d in c.logprobs or ()]
    plps = [None if d is None else [(t, lp.logprob) for t, lp in d.items()] for d in o.prompt_logprobs or ()]
    return list(c.token_ids), lps, plps, o.num_cached_tokens


def _cold(llm):
    assert llm.llm_engine.kv_manager.pool.reset_prefix_cache()


def _prompt_chunks(llm, fn):
    """(fn()'s result, the (start, size) chunks TARGET's prompt was computed in, the token buckets
    of the steps TARGET was in)."""
    sched, layout = llm.llm_engine.scheduler, llm.llm_engine.runner.layout
    chunks, buckets, orig = [], [], sched.schedule

    def spy(*a, **kw):
        out = orig(*a, **kw)
        chunks.extend((s.start, s.num_tokens) for s in out.scheduled
                      if s.req.prompt_token_ids == TARGET and s.start < len(TARGET))
        if any(s.req.prompt_token_ids == TARGET for s in out.scheduled):
            buckets.append(layout.bucket(sum(s.num_tokens for s in out.scheduled)))
        return out

    sched.schedule = spy
    try:
        return (fn(), chunks, buckets)
    finally:
        del sched.schedule


BATCHES = [
    [TARGET, OTHERS[1]],                        # a small neighbour
    [OTHERS[0], TARGET],                        # 27 tokens first: TARGET gets 5 prompt tokens in step 1
    [OTHERS[2], OTHERS[1], TARGET, OTHERS[3]],  # a 90-token neighbour: more KV chunks, other splits
    OTHERS[3:] + [TARGET] + OTHERS[:2],
]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_bit_equal_across_batches_and_chunkings(inv, temperature):
    tp = _params(temperature)
    _cold(inv)
    alone, _, alone_buckets = _prompt_chunks(inv, lambda: _run(inv, [TARGET], tp))
    assert alone[3] == 0 and len(alone[0]) == N_OUT
    assert set(alone_buckets) == {8, 32}, alone_buckets  # 32 + 5 prompt tokens, then decode steps of bucket 8
    sampled = SamplingParams(max_tokens=5, temperature=1.0, top_p=0.9, seed=3, ignore_eos=True, logprobs=2)
    chunkings, buckets_seen = set(), set(alone_buckets)
    for i, b in enumerate(BATCHES):
        _cold(inv)
        got, chunks, buckets = _prompt_chunks(inv, lambda: _run(inv, b, tp, sampled if i % 2 else None))
        chunkings.add(tuple(chunks))
        buckets_seen |= set(buckets)
        assert got[3] == 0 and sum(n for _, n in chunks) == len(TARGET)
        assert got[:3] == alone[:3], (f"batch {i} (prompt chunks {chunks}, buckets {buckets}) changed the "
                                      f"target's tokens or logprobs")
    assert len(chunkings) >= 3, chunkings  # the prompt really was cut in different places
    assert buckets_seen == set(BUCKETS), buckets_seen  # and its steps ran in every bucket


def test_greedy_tokens_equal_from_argmax_and_full_sampler(inv, monkeypatch):
    """A greedy request without logprobs: alone (all-greedy batches: the argmax-only program) and
    beside sampled requests (the full sampler) gives the same tokens, and both programs ran."""
    from jvllm.worker import sampler

    programs, orig = [], sampler.plan

    def spy(sched, *a, **kw):
        out = orig(sched, *a, **kw)
        if any(s.req.prompt_token_ids == TARGET for s in sched):
            programs.append("greedy" if out is None else out.variant)
        return out

    monkeypatch.setattr(sampler, "plan", spy)
    tp = SamplingParams(max_tokens=N_OUT, temperature=0.0, ignore_eos=True)
    _cold(inv)
    alone = _run(inv, [TARGET], tp)
    assert set(programs) == {"greedy"}, programs
    sampled = SamplingParams(max_tokens=N_OUT, temperature=1.0, top_p=0.9, seed=3, ignore_eos=True)
    for b in BATCHES[:3]:
        programs.clear()
        _cold(inv)
        got = _run(inv, b, tp, sampled)
        assert got[0] == alone[0], f"batch {b and [len(p) for p in b]} changed the greedy target's tokens"
        assert SamplerVariant(3, True) in programs, programs  # steps beside the sampled neighbour


def test_bit_equal_with_prefix_cache_hit(inv):
    tp = _params(0.0)
    _cold(inv)
    cold = _run(inv, [TARGET, OTHERS[3]], tp)
    _cold(inv)
    inv.generate([{"prompt_token_ids": TARGET[:33]}], SamplingParams(max_tokens=1), use_tqdm=False)
    tp_hit = SamplingParams(max_tokens=N_OUT, temperature=0.0, ignore_eos=True, logprobs=5)
    hit = _run(inv, [OTHERS[1], TARGET], tp_hit)
    assert hit[3] == 32  # two 16-token blocks from the cache
    assert hit[:2] == cold[:2]


def test_mode_off_differs(default):
    """The same comparisons with the mode off: the target's logprobs change with its batch."""
    tp = _params(0.0)
    _cold(default)
    alone = _run(default, [TARGET], tp)
    changed = 0
    for b in BATCHES[1:3]:
        _cold(default)
        changed += _run(default, b, tp)[1:3] != alone[1:3]
    assert changed, "the default mode was batch-invariant on this model: the test above proves nothing"


def test_every_bucket_fixed_tile_and_no_compile_while_serving(inv):
    from flax import nnx

    r = inv.llm_engine.runner
    assert r.token_buckets == BUCKETS and not any(r.layout.has_decode_variant(T) for T in BUCKETS)
    first, rest = r.warmup_keys()
    assert ("greedy", r.layout.seq_bucket(BUCKETS[0])) in first  # all-greedy batches: argmax only
    assert {(key[-1].search, key[-1].logprobs) for kind, key in first + rest if kind == "sample"} == {(3, True)}  # the largest
    model = nnx.merge(r.stages[0].graphdef, r.stages[0].state)
    assert model.layers[0].self_attn.proj is FIXED_TILE_DENSE and model.layers[1].mlp.proj is FIXED_TILE_DENSE
    assert LMHead.of(r.cfg).fixed_tile
    # the suite warms the first programs only (JVLLM_WARMUP=first): one run compiles what this
    # batch needs, the same batch again (other prompt chunks: the prefix cache holds TARGET) none
    batch = [TARGET, OTHERS[1], OTHERS[4]]
    _run(inv, batch, SamplingParams(max_tokens=3, ignore_eos=True))
    before, had = compile_count(), set(r.programs.compiled())
    _run(inv, batch[::-1], SamplingParams(max_tokens=3, ignore_eos=True))
    assert compile_count() == before, set(r.programs.compiled()) - had


def test_fixed_tile_projection_and_head_match_xla():
    import jax.numpy as jnp

    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((5, 64)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((64, 4, 16)), jnp.float32)
    got = FIXED_TILE_DENSE("td,dhk->thk", x, w, None)
    np.testing.assert_allclose(got, jnp.einsum("td,dhk->thk", x, w), rtol=1e-5, atol=1e-5)
    o = FIXED_TILE_DENSE("thk,hkd->td", got, w.transpose(1, 2, 0), None)
    np.testing.assert_allclose(o, jnp.einsum("thk,hkd->td", got, w.transpose(1, 2, 0)), rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="not 'token"):
        FixedTileDense()("dt,dhk->thk", x.T, w, None)
    emb = jnp.asarray(rng.standard_normal((256, 64)), jnp.float32)
    for tied, wt in ((True, emb), (False, emb.T)):
        head = LMHead(tied, softcap=30.0, fixed_tile=True)
        np.testing.assert_allclose(head(wt, x), LMHead(tied, softcap=30.0)(wt, x), rtol=1e-5, atol=1e-5)


def test_modes_decided_once(ckpt_dir):
    assert StepVariants.for_mode(False) == StepVariants(decode_variants=True, full_sampler=False)
    assert StepVariants.for_mode(True) == StepVariants(decode_variants=False, full_sampler=True)
    assert EngineConfig(batch_invariant=True, token_buckets=(32, 8)).token_buckets == (32, 8)  # every bucket
    with pytest.raises(ValueError, match="batch_invariant=True with a mixture-of-experts model"):
        LLM(ckpt_dir("mixtral"), batch_invariant=True, use_tqdm_on_load=False)
    with pytest.raises(ValueError, match=r"batch_invariant=True with quantization \(fp8\)"):
        LLM(ckpt_dir("llama"), quantization="fp8", batch_invariant=True, use_tqdm_on_load=False)


def test_launch_is_one_configuration_for_query_tiles():
    """The mixed program's ragged-attention launch (every step in this mode) never depends on the
    number of tiles: no split-K, one key step (jvllm.ops.pallas_attention.launch_defaults)."""
    from jvllm.ops.pallas_attention import launch_defaults

    for Qt in (8, 16):
        assert {launch_defaults(nt, kh, Qt, 16) for nt in (2, 9, 40, 288, 4096) for kh in (1, 8)} == {(4, 2, 1)}


def test_cli_flag():
    import argparse

    from jvllm.cli import add_engine_args, engine_kwargs

    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_kwargs(p.parse_args(["--batch-invariant"]))["batch_invariant"] is True
    assert engine_kwargs(p.parse_args([]))["batch_invariant"] is False
