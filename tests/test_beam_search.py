"""LLM.beam_search (vLLM's algorithm on the engine's generate with logprobs) against transformers'
num_beams search on a tiny random checkpoint, and the algorithm's rules on a hand-made table."""
import collections

import numpy as np
import pytest

from jvllm import LLM, BeamSearchParams, SamplingParams
from jvllm import sampling_params as sp_module
from jvllm.beam_search import BeamSearchInstance, beam_score
from jvllm.outputs import Logprob
from tests.helpers import hf_greedy, hf_model

T = 8


def _llm(path):
    return LLM(path, dtype="float32", max_model_len=128, max_num_batched_tokens=64, max_num_seqs=32,
               token_buckets=(8, 64), use_tqdm_on_load=False)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(3, 256, n).tolist() for n in (5, 12, 20)]


@pytest.fixture(scope="module")
def tiny(ckpt_dir):
    path = ckpt_dir("llama")
    llm = _llm(path)
    yield path, llm
    llm.shutdown()


def _hf_beams(model, prompt, k, lp, T, eos=None, early_stopping="never"):
    import torch

    kw = dict(eos_token_id=None, min_new_tokens=T) if eos is None else {}
    with torch.no_grad():
        g = model.generate(torch.tensor([prompt]), do_sample=False, num_beams=k, num_return_sequences=k,
                           max_new_tokens=T, pad_token_id=0, length_penalty=lp, early_stopping=early_stopping,
                           output_scores=True, return_dict_in_generate=True, **kw)
    seqs = []
    for s in g.sequences:
        s = s[len(prompt):].tolist()
        if eos is not None and eos in s:
            s = s[:s.index(eos) + 1]
        seqs.append(s)
    return seqs, g.sequences_scores.tolist()


def test_exports():
    import jvllm

    assert jvllm.BeamSearchParams is sp_module.BeamSearchParams is BeamSearchParams


@pytest.mark.parametrize("k", [2, 3, 4])
@pytest.mark.parametrize("lp", [1.0, 0.0, -0.5])
def test_matches_transformers_num_beams(tiny, prompts, k, lp):
    path, llm = tiny
    ref = hf_model(path)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts],
                           BeamSearchParams(beam_width=k, max_tokens=T, ignore_eos=True, length_penalty=lp))
    for p, o in zip(prompts, outs):
        seqs, scores = _hf_beams(ref, p, k, lp, T)
        assert [b.output_token_ids for b in o.sequences] == seqs
        # transformers' score divides by the generated length: compare the cumulative logprobs
        np.testing.assert_allclose([b.cum_logprob for b in o.sequences], np.array(scores) * T ** lp, atol=1e-4)
        assert all(b.tokens[:len(p)] == p and b.finish_reason == "length" and len(b.logprobs) == T
                   for b in o.sequences)


def test_width_one_is_greedy_and_beams_share_blocks(tiny, prompts):
    path, llm = tiny
    ref = hf_model(path)
    pool = llm.llm_engine.kv_manager.pool
    h0, q0 = pool.prefix_hits, pool.prefix_queries
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts],
                           BeamSearchParams(beam_width=1, max_tokens=T, ignore_eos=True))
    greedy = llm.generate([{"prompt_token_ids": p} for p in prompts],
                          SamplingParams(max_tokens=T, temperature=0, ignore_eos=True), use_tqdm=False)
    for p, o, g in zip(prompts, outs, greedy):
        assert o.sequences[0].output_token_ids == g.outputs[0].token_ids == hf_greedy(ref, p, T)
    # every step's beams take their parents' full blocks from the prefix cache
    outs = llm.beam_search({"prompt_token_ids": prompts[2]}, BeamSearchParams(beam_width=3, max_tokens=T,
                                                                              ignore_eos=True))
    assert (pool.prefix_hits - h0) / (pool.prefix_queries - q0) > 0.4
    stats = llm.get_stats()
    assert stats["num_free_blocks"] == stats["num_blocks"] - 1


def test_max_model_len_finishes_beams(tiny):
    _, llm = tiny
    prompt = list(range(3, 123))  # 120 tokens of 128
    out = llm.beam_search({"prompt_token_ids": prompt}, BeamSearchParams(beam_width=2, max_tokens=20,
                                                                         ignore_eos=True))[0]
    assert all(len(b.tokens) == 128 and b.finish_reason == "length" for b in out.sequences)


def test_eos_finishes_beams(ckpt_dir, prompts):
    """With an EOS the model often ranks high: finished beams end in it; the best beam is
    transformers' at length_penalty 0 (other beams may differ: see jvllm.beam_search)."""
    ref0 = hf_model(ckpt_dir("llama"))
    counts = collections.Counter(t for p in prompts for t in hf_greedy(ref0, p, 10))
    eos = counts.most_common(1)[0][0]
    path = ckpt_dir("llama", eos_token_id=eos)  # same weights, that token as EOS
    ref = hf_model(path)
    llm = _llm(path)
    try:
        assert llm.llm_engine.eos_token_ids == (eos,)
        outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts],
                               BeamSearchParams(beam_width=3, max_tokens=10, length_penalty=0.0))
    finally:
        llm.shutdown()
    n_stopped = 0
    for p, o in zip(prompts, outs):
        seqs, _ = _hf_beams(ref, p, 3, 0.0, 10, eos=eos)
        assert o.sequences[0].output_token_ids == seqs[0]
        for b in o.sequences:
            gen = b.output_token_ids
            assert eos not in gen[:-1]
            assert (b.finish_reason, b.stop_reason) == (("stop", eos) if gen[-1] == eos else ("length", None))
            n_stopped += b.finish_reason == "stop"
    assert n_stopped > 0


def _lp(x):
    return Logprob(float(np.log(x)))


def test_algorithm_rules():
    """2 beams, EOS = 9: EOS candidates finish, the rest are ranked by vLLM's score."""
    params = BeamSearchParams(beam_width=2, max_tokens=3, length_penalty=1.0)
    inst = BeamSearchInstance([1, 2], params, eos_token_ids=(9,), max_model_len=100)
    inst.advance([{5: _lp(0.5), 9: _lp(0.3), 6: _lp(0.1), 7: _lp(0.05)}])
    assert [b.output_token_ids for b in inst.beams] == [[5], [6]]
    assert [b.output_token_ids for b in inst.completed] == [[9]]
    inst.advance([{7: _lp(0.6), 9: _lp(0.2), 3: _lp(0.1), 4: _lp(0.05)},
                  {8: _lp(0.9), 9: _lp(0.05), 3: _lp(0.02), 4: _lp(0.01)}])
    # a beam's EOS candidates finish even when they rank below the kept beams (vLLM, not transformers)
    assert sorted(b.output_token_ids for b in inst.completed) == [[5, 9], [6, 9], [9]]
    assert [b.output_token_ids for b in inst.beams] == [[5, 7], [6, 8]]
    out = inst.result(tokenizer=None).sequences
    scores = [beam_score(b.tokens, b.cum_logprob, {9}, 1.0) for b in out]
    assert scores == sorted(scores, reverse=True) and len(out) == 2
    # the score counts the prompt and not a final EOS
    assert beam_score([1, 2, 5, 9], -2.0, {9}, 1.0) == -2.0 / 3
    assert beam_score([1, 2, 5, 9], -2.0, (), 0.5) == -2.0 / 4 ** 0.5


@pytest.mark.parametrize("kw, msg", [
    (dict(beam_width=0, max_tokens=4), r"beam_width must be an integer in \[1, 10\]"),
    (dict(beam_width=11, max_tokens=4), r"beam_width must be an integer in \[1, 10\]"),
    (dict(beam_width=2, max_tokens=0), "max_tokens must be an integer >= 1"),
    (dict(beam_width=2, max_tokens=4, temperature=-1.0), r"temperature must be in \[0, 1e4\]"),
    (dict(beam_width=2, max_tokens=4, length_penalty=float("nan")), "length_penalty must be a finite float"),
    (dict(beam_width=2, max_tokens=4, ignore_eos="yes"), "ignore_eos must be True or False"),
])
def test_bad_params(kw, msg):
    with pytest.raises(ValueError, match=msg):
        BeamSearchParams(**kw)


def test_bad_call(tiny):
    _, llm = tiny
    with pytest.raises(TypeError, match="params must be a BeamSearchParams, got SamplingParams"):
        llm.beam_search([1, 2, 3], SamplingParams())
    with pytest.raises(ValueError, match="max_model_len is 128"):
        llm.beam_search({"prompt_token_ids": [5] * 128}, BeamSearchParams(beam_width=2, max_tokens=2))


def test_text_and_sampled_candidates(smollm2_llm):
    tok = smollm2_llm.get_tokenizer()
    prompt = "The capital of France is"
    out = smollm2_llm.beam_search([prompt], BeamSearchParams(beam_width=2, max_tokens=4))[0]
    assert len(out.sequences) == 2
    for b in out.sequences:
        assert b.text.startswith(prompt) and b.text == tok.decode(b.tokens[:-1] if b.finish_reason == "stop"
                                                                     else b.tokens)
        assert b.num_prompt_tokens == len(tok(prompt)["input_ids"])
    hot = smollm2_llm.beam_search(prompt, BeamSearchParams(beam_width=2, max_tokens=3, temperature=1.0))[0]
    assert len(hot.sequences) == 2 and all(len(b.logprobs) == len(b.output_token_ids) for b in hot.sequences)
    # each step's candidates: the top 2 * beam_width, and the sampled token when it is not among them
    assert all(4 <= len(c) <= 5 for b in hot.sequences for c in b.logprobs)


@pytest.mark.parametrize("keep", [False, True])
def test_include_stop_str_in_output(keep):
    class Tok:
        def decode(self, ids):
            return ",".join(map(str, ids))

    params = BeamSearchParams(beam_width=1, max_tokens=2, include_stop_str_in_output=keep)
    inst = BeamSearchInstance([1, 2], params, eos_token_ids=(9,), max_model_len=100)
    inst.advance([{9: _lp(0.9), 5: _lp(0.05)}])
    inst.advance([{6: _lp(0.01), 7: _lp(0.005)}])
    best = inst.result(Tok()).sequences[0]
    assert best.finish_reason == "stop" and best.text == ("1,2,9" if keep else "1,2")
