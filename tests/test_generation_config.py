"""The model's generation_config.json, read as vLLM reads it (jvllm.generation_config): its end
tokens join the engine's, its non-default sampling values are the defaults of requests that leave
them unset (LLM.generate without params, the server's unset fields), never of params a caller built."""
import json
import shutil

import pytest

from jvllm import generation_config as gc


def _write(folder, **cfg):
    (folder / gc.FILE).write_text(json.dumps(cfg))
    return str(folder)


def test_load_reads_only_non_default_values(tmp_path):
    d = _write(tmp_path, temperature=0.6, top_p=1.0, top_k=20, max_new_tokens=7, do_sample=False,
               repetition_penalty=1.0, eos_token_id=[2, 7])
    g = gc.load("auto", d)
    assert g.sampling_dict() == {"temperature": 0.6, "top_k": 20, "max_tokens": 7} and g.eos_token_ids == (2, 7)
    assert gc.load("vllm", d) == gc.GenerationDefaults()
    assert gc.load("auto", "smollm2") == gc.GenerationDefaults()  # a short name / GGUF file: none
    assert gc.load("auto", str(tmp_path / "nowhere")) == gc.GenerationDefaults()
    assert gc.load(d, "smollm2").eos_token_ids == (2, 7)  # a folder of its own
    with pytest.raises(ValueError, match="generation_config must be 'auto', 'vllm' or a folder"):
        gc.load("model", d)
    with pytest.raises(ValueError, match="has no generation_config.json"):
        gc.load(str(tmp_path / ".."), d)
    (tmp_path / gc.FILE).write_text("{bad")
    with pytest.raises(ValueError, match="not a readable JSON generation config"):
        gc.load("auto", d)


def test_engine_uses_the_generation_config(ckpt_dir, tmp_path):
    from jvllm import LLM, SamplingParams

    src = ckpt_dir("llama")
    d = tmp_path / "m"
    shutil.copytree(src, d)
    _write(d, eos_token_id=[2, 9], temperature=0.5, top_k=3, max_new_tokens=4)
    llm = LLM(str(d), dtype="float32", max_model_len=64, max_num_seqs=2, token_buckets=(8, 16),
              use_tqdm_on_load=False)
    try:
        assert {2, 9} <= set(llm.llm_engine.eos_token_ids)
        p = llm.get_default_sampling_params()
        assert (p.temperature, p.top_k, p.max_tokens) == (0.5, 3, 4)
        out = llm.generate([[5, 6, 7]], use_tqdm=False)[0].outputs[0]
        assert len(out.token_ids) <= 4 and 9 not in out.token_ids[:-1]
        # params a caller builds are its own: SamplingParams' defaults stay vLLM's
        out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, ignore_eos=True), use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) == 16
    finally:
        llm.shutdown()
    with pytest.raises(ValueError, match="generation_config must be"):
        LLM(str(d), dtype="float32", generation_config="nope", use_tqdm_on_load=False)


def test_server_unset_fields_take_the_defaults():
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from jvllm.server.app import build_app
    from tests.test_server_unit import FakeEngine

    eng = FakeEngine()
    eng.generation_defaults = gc.GenerationDefaults((("temperature", 0.5), ("top_k", 3), ("max_tokens", 5)))
    with TestClient(build_app(eng, "fake")) as c:
        assert c.post("/v1/completions", json={"prompt": [1], "max_tokens": 2}).status_code == 200
        p = eng.params[-1]
        assert (p.temperature, p.top_k, p.max_tokens) == (0.5, 3, 2)
        r = c.post("/v1/completions", json={"prompt": [1], "max_tokens": None, "temperature": 1.0, "top_k": None})
        assert r.status_code == 200
        p = eng.params[-1]
        assert (p.temperature, p.top_k, p.max_tokens) == (1.0, 3, 5)  # null: the default; max_new_tokens caps
