"""Batch-invariant mode (issue 23 item 6, jvllm.worker.batch_invariant): one request's tokens and
logprobs bit-equal alone, in batches of other compositions, chunked differently, and with its
prefix from the prefix cache."""
import numpy as np
import pytest

from jvllm import LLM, SamplingParams
from jvllm.compilation import compile_count
from jvllm.engine.engine_config import EngineConfig
from jvllm.worker.batch_invariant import StepVariants, step_buckets

RNG = np.random.default_rng(7)
TARGET = [int(x) for x in RNG.integers(3, 250, 37)]       # 3 KV chunks of 16 tokens once decoded
OTHERS = [[int(x) for x in RNG.integers(3, 250, n)] for n in (27, 5, 90, 13, 3)]
N_OUT = 8


@pytest.fixture(scope="module")
def inv(ckpt_dir):
    # kv_chunk_blocks=1: 16-key attention chunks, so contexts span several chunks and a neighbour's
    # longer context adds chunks to the attention loop; budget 32 chunks the 37-token prompt
    llm = LLM(ckpt_dir("llama"), dtype="float32", max_model_len=128, max_num_batched_tokens=32, max_num_seqs=8,
              kv_chunk_blocks=1, batch_invariant=True, use_tqdm_on_load=False, background_compile=False)
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
    """fn()'s result and the (start, size) chunks TARGET's prompt was computed in."""
    sched = llm.llm_engine.scheduler
    chunks, orig = [], sched.schedule

    def spy(*a, **kw):
        out = orig(*a, **kw)
        chunks.extend((s.start, s.num_tokens) for s in out.scheduled
                      if s.req.prompt_token_ids == TARGET and s.start < len(TARGET))
        return out

    sched.schedule = spy
    try:
        return fn(), chunks
    finally:
        del sched.schedule


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_bit_equal_across_batches_and_chunkings(inv, temperature):
    tp = _params(temperature)
    _cold(inv)
    alone = _run(inv, [TARGET], tp)
    assert alone[3] == 0 and len(alone[0]) == N_OUT
    batches = [
        [TARGET, OTHERS[1]],                        # a small neighbour
        [OTHERS[0], TARGET],                        # 27 tokens first: TARGET gets 5 prompt tokens in step 1
        [OTHERS[2], OTHERS[1], TARGET, OTHERS[3]],  # a 90-token neighbour: more KV chunks, other splits
        OTHERS[3:] + [TARGET] + OTHERS[:2],
    ]
    sampled = SamplingParams(max_tokens=5, temperature=1.0, top_p=0.9, seed=3, ignore_eos=True, logprobs=2)
    chunkings = set()
    for i, b in enumerate(batches):
        _cold(inv)
        got, chunks = _prompt_chunks(inv, lambda: _run(inv, b, tp, sampled if i % 2 else None))
        chunkings.add(tuple(chunks))
        assert got[3] == 0 and sum(n for _, n in chunks) == len(TARGET)
        assert got[:3] == alone[:3], f"batch {i} (prompt chunks {chunks}) changed the target's tokens or logprobs"
    assert len(chunkings) >= 3, chunkings  # the prompt really was cut in different places


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


def test_one_step_program_and_no_compile_while_serving(inv):
    r = inv.llm_engine.runner
    assert r.token_buckets == (32,) and not r.layout.has_decode_variant(32)
    kinds = {k for k, _ in r.programs.keys()}
    assert "greedy" not in {k for k, _ in r.warmup_keys()[0] + r.warmup_keys()[1]} and "step" in kinds
    before = compile_count()
    _run(inv, [TARGET, OTHERS[1], OTHERS[4]], SamplingParams(max_tokens=3, ignore_eos=True))
    assert compile_count() == before


def test_modes_decided_once():
    assert StepVariants.for_mode(False) == StepVariants(True, True)
    assert StepVariants.for_mode(True) == StepVariants(decode_variants=False, greedy_program=False)
    assert step_buckets(False, None, (8, 16, 32)) == (8, 16, 32)
    assert step_buckets(True, None, (8, 16, 32)) == (32,)
    assert step_buckets(True, (64,), (64,)) == (64,)
    with pytest.raises(ValueError, match=r"batch_invariant=True runs one token bucket .*token_buckets=\(8, 32\)"):
        EngineConfig(batch_invariant=True, token_buckets=(32, 8))
    with pytest.raises(ValueError, match="token_buckets"):
        LLM("smollm2", batch_invariant=True, token_buckets=(8, 16))


def test_cli_flag():
    import argparse

    from jvllm.cli import add_engine_args, engine_kwargs

    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_kwargs(p.parse_args(["--batch-invariant"]))["batch_invariant"] is True
    assert engine_kwargs(p.parse_args([]))["batch_invariant"] is False
