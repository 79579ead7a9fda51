"""Sampling: support sets, penalties against numpy, seeds, stop conditions, logprobs vs transformers."""
import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jvllm import SamplingParams
from jvllm.sampling import SamplerImpl, SamplerVariant, SamplingBatch, SamplingExtras, VocabMask, apply_extras, sample

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


def test_large_vocab_top_k_and_wide_nucleus():
    """A large vocabulary: top_k keeps exactly the k best; a nucleus of most of the vocabulary is
    not cut to a candidate list (draws reach beyond the 1024 best tokens)."""
    TOPK_CANDIDATES = 1024
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


# ---------------------------------------------------------------------- no control flow, exactness
def _abstract_inputs(R, Vl, extras, L=16, B=4):
    f32, i32, sds = jnp.float32, jnp.int32, jax.ShapeDtypeStruct
    sb = SamplingBatch(sds((R,), f32), sds((R,), i32), sds((R,), f32), sds((R,), f32), sds((R, 2), jnp.uint32),
                       sds((R,), i32), sds((), jnp.bool_))
    ex = SamplingExtras(sds((R,), f32), sds((R,), f32), sds((R,), f32), sds((R, L), i32), sds((R, L), jnp.bool_),
                        sds((R, B), i32), sds((R, B), f32)) if extras else None
    mask = VocabMask(sds((R, -(-Vl // 32)), i32), sds((R,), jnp.bool_), sds((R,), jnp.bool_)) if extras else None
    return sds((R, Vl), f32), sb, ex, mask


@pytest.mark.parametrize("extras", [False, True])
def test_general_sampler_has_no_data_dependent_control_flow(extras):
    """(The largest variant, with extras and the vocabulary mask or without.) XLA on GPUs runs a
    `conditional` or a `while` by copying the predicate to the host and blocking, which would
    serialize the async scheduler on every sampled step: the GPU program has neither, its only
    loop is inside the top-p tail's Triton kernel (run on the device)."""
    args = _abstract_inputs(8, 3000, extras)
    impl = dataclasses.replace(SamplerImpl.for_platform("gpu"), pallas_interpret=False)
    gpu = jax.jit(functools.partial(sample, impl=impl)).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert not re.search(r"stablehlo\.(case|if|while)\b", gpu)
    assert gpu.count("__gpu$xla.gpu.triton") == 1


def _prep(logits, sb):
    """temperature -> min_p, as the sampler does before truncating."""
    x = logits / jnp.maximum(sb.temperature, 1e-5)[:, None]
    probs = jax.nn.softmax(x, axis=-1)
    return jnp.where(probs < sb.min_p[:, None] * jnp.max(probs, axis=-1, keepdims=True), -jnp.inf, x)


@jax.jit
def _sorted_oracle(logits, sb):
    """Reference: top_k / top_p after one full sort of each row, Gumbel-max with the sampler's
    noise of each token id."""
    from jvllm.sampling import _gumbel

    x = _prep(logits, sb)
    R, Vl = x.shape
    neg_sorted, idx = jax.lax.sort_key_val(-x, jnp.broadcast_to(jnp.arange(Vl, dtype=jnp.int32), (R, Vl)), dimension=-1)
    xs = -neg_sorted
    rank = jnp.arange(Vl, dtype=jnp.int32)[None, :]
    xs = jnp.where(rank >= sb.top_k[:, None], -jnp.inf, xs)
    ps = jax.nn.softmax(xs, axis=-1)
    before = jnp.cumsum(ps, axis=-1) - ps
    xs = jnp.where((before >= sb.top_p[:, None]) & (sb.top_p[:, None] < 1.0) & (rank > 0), -jnp.inf, xs)
    choice = jnp.argmax(xs + jnp.take_along_axis(_gumbel(sb, Vl), idx, axis=-1), axis=-1)
    return jnp.take_along_axis(idx, choice[:, None], axis=-1)[:, 0], xs, idx


def _mixed_batch(R, Vl, seed):
    """Rows of all kinds: scales from flat to peaked, top_k below / inside / beyond the
    candidates or off, top_p from narrow to almost 1, min_p and temperatures."""
    rng = np.random.default_rng(seed)
    logits = (rng.normal(0, 1, (R, Vl)) * rng.choice([0.05, 0.3, 1.0, 3.0, 6.0], (R, 1))).astype(np.float32)
    pick = lambda opts, dt: jnp.asarray(rng.choice(opts, R), dt)
    sb = SamplingBatch(
        temperature=pick([0.5, 1.0, 1.7], jnp.float32), top_k=pick([1, 7, 1024, 1025, 1800, Vl - 1, Vl], jnp.int32),
        top_p=pick([0.2, 0.9, 0.99, 0.9999, 1.0], jnp.float32), min_p=pick([0.0, 0.0, 0.02], jnp.float32),
        key_data=jnp.asarray(np.stack([np.zeros(R), rng.integers(0, 2**31, R)], 1), jnp.uint32),
        counter=pick(np.arange(100), jnp.int32), want_logprobs=jnp.asarray(False))
    return jnp.asarray(logits), sb


IMPLS = {"gpu": SamplerImpl(4, False), "cpu": SamplerImpl(1, True, looped_passes=True), "tpu": SamplerImpl(4, True),
         "radix2": SamplerImpl(2, False), "gpu_tail_only": SamplerImpl(4, False, rejection_rounds=0),
         "gpu_two_rounds": SamplerImpl(4, False, rejection_rounds=2)}


def test_impls_are_the_platforms():
    """The "gpu" and "cpu" forms tested here are the ones `for_platform` picks (CPU: looped passes)."""
    assert IMPLS["gpu"] == SamplerImpl.for_platform("gpu") and IMPLS["cpu"] == SamplerImpl.for_platform("cpu")


def _jit_sample(impl, variant=None):
    return jax.jit(functools.partial(sample, impl=impl, variant=variant))


@pytest.mark.parametrize("impl", ["gpu", "cpu", "tpu", "gpu_tail_only", "gpu_two_rounds"])
def test_threshold_path_matches_full_sort(impl):
    """Every row -- top_k of any size, a nucleus from narrow to nearly the whole vocabulary, both,
    min_p, temperatures -- draws the token a full sort draws with the same noise, however many
    top-p rounds run in XLA before the per-row tail kernel (interpret mode here)."""
    R, Vl = 1024, 3000
    wide = 0
    fn = _jit_sample(IMPLS[impl])
    for seed in range(2):
        logits, sb = _mixed_batch(R, Vl, seed)
        tok, _ = fn(logits, sb, None)
        want, xs, _ = _sorted_oracle(logits, sb)
        np.testing.assert_array_equal(np.asarray(tok), np.asarray(want))
        wide += int(np.sum(np.asarray(jnp.sum(xs > -jnp.inf, axis=-1)) > 1024))
    assert wide > 200  # plenty of rows keep more than 1024 tokens


@pytest.mark.parametrize("case", ["top_k", "flat_top_p", "top_k_and_top_p", "min_p_temperature"])
def test_wide_truncation_matches_full_sort(case):
    """Rows that keep thousands of tokens: the same tokens as the full sort."""
    R, Vl = 512, 4096
    rng = np.random.default_rng(7)
    scale = {"top_k": 3.0, "min_p_temperature": 1.5}.get(case, 0.2)
    logits = jnp.asarray((rng.normal(0, scale, (R, Vl))).astype(np.float32))
    kw = {"top_k": Vl, "top_p": 1.0, "temperature": 1.0, "min_p": 0.0}
    kw.update({"top_k": {"top_k": 3000}, "flat_top_p": {"top_p": 0.999},
               "top_k_and_top_p": {"top_k": 2500, "top_p": 0.95},
               "min_p_temperature": {"temperature": 3.0, "min_p": 0.05, "top_p": 0.98}}[case])
    sb = SamplingBatch(
        temperature=jnp.full((R,), kw["temperature"], jnp.float32), top_k=jnp.full((R,), kw["top_k"], jnp.int32),
        top_p=jnp.full((R,), kw["top_p"], jnp.float32), min_p=jnp.full((R,), kw["min_p"], jnp.float32),
        key_data=jnp.asarray(np.stack([np.arange(R), np.arange(R) * 7 + 1], 1), jnp.uint32),
        counter=jnp.arange(R, dtype=jnp.int32), want_logprobs=jnp.asarray(False))
    tok, _ = _sample(logits, sb, None)
    want, xs, idx = _sorted_oracle(logits, sb)
    np.testing.assert_array_equal(np.asarray(tok), np.asarray(want))
    kept = np.asarray(jnp.sum(xs > -jnp.inf, axis=-1))
    assert kept.min() > 1024
    ranks = np.argmax(np.asarray(idx) == np.asarray(tok)[:, None], axis=-1)
    assert ranks.max() >= 1024  # the draws reach beyond the 1024 best tokens


def test_top_k_floor_is_the_kth_largest():
    """_top_k_floor against a full sort: ties across groups, -inf tails, fewer finite values than
    k, a vocabulary that is no multiple of the group, fewer groups than kmax."""
    from jvllm.sampling import _top_k_floor

    rng = np.random.default_rng(9)
    for R, Vl, kmax, G in [(16, 1000, 64, 64), (16, 1000, 8, 16), (8, 300, 64, 64), (8, 37, 5, 4)]:
        x = np.round(rng.normal(0, 2, (R, Vl)), 1).astype(np.float32)  # many ties
        x[0, 3:] = -np.inf  # 3 finite values
        x[1] = 1.5
        x[2, ::2] = -np.inf
        k = rng.integers(1, kmax + 1, R)
        got = np.asarray(jax.jit(_top_k_floor, static_argnums=(2, 3))(jnp.asarray(x), jnp.asarray(k), kmax, G))
        want = -np.sort(-x, axis=1)[np.arange(R), k - 1]
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("impl", ["gpu", "cpu"])
def test_narrow_top_k_variant_matches_full_sort(impl):
    """top_k <= narrow_top_k by the group select (GPU programs) draws the full sort's tokens, with
    top_p in some rows, min_p and greedy rows beside, and the radix search's tokens where values
    tie (both keep every token tied with the threshold; a sort keeps k); branchy platforms take
    the radix search."""
    R, Vl = 256, 3000
    rng = np.random.default_rng(13)
    logits, sb = _mixed_batch(R, Vl, 17)
    k = rng.choice([1, 2, 5, 20, 50, 64, Vl], R).astype(np.int32)
    sb = dataclasses.replace(sb, top_k=jnp.asarray(k), temperature=jnp.where(jnp.arange(R) % 17 == 0, 0.0, sb.temperature))
    narrow = _jit_sample(IMPLS[impl], SamplerVariant(3, False, wide_top_k=False) if impl == "gpu" else None)
    tok, _ = narrow(logits, sb, None)
    np.testing.assert_array_equal(np.asarray(tok), np.asarray(_sorted_oracle(logits, sb)[0]))
    tied = jnp.round(logits * 4) / 4
    wide, _ = _jit_sample(IMPLS[impl], SamplerVariant(3, False))(tied, sb, None)
    np.testing.assert_array_equal(np.asarray(narrow(tied, sb, None)[0]), np.asarray(wide))


@pytest.mark.parametrize("bits", [1, 2, 4])
def test_radix_search_finds_the_largest_threshold(bits):
    """_radix_search against a brute force over every distinct key of the row (and one above)."""
    from jvllm.sampling import _radix_search, _ukey

    rng = np.random.default_rng(bits)
    R, Vl = 16, 200
    x = rng.normal(0, 2, (R, Vl)).astype(np.float32)
    x[:, :5] = x[:, 5:10]  # ties
    x[0, :50] = -np.inf
    x[1] = -0.0
    w = np.where(rng.random((R, Vl)) < 0.5, 1.0, rng.random((R, Vl))).astype(np.float32)
    u = np.asarray(_ukey(jnp.asarray(x)))
    target = (rng.random(R) * w.sum(1)).astype(np.float32)
    got = np.asarray(jax.jit(_radix_search, static_argnums=3)(jnp.asarray(u), jnp.asarray(w), jnp.asarray(target), bits))
    for r in range(R):
        ok = [c for c in np.unique(u[r]).tolist() + [0] if w[r][u[r] >= c].sum() >= target[r]]
        assert got[r] == max(ok), r
        assert w[r][u[r] >= got[r]].sum() >= target[r] and (got[r] == 2**32 - 1 or w[r][u[r] > got[r]].sum() < target[r])


def test_rows_are_independent_of_the_batch():
    """A row's draw does not depend on its neighbours, whether they keep 5 or thousands of tokens."""
    R, Vl = 256, 3000
    rng = np.random.default_rng(3)
    peaked = jnp.asarray(rng.normal(0, 4, (R, Vl)).astype(np.float32))
    flat = jnp.asarray(rng.normal(0, 0.1, (R, Vl)).astype(np.float32))
    ks = rng.integers(1, 1025, R).astype(np.int32)
    ks[::4] = Vl
    ps = rng.choice([0.5, 0.9, 1.0], R).astype(np.float32)
    sb = lambda top_k, top_p, seeds: SamplingBatch(  # noqa: E731
        temperature=jnp.full((len(seeds),), 0.9, jnp.float32), top_k=jnp.asarray(top_k, jnp.int32),
        top_p=jnp.asarray(top_p, jnp.float32), min_p=jnp.zeros((len(seeds),), jnp.float32),
        key_data=jnp.asarray(np.stack([np.zeros(len(seeds)), seeds], 1), jnp.uint32),
        counter=jnp.full((len(seeds),), 5, jnp.int32), want_logprobs=jnp.asarray(False))
    seeds = np.arange(R)
    dec = sb(ks, ps, seeds)
    alone, _ = _sample(peaked, dec, None)
    np.testing.assert_array_equal(np.asarray(alone), np.asarray(_sorted_oracle(peaked, dec)[0]))
    mixed_logits = jnp.stack([peaked, flat], 1).reshape(2 * R, Vl)
    mixed = sb(np.stack([ks, np.full(R, Vl)], 1).reshape(-1), np.stack([ps, np.full(R, 0.95)], 1).reshape(-1),
               np.stack([seeds, seeds + 10_000], 1).reshape(-1))
    tok, _ = _sample(mixed_logits, mixed, None)
    np.testing.assert_array_equal(np.asarray(tok)[::2], np.asarray(alone))
    flat_alone, _ = _sample(flat, sb(np.full(R, Vl), np.full(R, 0.95), seeds + 10_000), None)
    np.testing.assert_array_equal(np.asarray(tok)[1::2], np.asarray(flat_alone))


def test_greedy_rows_and_logprobs_without_branches(row):
    """Greedy rows take the argmax next to sampled rows; logprobs come back whether asked or not."""
    logits = jnp.asarray(np.stack([row, row, -row]))
    sb = SamplingBatch(temperature=jnp.asarray([0.0, 1.0, 0.0], jnp.float32), top_k=jnp.full((3,), V, jnp.int32),
                       top_p=jnp.ones((3,), jnp.float32), min_p=jnp.zeros((3,), jnp.float32),
                       key_data=jnp.asarray([[0, 1], [0, 2], [0, 3]], jnp.uint32), counter=jnp.zeros((3,), jnp.int32),
                       want_logprobs=jnp.asarray(False))
    tok, (lp, rank, top_ids, _) = _sample(logits, sb, None)
    assert int(tok[0]) == int(np.argmax(row)) and int(tok[2]) == int(np.argmax(-row))
    ref = np.asarray(jax.nn.log_softmax(logits, -1))
    np.testing.assert_allclose(np.asarray(lp), ref[np.arange(3), np.asarray(tok)], rtol=1e-6)
    assert np.asarray(rank)[[0, 2]].tolist() == [1, 1] and np.asarray(top_ids)[0, 0] == np.argmax(row)


def _variant_for(sb, Vl, want_lp=False):
    """The smallest variant that covers the batch (what the host picks)."""
    k, p = np.asarray(sb.top_k) < Vl, np.asarray(sb.top_p) < 1.0
    return SamplerVariant(search=(2 if k.any() else 0) | (1 if p.any() else 0), logprobs=want_lp)


@pytest.mark.parametrize("kind", ["none", "top_k_only", "top_p_only", "one_each", "both"])
def test_smallest_variant_draws_the_largest_variants_ids(kind):
    """The variant the host picks for a batch (no truncation, top_p only, top_k) draws the ids of the largest."""
    R, Vl = 256, 3000
    logits, sb = _mixed_batch(R, Vl, 11)
    rng = np.random.default_rng(5)
    k = np.asarray(sb.top_k).copy()
    p = np.asarray(sb.top_p).copy()
    if kind in ("none", "top_p_only"):
        k[:] = Vl
    if kind in ("none", "top_k_only"):
        p[:] = 1.0
    if kind == "one_each":
        p[rng.random(R) < 0.5] = 1.0
        k[p < 1.0] = Vl
    if kind == "both":
        k[k >= Vl] = 40
        p[p >= 1.0] = 0.9
    sb = dataclasses.replace(sb, top_k=jnp.asarray(k), top_p=jnp.asarray(p))
    v = _variant_for(sb, Vl)
    assert v.search == {"none": 0, "top_p_only": 1, "top_k_only": 2}.get(kind, 3)
    small, lp = _jit_sample(IMPLS["gpu"], v)(logits, sb, None)
    big, _ = _sample(logits, sb, None)
    assert lp is None
    np.testing.assert_array_equal(np.asarray(small), np.asarray(big))
    np.testing.assert_array_equal(np.asarray(small), np.asarray(_sorted_oracle(logits, sb)[0]))


def test_variant_must_match_the_inputs(row):
    ex = SamplingExtras(*(jnp.zeros((1,)),) * 3, jnp.full((1, 2), -1), jnp.zeros((1, 2), bool), jnp.full((1, 2), -1),
                        jnp.zeros((1, 2)))
    with pytest.raises(ValueError, match=r"needs extras=False and mask=False; got extras=True"):
        sample(jnp.asarray(row[None]), _sb(1), ex, variant=SamplerVariant())
    with pytest.raises(ValueError, match="search must be 0, 1, 2 or 3, got 4"):
        SamplerVariant(search=4)
    with pytest.raises(ValueError, match="radix_bits must be 1, 2 or 4, got 3"):
        SamplerImpl(radix_bits=3)


def test_vocab_mask_rows_and_logprobs(row):
    """Masked rows draw only allowed ids; unmasked rows ignore their (garbage) words; a grammar
    row's logprobs see the mask, an allowed_token_ids row's do not."""
    from jvllm.sampling import VocabMask

    R = 3
    logits = jnp.asarray(np.stack([row] * R))
    allowed = np.zeros((R, V), bool)
    allowed[:, [3, 9, 17]] = True
    words = np.packbits(allowed, axis=1, bitorder="little").view("<u4").view(np.int32).copy()
    words[2] = np.random.default_rng(0).integers(-2**31, 2**31 - 1, words.shape[1])  # not read: row 2 unmasked
    m = VocabMask(jnp.asarray(words), jnp.asarray([True, True, False]), jnp.asarray([True, False, False]))
    fn = _jit_sample(IMPLS["gpu"], SamplerVariant(mask=True))
    tok, (lp, *_) = fn(logits, _sb(R, temperature=0.0, want_lp=True), None, m)
    best_allowed = [3, 9, 17][int(np.argmax(row[[3, 9, 17]]))]
    assert np.asarray(tok).tolist() == [best_allowed, best_allowed, int(np.argmax(row))]
    full = np.asarray(jax.nn.log_softmax(logits[0]))
    masked = np.asarray(jax.nn.log_softmax(jnp.where(jnp.asarray(allowed[0]), logits[0], -jnp.inf)))
    np.testing.assert_allclose(np.asarray(lp), [masked[best_allowed], full[best_allowed], full.max()], rtol=1e-5)
    for seed in range(20):
        t, _ = fn(logits, _sb(R, seeds=[seed] * R), None, m)
        assert int(t[0]) in (3, 9, 17) and int(t[1]) in (3, 9, 17)


@pytest.mark.parametrize("want_lp", [False, True])
def test_branchy_sampler_draws_the_same_ids(want_lp):
    """The branchy program (CPUs/TPUs: conds skip work) and the GPU's branch-free one give the same
    ids on a batch with greedy, untruncated, narrow and wide (flat, most of the vocabulary) rows,
    all-greedy batches too; logprobs equal when asked."""
    branchy = _jit_sample(IMPLS["cpu"])
    rng = np.random.default_rng(7)
    Vl, R = 3000, 16
    peaked = rng.normal(0, 6, (R, Vl)).astype(np.float32)
    flat = rng.normal(0, 0.01, (R, Vl)).astype(np.float32)
    logits = jnp.asarray(np.where(np.arange(R)[:, None] % 2 == 0, peaked, flat))
    temp = np.where(np.arange(R) % 4 == 0, 0.0, 0.8).astype(np.float32)
    sb = SamplingBatch(temperature=jnp.asarray(temp), top_k=jnp.asarray(rng.choice([50, Vl, 2000], R), jnp.int32),
                       top_p=jnp.asarray(rng.choice([0.9, 1.0, 0.999], R), jnp.float32),
                       min_p=jnp.zeros((R,), jnp.float32), key_data=jnp.asarray([[0, s] for s in range(R)], jnp.uint32),
                       counter=jnp.full((R,), 3, jnp.int32), want_logprobs=jnp.asarray(want_lp))
    for batch in (sb, dataclasses.replace(sb, temperature=jnp.zeros((R,), jnp.float32))):
        a, lp_a = _sample(logits, batch, None)
        b, lp_b = branchy(logits, batch, None)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        if want_lp:
            for x, y in zip(lp_a, lp_b):
                np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6)
    assert "conditional(" in branchy.lower(logits, sb, None).compile().as_text()
