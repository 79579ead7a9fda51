"""Sampling: support sets, penalties against numpy, seeds, stop conditions, logprobs vs transformers."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jvllm import SamplingParams
from jvllm.sampling import SamplingBatch, SamplingExtras, apply_extras, sample

V = 32


def _sb(R, temperature=1.0, top_k=V, top_p=1.0, min_p=0.0, seeds=None, counter=0, want_lp=False):
    seeds = seeds if seeds is not None else list(range(R))
    return SamplingBatch(
        temperature=jnp.full((R,), temperature, jnp.float32), top_k=jnp.full((R,), top_k, jnp.int32),
        top_p=jnp.full((R,), top_p, jnp.float32), min_p=jnp.full((R,), min_p, jnp.float32),
        key_data=jnp.asarray([[0, s] for s in seeds], jnp.uint32), counter=jnp.full((R,), counter, jnp.int32),
        want_logprobs=jnp.asarray(want_lp))


_sample = jax.jit(sample)


def _support(logits_row, **kw):
    """Tokens drawn from 2000 independent keys for one logits row."""
    R = 2000
    logits = jnp.broadcast_to(jnp.asarray(logits_row, jnp.float32), (R, V))
    tok, _ = _sample(logits, _sb(R, **kw), None)
    return set(np.asarray(tok).tolist())


@pytest.fixture(scope="module")
def row():
    return np.random.default_rng(0).normal(0, 2, V).astype(np.float32)


def test_top_k_support(row):
    assert _support(row, top_k=5) == set(np.argsort(-row)[:5].tolist())


def test_top_p_support(row):
    p = np.exp(row - row.max())
    p /= p.sum()
    order = np.argsort(-p)
    k = int(np.searchsorted(np.cumsum(p[order]), 0.7) + 1)  # smallest set with mass >= 0.7
    assert _support(row, top_p=0.7) == set(order[:k].tolist())


def test_min_p_support(row):
    p = np.exp(row - row.max())
    p /= p.sum()
    assert _support(row, min_p=0.1) == set(np.nonzero(p >= 0.1 * p.max())[0].tolist())


def test_top_k_then_top_p(row):
    order = np.argsort(-row)[:4]
    p = np.exp(row[order] - row[order].max())
    p /= p.sum()
    k = int(np.searchsorted(np.cumsum(p), 0.8) + 1)
    assert _support(row, top_k=4, top_p=0.8) == set(order[:k].tolist())


def test_greedy_and_temperature_zero(row):
    logits = jnp.asarray(np.stack([row, -row]))
    tok, _ = _sample(logits, _sb(2, temperature=0.0), None)
    assert np.asarray(tok).tolist() == [int(np.argmax(row)), int(np.argmax(-row))]


def test_seed_is_per_row(row):
    """A row's draw depends on its seed and counter only, not on its neighbours."""
    logits = jnp.asarray(np.stack([row] * 4))
    a, _ = _sample(logits, _sb(4, seeds=[11, 12, 13, 14]), None)
    b, _ = _sample(logits[:1], _sb(1, seeds=[11]), None)
    c, _ = _sample(jnp.asarray(np.stack([row * 0.5, row])), _sb(2, seeds=[99, 11]), None)
    assert int(a[0]) == int(b[0]) == int(c[1])


def test_penalties_and_bias_match_numpy(rng):
    R, L = 3, 6
    logits = rng.normal(0, 3, (R, V)).astype(np.float32)
    hist = rng.integers(0, V, (R, L)).astype(np.int32)
    hist[2, 4:] = -1
    is_out = np.zeros((R, L), bool)
    is_out[:, 3:] = True
    rep, pres, freq = np.array([1.0, 1.3, 0.7], np.float32), np.array([0.0, 0.5, -0.5], np.float32), \
        np.array([0.2, 0.0, 1.0], np.float32)
    b_ids = np.full((R, 4), -1, np.int32)
    b_vals = np.zeros((R, 4), np.float32)
    b_ids[0, :2], b_vals[0, :2] = [3, 4], [5.0, -5.0]
    ex = SamplingExtras(*(jnp.asarray(a) for a in (rep, pres, freq, hist, is_out, b_ids, b_vals)))
    got = np.asarray(apply_extras(jnp.asarray(logits), ex))
    want = logits.copy()
    for r in range(R):
        toks = [t for t in hist[r] if t >= 0]
        outs = [t for t, o in zip(hist[r], is_out[r]) if t >= 0 and o]
        for t in set(toks):
            want[r, t] = want[r, t] / rep[r] if want[r, t] > 0 else want[r, t] * rep[r]
        for t in set(outs):
            want[r, t] -= freq[r] * outs.count(t) + pres[r]
        for t, v in zip(b_ids[r], b_vals[r]):
            if t >= 0:
                want[r, t] += v
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_logprobs_outputs(row):
    logits = jnp.asarray(np.stack([row, row[::-1].copy()]))
    tok, (lp, rank, top_ids, top_lp) = _sample(logits, _sb(2, temperature=0.0, want_lp=True), None)
    ref = jax.nn.log_softmax(logits, -1)
    np.testing.assert_allclose(np.asarray(lp), np.asarray(ref.max(-1)), rtol=1e-6)
    assert np.asarray(rank).tolist() == [1, 1]
    assert np.asarray(top_ids)[0, :3].tolist() == np.argsort(-row)[:3].tolist()


@pytest.mark.parametrize("field,value,msg", [
    ("temperature", -1.0, "temperature must be in"), ("top_p", 0.0, "top_p must be in"),
    ("top_k", -2, "top_k must be"), ("min_p", 1.5, "min_p must be in"), ("n", 0, "n must be"),
    ("max_tokens", 0, "max_tokens must be"), ("logprobs", 21, r"logprobs must be an integer in \[0, 20\]"),
    ("prompt_logprobs", -1, "prompt_logprobs must be"), ("presence_penalty", 3.0, "presence_penalty must be"),
    ("repetition_penalty", 0.0, "repetition_penalty must be"), ("seed", 2**63, "seed must be an integer within int64"),
    ("min_tokens", -1, "min_tokens must be"), ("stop", [""], "stop must be"),
])
def test_invalid_params(field, value, msg):
    with pytest.raises(ValueError, match=msg):
        SamplingParams(**{field: value})


# ---------------------------------------------------------------------- engine-level (real SmolLM2)
def test_seed_reproducible_across_batches(smollm2_llm):
    sp = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=10, ignore_eos=True)
    alone = smollm2_llm.generate("Tell me a story", sp, use_tqdm=False)[0].outputs[0].token_ids
    other = SamplingParams(temperature=0.8, max_tokens=6, ignore_eos=True)
    mixed = smollm2_llm.generate(["Hello there", "Tell me a story", "1 2 3"], [other, sp, other], use_tqdm=False)
    assert mixed[1].outputs[0].token_ids == alone
    n2 = smollm2_llm.generate("Tell me a story", SamplingParams(n=3, temperature=1.0, max_tokens=10, seed=7),
                              use_tqdm=False)[0]
    assert len(n2.outputs) == 3 and len({tuple(o.token_ids) for o in n2.outputs}) > 1


def test_stop_strings_and_tokens(smollm2_llm):
    base = smollm2_llm.generate("Count: 1, 2, 3,", SamplingParams(max_tokens=20, temperature=0), use_tqdm=False)[0]
    text = base.outputs[0].text
    assert " 5" in text, text
    out = smollm2_llm.generate("Count: 1, 2, 3,", SamplingParams(max_tokens=20, temperature=0, stop=[" 5"]),
                               use_tqdm=False)[0].outputs[0]
    assert out.text == text[:text.index(" 5")] and out.finish_reason == "stop" and out.stop_reason == " 5"
    incl = smollm2_llm.generate("Count: 1, 2, 3,", SamplingParams(max_tokens=20, temperature=0, stop=[" 5"],
                                                                  include_stop_str_in_output=True),
                                use_tqdm=False)[0].outputs[0]
    assert incl.text == text[:text.index(" 5") + 2]
    t3 = base.outputs[0].token_ids[3]
    st = smollm2_llm.generate("Count: 1, 2, 3,", SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[t3]),
                              use_tqdm=False)[0].outputs[0]
    assert st.token_ids == base.outputs[0].token_ids[:base.outputs[0].token_ids.index(t3) + 1]
    assert st.finish_reason == "stop" and st.stop_reason == t3


def test_min_tokens_and_eos(smollm2_llm):
    eos = smollm2_llm.llm_engine.eos_token_ids
    short = smollm2_llm.generate("Say hi.", SamplingParams(max_tokens=64, temperature=0), use_tqdm=False)[0].outputs[0]
    assert short.finish_reason == "stop" and short.token_ids[-1] in eos
    n = len(short.token_ids)
    longer = smollm2_llm.generate("Say hi.", SamplingParams(max_tokens=64, temperature=0, min_tokens=n + 3),
                                  use_tqdm=False)[0].outputs[0]
    assert len(longer.token_ids) >= n + 3 and not any(t in eos for t in longer.token_ids[:n + 3])
    ign = smollm2_llm.generate("Say hi.", SamplingParams(max_tokens=n + 5, temperature=0, ignore_eos=True),
                               use_tqdm=False)[0].outputs[0]
    assert len(ign.token_ids) == n + 5 and ign.finish_reason == "length"


def test_logprobs_match_transformers(smollm2_llm, smollm2_hf_dir):
    import torch

    from tests.helpers import hf_model

    prompt = "The quick brown fox"
    out = smollm2_llm.generate(prompt, SamplingParams(max_tokens=5, temperature=0, logprobs=3, prompt_logprobs=2),
                               use_tqdm=False)[0]
    ids = out.prompt_token_ids + out.outputs[0].token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(smollm2_hf_dir)(torch.tensor([ids])).logits[0].float(), -1).numpy()
    P = len(out.prompt_token_ids)
    for i, entry in enumerate(out.outputs[0].logprobs):
        tok = out.outputs[0].token_ids[i]
        assert abs(entry[tok].logprob - ref[P - 1 + i, tok]) < 1e-3
        assert entry[tok].rank == 1 and len(entry) == 3
        assert set(entry) == set(np.argsort(-ref[P - 1 + i])[:3].tolist())
    assert abs(out.outputs[0].cumulative_logprob - sum(ref[P - 1 + i, t] for i, t in
                                                     enumerate(out.outputs[0].token_ids))) < 1e-2
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == P
    for j in range(1, P):
        t = out.prompt_token_ids[j]
        assert abs(out.prompt_logprobs[j][t].logprob - ref[j - 1, t]) < 1e-3


def test_incremental_detokenization_multibyte(smollm2_llm):
    from jvllm.engine.request import Detokenizer

    tok = smollm2_llm.get_tokenizer()
    text = "naïve café – 東京タワー 🙂🚀 ok"
    ids = tok(text)["input_ids"]
    d = Detokenizer(tok, [], skip_special_tokens=True)
    pieces = [d.step(t) for t in ids]
    assert "".join(pieces) == tok.decode(ids) and not any("\ufffd" in p for p in pieces)
    assert any(p == "" for p in pieces)  # some tokens are partial characters: held back


def test_bad_prompts_are_rejected_and_harm_nothing(smollm2_llm):
    llm = smollm2_llm
    V = llm.llm_engine.model_config.vocab_size
    with pytest.raises(ValueError, match="empty"):
        llm.generate({"prompt_token_ids": []}, use_tqdm=False)
    with pytest.raises(ValueError, match=rf"outside the vocabulary \[0, {V}\)"):
        llm.generate({"prompt_token_ids": [1, V]}, use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len is 512"):
        llm.generate({"prompt_token_ids": [1] * 512}, use_tqdm=False)
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.generate("hi", SamplingParams(stop_token_ids=[V + 5]), use_tqdm=False)
    with pytest.raises(ValueError, match="logit_bias keys"):
        llm.generate("hi", SamplingParams(logit_bias={-1: 1.0}), use_tqdm=False)
    # a batch with one bad prompt queues nothing
    with pytest.raises(ValueError):
        llm.generate(["fine", {"prompt_token_ids": [V]}], use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.generate("fine", SamplingParams(max_tokens=3), use_tqdm=False)[0].outputs[0].token_ids


def test_chat(smollm2_llm):
    out = smollm2_llm.chat([{"role": "user", "content": "What is 2+2? Answer with a number."}],
                           SamplingParams(max_tokens=16, temperature=0), use_tqdm=False)[0]
    assert "4" in out.outputs[0].text
    assert "<|im_start|>assistant" in out.prompt


def test_large_vocab_candidates_and_fallback():
    """Over TOPK_CANDIDATES tokens: top_k / a narrow nucleus use the candidate path; a nucleus
    wider than the candidates falls back to the exact full sort (draws beyond the candidates)."""
    from jvllm.sampling import TOPK_CANDIDATES

    Vl, R = 3000, 4000
    rng = np.random.default_rng(1)
    peaked = rng.normal(0, 4, Vl).astype(np.float32)
    sb = lambda **kw: SamplingBatch(  # noqa: E731
        temperature=jnp.ones((R,)), top_k=jnp.full((R,), kw.get("top_k", Vl), jnp.int32),
        top_p=jnp.full((R,), kw.get("top_p", 1.0), jnp.float32), min_p=jnp.zeros((R,)),
        key_data=jnp.asarray(np.stack([np.zeros(R), np.arange(R)], 1), jnp.uint32),
        counter=jnp.zeros((R,), jnp.int32), want_logprobs=jnp.asarray(False))
    tok, _ = _sample(jnp.broadcast_to(jnp.asarray(peaked), (R, Vl)), sb(top_k=5), None)
    assert set(np.asarray(tok).tolist()) == set(np.argsort(-peaked)[:5].tolist())
    flat = np.zeros(Vl, np.float32)
    tok, _ = _sample(jnp.broadcast_to(jnp.asarray(flat), (R, Vl)), sb(top_p=0.9), None)
    drawn = set(np.asarray(tok).tolist())
    assert len(drawn) > TOPK_CANDIDATES  # the nucleus (2700 tokens) was not cut to the candidates
