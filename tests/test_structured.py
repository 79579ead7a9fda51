"""Structured outputs offline, on the real SmolLM2 (the shared session engine): JSON schemas
validate with jsonschema, regexes fullmatch, choices are one of the choices; n > 1, stop strings
and max_tokens keep the grammar in step; a rejected schema is a ValueError before scheduling."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest

from jvllm import SamplingParams, StructuredOutputsParams

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "role": {"enum": ["admin", "user"]},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                    "required": ["city"], "additionalProperties": False},
        "scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 2},
    },
    "required": ["name", "age", "role", "address", "scores"],
    "additionalProperties": False,
}


def _so(**kw):
    return StructuredOutputsParams(**kw)


def test_json_schema_outputs_validate(smollm2_llm):
    sp = SamplingParams(max_tokens=80, temperature=0.9, seed=3, n=2, structured_outputs=_so(json=SCHEMA))
    outs = smollm2_llm.generate(["A user record in JSON:", "Person:"], sp, use_tqdm=False)
    texts = [c.text for o in outs for c in o.outputs]
    assert len(texts) == 4
    for o in outs:
        for c in o.outputs:
            assert c.finish_reason == "stop", c.text  # EOS only where the grammar ends
            jsonschema.validate(json.loads(c.text), SCHEMA)


def test_regex_choice_and_json_object(smollm2_llm):
    outs = smollm2_llm.generate(
        ["Phone number:", "Is the sky blue?", "JSON:"],
        [SamplingParams(max_tokens=20, temperature=0.7, seed=1, structured_outputs=_so(regex=r"\(\d{3}\) \d{3}-\d{4}")),
         SamplingParams(max_tokens=10, temperature=1.0, seed=2, structured_outputs=_so(choice=["yes", "no", "maybe"])),
         SamplingParams(max_tokens=30, temperature=0.0, structured_outputs=_so(json_object=True))],
        use_tqdm=False)
    assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", outs[0].outputs[0].text)
    assert outs[1].outputs[0].text in ("yes", "no", "maybe")
    js = outs[2].outputs[0]
    if js.finish_reason == "stop":
        assert isinstance(json.loads(js.text), dict)
    else:  # cut by max_tokens: still a prefix of an object
        assert js.text.startswith("{")


def test_grammar_mixed_with_unconstrained_and_stop(smollm2_llm):
    """A constrained row next to unconstrained ones (one batch); a stop string and max_tokens cut
    a constrained output; the unconstrained output equals the one of a batch without constraints."""
    plain = SamplingParams(max_tokens=8, temperature=0.0)
    alone = smollm2_llm.generate(["The capital of France is"], plain, use_tqdm=False)[0].outputs[0].text
    outs = smollm2_llm.generate(
        ["The capital of France is", "Count:", "Word:"],
        [plain,
         SamplingParams(max_tokens=6, temperature=0.0, structured_outputs=_so(regex=r"(\d ){20}")),
         SamplingParams(max_tokens=20, temperature=0.0, stop=["b"], structured_outputs=_so(regex=r"a+b+c"))],
        use_tqdm=False)
    assert outs[0].outputs[0].text == alone
    c = outs[1].outputs[0]
    assert c.finish_reason == "length" and re.fullmatch(r"(\d )*\d ?", c.text), c.text
    c = outs[2].outputs[0]
    assert c.finish_reason == "stop" and re.fullmatch(r"a+", c.text), c.text


def test_grammar_from_lark(smollm2_llm):
    g = 'start: "color: " COLOR\nCOLOR: "red" | "green" | "blue"'
    out = smollm2_llm.generate(["Pick a color."], SamplingParams(max_tokens=10, temperature=0.5, seed=0,
                                                                 structured_outputs=_so(grammar=g)), use_tqdm=False)
    assert out[0].outputs[0].text in ("color: red", "color: green", "color: blue")


def test_grammar_from_gbnf(smollm2_llm):
    """vLLM's EBNF / llama.cpp's GBNF (`root ::= ...`), converted to Lark by llguidance."""
    g = 'root ::= "color: " color\ncolor ::= "red" | "green" | "blue"'
    out = smollm2_llm.generate(["Pick a color."], SamplingParams(max_tokens=10, temperature=0.5, seed=0,
                                                                 structured_outputs=_so(grammar=g)), use_tqdm=False)
    assert out[0].outputs[0].text in ("color: red", "color: green", "color: blue")


def test_rejected_inputs_are_value_errors(smollm2_llm):
    eng = smollm2_llm.llm_engine
    before = eng.get_num_unfinished_requests()
    with pytest.raises(ValueError, match="rejected"):
        eng.add_request("bad1", "x", SamplingParams(structured_outputs=_so(json={"type": "object", "if": {}})))
    with pytest.raises(ValueError, match="rejected"):
        eng.add_request("bad2", "x", SamplingParams(structured_outputs=_so(regex="(unclosed")))
    assert eng.get_num_unfinished_requests() == before and "bad1" not in eng.groups
    with pytest.raises(ValueError, match="exactly one of"):
        _so(json=SCHEMA, regex="a")
    with pytest.raises(ValueError, match="exactly one of"):
        _so()
    with pytest.raises(ValueError, match="choice"):
        _so(choice=[])


def test_mask_bits_apply_on_device():
    """apply_token_mask keeps exactly the tokens whose bit is set (bit j of word i = token 32i+j)."""
    import jax.numpy as jnp

    from jvllm.sampling import apply_token_mask

    V = 70
    rng = np.random.default_rng(0)
    allowed = rng.random((3, V)) < 0.3
    words = np.zeros((3, 3), np.uint32)
    for r, t in zip(*np.nonzero(allowed)):
        words[r, t // 32] |= np.uint32(1 << (t % 32))
    out = np.asarray(apply_token_mask(jnp.zeros((3, V), jnp.float32), jnp.asarray(words.view(np.int32))))
    np.testing.assert_array_equal(np.isfinite(out), allowed)


def test_pydantic_schema_and_unconstrained_batches_have_no_mask(smollm2_llm):
    from types import SimpleNamespace

    import pydantic

    from jvllm.sampling import SamplerImpl
    from jvllm.worker.sampler import FLAG_MASK, FLAG_MASK_LOGPROBS, RowLayout, plan

    class Item(pydantic.BaseModel):
        name: str
        count: int

    so = _so(json=Item)
    assert so.json["properties"]["count"]["type"] == "integer"
    eng = smollm2_llm.llm_engine
    g = eng.inputs._grammar(SamplingParams(structured_outputs=so))
    state = eng.inputs._structured.state(g)
    V = eng.model_config.vocab_size
    req = lambda g: SimpleNamespace(grammar=g, params=SamplingParams(temperature=0), seed=0,  # noqa: E731
                                    num_output_tokens=0, num_pending=0)
    plain = SimpleNamespace(samples=True, req=req(None))
    assert plan([plain, plain], 4, V, 64, SamplerImpl()) is None  # unconstrained greedy: the argmax program
    p = plan([plain, SimpleNamespace(samples=True, req=req(state))], 4, V, 64, SamplerImpl())
    assert p.variant.mask and not p.variant.extras and p.rows.dtype == np.int32
    lay = RowLayout(4, V, 64, p.variant)
    assert p.rows.shape == (4, lay.width) and lay.width - lay.mask_at == (V + 31) // 32
    assert p.rows[:, 7].tolist() == [0, FLAG_MASK | FLAG_MASK_LOGPROBS, 0, 0]  # only row 1 reads its words
    m = p.rows[:, lay.mask_at:]
    tok = smollm2_llm.get_tokenizer()
    allowed = np.nonzero(np.unpackbits(m[1].view(np.uint8), bitorder="little")[:V])[0]
    texts = [tok.decode([int(i)]) for i in allowed]  # the forced start of '{"name":' (llguidance may force '{"')
    assert texts and all(t.startswith("{") and '{"name":'.startswith(t) for t in texts), texts


def test_constrained_row_with_penalties(smollm2_llm):
    """Structured outputs and a penalty in one batch: the masked sampler with its extras inputs."""
    outs = smollm2_llm.generate(
        ["Is the sky blue?", "The capital of France is"],
        [SamplingParams(max_tokens=5, temperature=0.0, repetition_penalty=1.2,
                        structured_outputs=_so(choice=["yes", "no"])),
         SamplingParams(max_tokens=5, temperature=0.0, presence_penalty=0.5)], use_tqdm=False)
    assert outs[0].outputs[0].text in ("yes", "no") and len(outs[1].outputs[0].token_ids) == 5
