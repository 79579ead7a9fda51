"""Speculative decoding (n-gram, k = 4) on the real SmolLM2 with input-grounded prompts (repeat or
edit a given text): greedy output token-identical to the shared engine without speculation (stop
strings and a structured-output request in the same batch), and the acceptance rate it reaches
(printed: the CPU figure quoted beside the GPU speed-ups)."""
from __future__ import annotations

import pytest

from jvllm import LLM, SamplingParams

TEXT = ("The quick brown fox jumps over the lazy dog. The dog did not move, because it was asleep in the warm "
        "afternoon sun, and the fox ran back into the forest before the farmer could see it.")
PROMPTS = [
    f"Repeat the following text exactly.\nText: {TEXT}\nRepeated text:",
    f"Rewrite the following text in the past tense, changing nothing else.\nText: {TEXT.replace('jumps', 'jump')}\n"
    f"Rewritten text:",
    f"Copy this sentence word for word: {TEXT[:90]}\nCopy:",
]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


@pytest.fixture(scope="module")
def spec_llm():
    llm = LLM("smollm2", dtype="float32", max_model_len=512, max_num_batched_tokens=64, max_num_seqs=8,
              token_buckets=(8, 16, 32, 64), use_tqdm_on_load=False, speculative_config=NGRAM)
    yield llm
    llm.shutdown()


def test_smollm2_ngram_identical_and_acceptance(spec_llm, smollm2_llm):
    sp = SamplingParams(max_tokens=48, temperature=0.0)
    want = [o.outputs[0].token_ids for o in smollm2_llm.generate(PROMPTS, sp, use_tqdm=False)]
    s0 = spec_llm.llm_engine.get_stats()
    got = [o.outputs[0].token_ids for o in spec_llm.generate(PROMPTS, sp, use_tqdm=False)]
    s1 = spec_llm.llm_engine.get_stats()
    assert [list(x) for x in got] == [list(x) for x in want]
    n = s1["spec_num_draft_tokens"] - s0["spec_num_draft_tokens"]
    acc = s1["spec_num_accepted_tokens"] - s0["spec_num_accepted_tokens"]
    drafts = s1["spec_num_drafts"] - s0["spec_num_drafts"]
    steps = s1["num_steps"] - s0["num_steps"]
    print(f"\nSmolLM2 n-gram k=4 on input-grounded prompts: acceptance {acc}/{n} = {acc / max(n, 1):.3f}, "
          f"mean accepted length {1 + acc / max(drafts, 1):.2f}, {steps} steps for "
          f"{sum(len(x) for x in got)} tokens")
    assert n > 0  # the prompts repeat their text: n-gram matches are certain
    assert acc > 0


def test_smollm2_ngram_stop_strings_and_structured_rows(spec_llm, smollm2_llm):
    pytest.importorskip("llguidance")
    from jvllm import StructuredOutputsParams

    params = [SamplingParams(max_tokens=48, temperature=0.0, stop=["lazy", "forest"]),
              SamplingParams(max_tokens=12, temperature=0.0,
                             structured_outputs=StructuredOutputsParams(choice=["yes", "no", "maybe"])),
              SamplingParams(max_tokens=30, temperature=0.0, stop=[" fox"], include_stop_str_in_output=True)]
    want = smollm2_llm.generate(PROMPTS, params, use_tqdm=False)
    got = spec_llm.generate(PROMPTS, params, use_tqdm=False)
    for w, g in zip(want, got):
        assert list(g.outputs[0].token_ids) == list(w.outputs[0].token_ids)
        assert g.outputs[0].text == w.outputs[0].text and g.outputs[0].finish_reason == w.outputs[0].finish_reason
    assert got[1].outputs[0].text in ("yes", "no", "maybe")
