"""vLLM's less common SamplingParams fields: best_of, allowed_token_ids, bad_words,
truncate_prompt_tokens, detokenize (offline, on the shared SmolLM2 engine; the server's wiring is
in test_server_fidelity.py)."""
from __future__ import annotations

import numpy as np
import pytest

from jvllm import SamplingParams
from jvllm.bad_words import bad_word_bans, bad_words_token_ids

PROMPT = "The capital of France is"


def _gen(llm, prompt, **kw):
    return llm.generate([prompt], SamplingParams(**kw), use_tqdm=False)[0]


# ---------------------------------------------------------------------------- bad values
@pytest.mark.parametrize("kw, words", [
    (dict(best_of=1, n=2), ["best_of", ">= n (2)"]),
    (dict(best_of=3, temperature=0.0), ["best_of", "greedy"]),
    (dict(best_of=True), ["best_of"]),
    (dict(allowed_token_ids=[]), ["allowed_token_ids", "non-empty"]),
    (dict(allowed_token_ids=[1, "x"]), ["allowed_token_ids"]),
    (dict(bad_words="hi"), ["bad_words", "list"]),
    (dict(bad_words=["ok", " "]), ["bad_words", "non-blank"]),
    (dict(truncate_prompt_tokens=0), ["truncate_prompt_tokens", "-1"]),
    (dict(truncate_prompt_tokens=-2), ["truncate_prompt_tokens"]),
    (dict(detokenize=False, stop=["."]), ["stop", "detokenize=False"]),
    (dict(detokenize=1), ["detokenize", "True or False"]),
    (dict(temperature=None), ["temperature", "a number"]),
    (dict(top_p=None), ["top_p", "a number"]),
    (dict(stop=5), ["stop", "a list"]),
    (dict(stop_token_ids=5), ["stop_token_ids", "a list"]),
    (dict(n=True), ["n", "an integer"]),
    (dict(max_tokens=True), ["max_tokens", "an integer or None"]),
    (dict(logprobs=True), ["logprobs"]),
    (dict(top_k=1.5), ["top_k", "an integer"]),
    (dict(output_kind="delta"), ["output_kind", "RequestOutputKind"]),
])
def test_bad_values_name_the_field(kw, words):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kw)
    for w in words:
        assert w in str(e.value)


def test_numpy_scalars_become_python_numbers():
    p = SamplingParams(temperature=np.float32(0.5), seed=np.int64(3), max_tokens=np.int32(4))
    assert (type(p.temperature), type(p.seed), type(p.max_tokens)) == (float, int, int) and p.temperature == 0.5


def test_engine_options_are_typed():
    """LLM options of plain types are checked before anything loads; 0 is not "the default"."""
    import pathlib

    from jvllm import LLM
    from jvllm.engine.engine_config import EngineConfig

    for kw, words in ((dict(seed="x"), "seed must be int"), (dict(enable_prefix_caching="no"), "enable_prefix_caching"),
                      (dict(max_model_len=1.5), "max_model_len must be int or None")):
        with pytest.raises(ValueError, match=words):
            LLM("no/such/model", **kw)
    assert EngineConfig(model=pathlib.Path("m")).model == "m"
    for f in ("max_model_len", "max_num_seqs", "max_num_batched_tokens"):
        with pytest.raises(ValueError, match=f"{f} must be a positive integer, got 0"):
            LLM("random:tiny", dtype="float32", use_tqdm_on_load=False, **{f: 0})


def test_generate_returns_whole_outputs_whatever_the_output_kind(smollm2_llm):
    """vLLM's generate() forces FINAL_ONLY: a DELTA request still returns all its text and tokens;
    a tqdm-like class passed as use_tqdm makes the bar; an EOS's text is kept with
    include_stop_str_in_output and special tokens shown."""
    from jvllm.sampling_params import RequestOutputKind

    full = _gen(smollm2_llm, PROMPT, max_tokens=8, temperature=0.0, logprobs=0, n=1)
    delta = _gen(smollm2_llm, PROMPT, max_tokens=8, temperature=0.0, logprobs=0, output_kind=RequestOutputKind.DELTA)
    assert delta.outputs[0].text == full.outputs[0].text and len(delta.outputs[0].token_ids) == 8
    assert len(delta.outputs[0].logprobs) == 8
    made = []

    class Bar:
        def __init__(self, **kw):
            made.append(kw["total"])

        def update(self, n):
            pass

        def set_postfix_str(self, s):
            pass

        def close(self):
            pass

    smollm2_llm.generate([PROMPT], SamplingParams(max_tokens=2), use_tqdm=Bar)
    assert made == [1]
    chat = [{"role": "user", "content": "Say hi."}]
    eos = smollm2_llm.llm_engine.eos_token_ids
    for keep in (False, True):
        o = smollm2_llm.chat(chat, SamplingParams(max_tokens=60, temperature=0.0, skip_special_tokens=False,
                                                  include_stop_str_in_output=keep), use_tqdm=False)[0].outputs[0]
        assert o.finish_reason == "stop" and o.token_ids[-1] in eos
        assert o.text.endswith("<|im_end|>") == keep, o.text


def test_vocabulary_and_length_limits(smollm2_llm):
    V = smollm2_llm.llm_engine.model_config.vocab_size
    with pytest.raises(ValueError, match=rf"allowed_token_ids \[{V}\] outside the vocabulary \[0, {V}\)"):
        _gen(smollm2_llm, PROMPT, allowed_token_ids=[1, V])
    with pytest.raises(ValueError, match="truncate_prompt_tokens 513 is more than max_model_len \\(512\\)"):
        _gen(smollm2_llm, PROMPT, truncate_prompt_tokens=513)


# ---------------------------------------------------------------------------- bad words: vLLM's rules
class _Tok:
    """word -> ids: 'foo' 1 token, ' foo' another; 'new york' 2 tokens, ' new york' 2 others;
    'bar' and ' bar' the same token (the spaced form adds nothing)."""
    table = {"foo": [5], " foo": [6], "new york": [7, 8], " new york": [9, 8], "bar": [3], " bar": [3],
             "ab": [1, 2], " ab": [4]}

    def encode(self, text, add_special_tokens=False):
        return self.table[text]


def test_bad_words_tokenized_with_and_without_a_space():
    assert bad_words_token_ids(["foo", "  new york", "bar", "ab"], _Tok(), 10) == [[5], [6], [7, 8], [9, 8], [3], [1, 2]]
    with pytest.raises(ValueError, match=r"bad_words give token ids \[6\] outside the vocabulary \[0, 6\)"):
        bad_words_token_ids(["foo"], _Tok(), 6)


def test_multi_token_bad_word_bans_its_last_token_only_after_its_prefix():
    words = [[5], [7, 8], [1, 2, 3]]
    assert bad_word_bans(words, []) == {5}
    assert bad_word_bans(words, [4, 7]) == {5, 8}
    assert bad_word_bans(words, [7, 4]) == {5}
    assert bad_word_bans(words, [1, 2]) == {5, 3}
    assert bad_word_bans(words, [2]) == {5}


def test_allow_bits_pack_the_mask():
    from types import SimpleNamespace

    from jvllm.worker.sampler import allow_bits

    V = 70
    req = SimpleNamespace(params=SamplingParams(allowed_token_ids=[0, 33, 69]), bad_words_ids=[[33], [2, 69]],
                          output_token_ids=[2])
    bits = allow_bits(req, V)
    assert bits.dtype == np.uint32 and bits.shape == (3,)
    ok = np.unpackbits(bits.view(np.uint8), bitorder="little").astype(bool)
    assert np.flatnonzero(ok).tolist() == [0]  # 33 always banned, 69 after the output ends in 2


# ---------------------------------------------------------------------------- on the engine
def test_allowed_token_ids_restrict_sampling(smollm2_llm):
    allowed = [28, 253, 1000, 4000]
    out = _gen(smollm2_llm, PROMPT, allowed_token_ids=allowed, temperature=1.0, seed=1, max_tokens=12,
               logprobs=0).outputs[0]
    assert len(out.token_ids) == 12 and set(out.token_ids) <= set(allowed)
    greedy = _gen(smollm2_llm, PROMPT, temperature=0.0, max_tokens=1).outputs[0].token_ids[0]
    assert greedy not in allowed  # the restriction changed the result
    # logprobs stay the model's raw ones (vLLM's default), the mask only limits what is sampled
    assert out.logprobs[0][out.token_ids[0]].logprob < 0


def test_bad_words_on_the_engine(smollm2_llm):
    base = _gen(smollm2_llm, PROMPT, temperature=0.0, max_tokens=6)
    first = smollm2_llm.get_tokenizer().decode(base.outputs[0].token_ids[:1]).strip()  # the greedy 'Paris'
    assert first == "Paris"
    out = _gen(smollm2_llm, PROMPT, temperature=0.0, max_tokens=6, bad_words=[first])
    banned = bad_words_token_ids([first], smollm2_llm.get_tokenizer(), 10**9)
    assert out.outputs[0].token_ids[0] != base.outputs[0].token_ids[0]
    assert not {ids[0] for ids in banned if len(ids) == 1} & set(out.outputs[0].token_ids)
    # a two-token word: its second token only banned right after its first
    tok = smollm2_llm.get_tokenizer()
    ids = base.outputs[0].token_ids
    word = tok.decode(ids[:2])
    two = bad_words_token_ids([word], tok, 10**9)
    assert any(len(w) == 2 for w in two)
    out2 = _gen(smollm2_llm, PROMPT, temperature=0.0, max_tokens=6, bad_words=[word])
    assert out2.outputs[0].token_ids[0] == ids[0] and out2.outputs[0].token_ids[1] != ids[1]


def test_truncate_prompt_tokens_keeps_the_last_tokens(smollm2_llm):
    tok = smollm2_llm.get_tokenizer()
    ids = tok(PROMPT)["input_ids"]
    out = _gen(smollm2_llm, {"prompt_token_ids": ids}, truncate_prompt_tokens=3, temperature=0.0, max_tokens=4)
    ref = _gen(smollm2_llm, {"prompt_token_ids": ids[-3:]}, temperature=0.0, max_tokens=4)
    assert out.prompt_token_ids == ids[-3:]
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    long = list(range(100, 100 + 600))  # longer than max_model_len 512
    out = _gen(smollm2_llm, {"prompt_token_ids": long}, truncate_prompt_tokens=-1, temperature=0.0, max_tokens=1)
    assert out.prompt_token_ids == long[-511:] and len(out.outputs[0].token_ids) == 1
    with pytest.raises(ValueError, match="max_model_len is 512"):
        _gen(smollm2_llm, {"prompt_token_ids": long}, max_tokens=1)


def test_detokenize_false_gives_ids_only(smollm2_llm):
    kw = dict(temperature=0.0, max_tokens=5, logprobs=1, prompt_logprobs=1)
    ref = _gen(smollm2_llm, PROMPT, **kw)
    out = _gen(smollm2_llm, PROMPT, detokenize=False, **kw)
    c = out.outputs[0]
    assert c.text == "" and c.token_ids == ref.outputs[0].token_ids
    assert all(lp.decoded_token is None for e in c.logprobs for lp in e.values())
    assert all(lp.decoded_token is None for e in out.prompt_logprobs[1:] for lp in e.values())
    assert ref.outputs[0].text and ref.outputs[0].logprobs[0][c.token_ids[0]].decoded_token


def test_best_of_returns_the_n_best_by_cumulative_logprob(smollm2_llm):
    kw = dict(temperature=1.0, seed=7, max_tokens=6)
    out = _gen(smollm2_llm, PROMPT, n=2, best_of=5, **kw)
    assert [c.index for c in out.outputs] == [0, 1]
    # all five, as n=5 with the same seed draws them (best_of's sequences are seeded like n's)
    every = _gen(smollm2_llm, PROMPT, n=5, logprobs=0, **kw).outputs
    ranked = sorted(every, key=lambda c: c.cumulative_logprob, reverse=True)
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in ranked[:2]]
    assert ranked[0].cumulative_logprob > ranked[-1].cumulative_logprob
    # with logprobs the returned sequences carry their cumulative logprob, best first
    out = _gen(smollm2_llm, PROMPT, n=2, best_of=5, logprobs=0, **kw)
    cums = [c.cumulative_logprob for c in out.outputs]
    assert cums == sorted(cums, reverse=True)
    np.testing.assert_allclose(cums, [c.cumulative_logprob for c in ranked[:2]], rtol=1e-5)
