"""Structured outputs under the async loop, preemption and warm-up, on the real SmolLM2:

- the async loop dispatches a constrained step `late` (forward first, sampler after the step
  before is read and the grammars advanced) and its outputs equal the sync loop's;
- a request preempted (a small KV pool) resumes with its grammar state intact: the outputs
  validate and equal the ones of the same requests run without preemption;
- the background warm-up compiles the masked sampler variants, so constrained batches compile
  nothing afterwards."""
from __future__ import annotations

import dataclasses

import json
import re

import pytest

from jvllm import SamplingParams, StructuredOutputsParams
from jvllm.engine.loop import AsyncLoop, make_loop

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {"type": "object",
          "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                         "tags": {"type": "array", "items": {"enum": ["red", "blue", "green"]}, "maxItems": 3},
                         "name": {"type": "string", "maxLength": 12}},
          "required": ["id", "tags", "name"], "additionalProperties": False}
REGEX = r"[a-z]+( [0-9]+){1,6}"


def _so(**kw):
    return StructuredOutputsParams(**kw)


def _texts(outs):
    return [[(c.text, c.finish_reason, tuple(c.token_ids)) for c in o.outputs] for o in outs]


def _sync_outputs(llm, prompts, params):
    """The same generate through the sync loop (swapped in for this call only)."""
    e = llm.llm_engine
    loop, e.loop = e.loop, make_loop(e, False, 1)
    try:
        return _texts(llm.generate(prompts, params, use_tqdm=False))
    finally:
        e.loop = loop


def _check(outs, params):
    for o, p in zip(outs, params):
        for text, fr, _ in o:
            so = p.structured_outputs
            if so is None:
                continue
            if so.json is not None and fr == "stop":
                jsonschema.validate(json.loads(text), SCHEMA)
            elif so.regex is not None and fr == "stop":
                assert re.fullmatch(REGEX, text), text
            elif so.choice is not None:
                assert text in so.choice, text


def test_late_sampling_matches_sync(smollm2_llm):
    """Sampled constrained rows (n=2, a regex, a choice) beside a greedy unconstrained row in one
    batch, then a batch with penalties (their history is host state too): the async loop takes
    the late path and its tokens equal the sync loop's (same seeds: the sampler's counter must
    not count the step's own pending token)."""
    e = smollm2_llm.llm_engine
    assert isinstance(e.loop, AsyncLoop)
    prompts = ["A record:", "The capital of France is", "Word and numbers:", "Yes or no?"]
    params = [SamplingParams(max_tokens=40, temperature=0.9, seed=7, n=2, structured_outputs=_so(json=SCHEMA)),
              SamplingParams(max_tokens=12, temperature=0.0),
              SamplingParams(max_tokens=20, temperature=0.8, seed=1, structured_outputs=_so(regex=REGEX)),
              SamplingParams(max_tokens=6, temperature=1.0, seed=2, structured_outputs=_so(choice=["yes", "no"]))]
    late0, ov0 = e.stats["num_late_steps"], e.stats["overlap_host_seconds"]
    got = _texts(smollm2_llm.generate(prompts, params, use_tqdm=False))
    assert e.stats["num_late_steps"] - late0 >= 10  # the late path ran (not a sync fallback)
    assert e.stats["overlap_host_seconds"] > ov0
    assert e.runner.timers["late_sampling_s"] > 0
    _check(got, params)
    assert got == _sync_outputs(smollm2_llm, prompts, params)
    pen = [SamplingParams(max_tokens=12, temperature=0.7, seed=3, repetition_penalty=1.3, presence_penalty=0.5)]
    late0 = e.stats["num_late_steps"]
    got = _texts(smollm2_llm.generate(["Once upon a time"], pen, use_tqdm=False))
    assert e.stats["num_late_steps"] - late0 >= 5
    assert got == _sync_outputs(smollm2_llm, ["Once upon a time"], pen)


def test_late_step_read_before_sampler_is_refused(smollm2_llm):
    """The runner's contract: a late handle's samplers must be launched before it is read."""
    from types import SimpleNamespace

    from jvllm.worker.executors import Pending
    from jvllm.worker.model_runner import DispatchedStep, _not_sampled

    r = smollm2_llm.llm_engine.runner
    h = DispatchedStep(1, [Pending([(0, SimpleNamespace())], resolve=_not_sampled)], late=[])
    with pytest.raises(RuntimeError, match="before launch_sampling"):
        r.collect(h)


@pytest.fixture(scope="module")
def small_pool_llm():
    """SmolLM2 with a KV pool of 9 blocks of 8 tokens (8 usable, one max_model_len): four requests of up to 60 tokens
    cannot all stay resident, so the scheduler preempts."""
    from jvllm import LLM

    llm = LLM("smollm2", dtype="float32", max_model_len=64, max_num_batched_tokens=32, max_num_seqs=4,
              token_buckets=(8, 32), block_size=8, num_gpu_blocks_override=9, use_tqdm_on_load=False,
              warmup="all")  # the masked variants' warm-up is under test
    llm.llm_engine.wait_for_warmup()
    yield llm
    llm.shutdown()


def test_masked_variants_warmed_and_preemption_keeps_grammar(small_pool_llm):
    from jvllm.compilation.counter import compile_count

    llm = small_pool_llm
    e = llm.llm_engine
    compiled = e.worker.compiled_programs()
    samples = [k for (kind, k) in compiled if kind == "sample" and not k[1].mask]  # unmasked variants
    assert samples and all(("sample", (R, dataclasses.replace(v, mask=True))) in compiled for R, v in samples)
    prompts = ["Record one:", "Record two:", "Numbers:", "Record three:"]
    params = [SamplingParams(max_tokens=56, temperature=0.8, seed=11 + i,
                             structured_outputs=_so(regex=REGEX) if i == 2 else _so(json=SCHEMA))
              for i in range(4)]
    c0 = compile_count()
    alone = [_texts(llm.generate([p], [sp], use_tqdm=False))[0] for p, sp in zip(prompts, params)]
    assert e.scheduler.num_preemptions == 0
    together = _texts(llm.generate(prompts, params, use_tqdm=False))
    assert e.scheduler.num_preemptions > 0, "the pool was meant to force a preemption"
    assert compile_count() == c0, "a constrained batch compiled after the warm-up"
    _check(together, params)
    assert sum(fr == "stop" for o in together for _, fr, _ in o) >= 2  # some outputs end where the grammar does
    assert together == alone
