"""vLLM's sampling semantics where the order or the bookkeeping matters, on a tiny random Llama
with SmolLM2's tokenizer: logit bias before the repetition penalty (as vLLM and transformers
apply them), min_tokens banning any number of stop ids and the EOS even under ignore_eos,
stop_reason for the EOS and for other end tokens, vLLM's prompt shapes and types, and a clean
interpreter exit with a step still in flight."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from jvllm import SamplingParams

EOS, OTHER_EOS = 2, 5  # the tokenizer's EOS (vLLM's) and a second end token from config.json
PROMPT = [19556, 905, 5563]


@pytest.fixture(scope="module")
def tiny(ckpt_dir):
    from jvllm import LLM

    path = ckpt_dir("llama", tokenizer=True, eos_token_id=[EOS, OTHER_EOS])
    llm = LLM(path, dtype="float32", max_model_len=256, max_num_batched_tokens=64, max_num_seqs=8,
              token_buckets=(8, 16, 32, 64))
    yield path, llm
    llm.shutdown()


def _ids(llm, prompt=PROMPT, **kw):
    return llm.generate([prompt], SamplingParams(temperature=0, **kw), use_tqdm=False)[0].outputs[0]


def test_logit_bias_comes_before_the_repetition_penalty():
    """apply_extras divides (x + b) by the penalty: for a seen token with x = 3, b = 1, r = 2 the
    logit is 2 (bias first), not 2.5 (penalty first)."""
    import jax.numpy as jnp

    from jvllm.sampling import SamplingExtras, apply_extras

    ex = SamplingExtras(repetition=jnp.array([2.0]), presence=jnp.zeros(1), frequency=jnp.zeros(1),
                        hist_ids=jnp.array([[1, -1]]), hist_is_out=jnp.zeros((1, 2), bool),
                        bias_ids=jnp.array([[1, 2]]), bias_vals=jnp.array([[1.0, -1.0]]))
    out = np.asarray(apply_extras(jnp.array([[0.5, 3.0, 4.0, -1.0]]), ex))
    np.testing.assert_allclose(out, [[0.5, 2.0, 3.0, -1.0]])


def test_bias_with_repetition_penalty_matches_transformers(tiny):
    import torch
    import transformers

    path, llm = tiny
    got = _ids(llm, max_tokens=4, repetition_penalty=2.0, logit_bias={5563: 1.0}).token_ids
    m = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        want = m.generate(torch.tensor([PROMPT]), max_new_tokens=4, min_new_tokens=4, do_sample=False,
                          repetition_penalty=2.0, sequence_bias={(5563,): 1.0}, pad_token_id=0,
                          eos_token_id=None)[0, len(PROMPT):].tolist()
    assert list(got) == want


def test_min_tokens_bans_any_number_of_stop_ids(tiny):
    """More stop ids than the sampler's bias slots (with or without 300 logit_bias entries beside
    them): the rest are banned through the vocabulary mask, none is sampled inside the window."""
    _, llm = tiny
    first = _ids(llm, max_tokens=1).token_ids[0]
    for stops, bias in (([first] + list(range(4096, 4496)), None),
                        ([first] + list(range(4096, 4106)), {i: 0.0 for i in range(30000, 30300)})):
        out = _ids(llm, max_tokens=3, min_tokens=2, stop_token_ids=stops, logit_bias=bias)
        assert not set(out.token_ids[:2]) & set(stops), out.token_ids


def test_min_tokens_bans_the_eos_under_ignore_eos(tiny):
    _, llm = tiny
    out = _ids(llm, max_tokens=5, min_tokens=3, ignore_eos=True, logit_bias={EOS: 100.0})
    assert EOS not in out.token_ids[:3] and out.token_ids[3:] == [EOS, EOS]


def test_stop_reason_of_end_tokens(tiny):
    """vLLM checks its EOS before stop_token_ids (stop_reason None even when the EOS is listed
    there too); its other end tokens (the generation / model config's) stop like stop ids, by id."""
    _, llm = tiny
    out = _ids(llm, max_tokens=4, stop_token_ids=[EOS], logit_bias={EOS: 100.0})
    assert (out.token_ids, out.finish_reason, out.stop_reason) == ([EOS], "stop", None)
    out = _ids(llm, max_tokens=4, logit_bias={OTHER_EOS: 100.0})
    assert (out.token_ids, out.finish_reason, out.stop_reason) == ([OTHER_EOS], "stop", OTHER_EOS)
    out = _ids(llm, max_tokens=4, ignore_eos=True, logit_bias={OTHER_EOS: 100.0})
    assert out.finish_reason == "length"


def test_prompt_shapes_and_types(tiny):
    from jvllm import TextPrompt, TokensPrompt

    _, llm = tiny
    want = _ids(llm, max_tokens=2).token_ids
    for p in (tuple(PROMPT), [np.int64(t) for t in PROMPT], np.asarray(PROMPT), TokensPrompt(prompt_token_ids=PROMPT)):
        assert _ids(llm, p, max_tokens=2).token_ids == want
    assert llm.generate(TextPrompt(prompt="Hi"), SamplingParams(max_tokens=1), use_tqdm=False)[0].prompt == "Hi"
    with pytest.raises(TypeError, match="sampling_params must be a SamplingParams.*dict"):
        llm.generate([PROMPT], {"temperature": 0}, use_tqdm=False)


@pytest.mark.parametrize("kw,words", [(dict(stop_token_ids=[True]), "stop_token_ids"),
                                      (dict(logit_bias={5563.9: 1.0}), "logit_bias"),
                                      (dict(logit_bias={True: 1.0}), "logit_bias")])
def test_token_ids_must_be_integers(kw, words):
    with pytest.raises(ValueError, match=words):
        SamplingParams(**kw)
    assert SamplingParams(logit_bias={"12": 1.0, 13.0: 2.0, np.int32(14): 3.0}).logit_bias == {12: 1.0, 13: 2.0, 14: 3.0}
    assert SamplingParams(stop_token_ids=[np.int64(7)]).stop_token_ids == [7]


def test_exit_without_shutdown_is_clean(tiny, tmp_path):
    """A request that stops early leaves a step dispatched ahead in flight; at interpreter exit
    (no shutdown(), as vLLM scripts end) the atexit hook collects it: no 'step failed' traceback."""
    path, _ = tiny
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent(f"""
        from jvllm import LLM, SamplingParams
        llm = LLM({path!r}, dtype="float32", max_model_len=256, max_num_batched_tokens=64, max_num_seqs=8,
                  token_buckets=(8, 16, 32, 64))
        first = llm.generate([{PROMPT!r}], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0]
        out = llm.generate([{PROMPT!r}], SamplingParams(temperature=0, max_tokens=3,
                           stop_token_ids=list(first.outputs[0].token_ids)), use_tqdm=False)[0].outputs[0]
        print("finish", out.finish_reason)
    """))
    env = dict(os.environ, JAX_PLATFORMS="cpu", JVLLM_CACHE_DIR="off",
               PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "finish stop" in p.stdout
    assert "step failed" not in p.stderr and "Traceback" not in p.stderr, p.stderr[-2000:]
