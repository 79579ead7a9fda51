"""Engines with quantized weights on a tiny model: logits against float32 within stated
tolerances, get_weights / update_weights of a quantized engine, tensor-parallel sharding of the
scales, the CLI flag. (Real weights: test_quant_real.py; checkpoints: test_quant_checkpoints.py.)"""
import numpy as np
import pytest

from jvllm import LLM

IDS = [int(t) for t in np.random.default_rng(0).integers(3, 256, 40)]
KW = dict(dtype="float32", max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64, token_buckets=(64,),
          use_tqdm_on_load=False, background_compile=False)
# max |logit - f32 logit| / max |f32 logit| on the tiny random model (transformers' init, std 0.02)
TOL = {"int8": 0.02, "int8_g16": 0.02, "fp8": 0.08, "fp8_g16": 0.08}
# engine name -> (quantization, quantization_group_size): "auto" is one scale per output channel;
# the _g16 engines take the opt-in groups of 16 input rows
VARIANTS = {"fp8": ("fp8", "auto"), "int8": ("int8", "auto"), "int8_g16": ("int8", 16), "fp8_g16": ("fp8", 16)}
GROUP = {"fp8": None, "int8": None, "int8_g16": 16, "fp8_g16": 16}


@pytest.fixture(scope="module")
def tiny(ckpt_dir):
    return ckpt_dir("llama")


@pytest.fixture(scope="module")
def engines(tiny):
    out = {None: LLM(tiny, **KW)}
    out.update({name: LLM(tiny, quantization=q, quantization_group_size=g, **KW) for name, (q, g) in VARIANTS.items()})
    yield out
    for llm in out.values():
        llm.shutdown()


def _logits(llm, ids=IDS):
    return llm.llm_engine.runner.sequence_logits(ids)


@pytest.fixture(scope="module")
def ref_logits(engines):
    return _logits(engines[None])


@pytest.mark.parametrize("q", list(VARIANTS))
def test_logits_close_to_float32(engines, ref_logits, q):
    assert engines[q].llm_engine.model_config.quant.group_size == GROUP[q]
    z = _logits(engines[q])
    rel = float(np.abs(z - ref_logits).max() / np.abs(ref_logits).max())
    print(f"{q}: max |dlogit| / max |logit| = {rel:.4f}")
    assert rel < TOL[q]
    assert 0 < rel  # really quantized
    top1 = float(np.mean(z.argmax(-1) == ref_logits.argmax(-1)))
    assert top1 >= 0.9, top1


@pytest.mark.parametrize("q,dtype", [("fp8", "float8_e4m3fn"), ("int8", "int8"), ("fp8_g16", "float8_e4m3fn")])
def test_weights_are_stored_quantized_and_smaller(engines, q, dtype):
    from jvllm.bench import param_stats

    w = engines[q].get_weights()
    attn, mlp = w["layers"]["0"]["self_attn"], w["layers"]["1"]["mlp"]
    g = GROUP[q]
    (d, h, k), (ho, ko, do) = attn["q_proj"].shape, attn["o_proj"].shape
    assert str(attn["q_proj"].dtype) == dtype and str(mlp["down_proj"].dtype) == dtype
    assert attn["q_proj_scale"].shape == ((h, k) if g is None else (d // g, h, k))
    assert attn["o_proj_scale"].shape == ((do,) if g is None else (ho, ko // g, do))  # groups along head_dim
    assert str(w["embed"].dtype) == "float32" and str(w["norm"]["weight"].dtype) == "float32"
    full, small = param_stats(engines[None])["weight_bytes"], param_stats(engines[q])["weight_bytes"]
    mc = engines[None].llm_engine.model_config
    proj = mc.num_layers * (mc.hidden_size * mc.head_dim * (2 * mc.num_heads + 2 * mc.num_kv_heads)
                            + 3 * mc.hidden_size * mc.intermediate_size)
    assert full - small == proj * 3 - 4 * sum(a.size for layer in w["layers"].values()
                                              for part in layer.values() for k, a in part.items() if k.endswith("_scale"))


@pytest.mark.parametrize("q", ["fp8", "fp8_g16"])
def test_update_weights_requantizes_full_precision(engines, ref_logits, q):
    f32 = engines[None].get_weights()
    fp8 = engines[q]
    before = _logits(fp8)
    layer = {k: np.asarray(v) * 0.5 for k, v in f32["layers"]["0"]["mlp"].items() if k.endswith("_proj")}
    fp8.update_weights({"layers": {"0": {"mlp": layer}}})
    changed = _logits(fp8)
    assert not np.allclose(changed, before)
    fp8.update_weights({"layers": {"0": {"mlp": {k: np.asarray(v) for k, v in f32["layers"]["0"]["mlp"].items()}}}})
    np.testing.assert_array_equal(_logits(fp8), before)  # the same full-precision values: the same quantization


def test_update_weights_takes_quantized_pairs_and_refuses_halves(engines):
    llm = engines["int8"]
    before = _logits(llm)
    w = llm.get_weights()["layers"]["1"]["self_attn"]
    llm.update_weights({"layers": {"1": {"self_attn": {"q_proj": w["q_proj"], "q_proj_scale": w["q_proj_scale"] * 2}}}})
    assert not np.allclose(_logits(llm), before)
    llm.update_weights({"layers": {"1": {"self_attn": {"q_proj": w["q_proj"], "q_proj_scale": w["q_proj_scale"]}}}})  # as it was
    np.testing.assert_allclose(_logits(llm), before, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match=r"'layers.1.self_attn.q_proj_scale' given without 'layers.1.self_attn.q_proj'"):
        llm.update_weights({"layers": {"1": {"self_attn": {"q_proj_scale": w["q_proj_scale"]}}}})
    with pytest.raises(ValueError, match=r"int8 weight together with .*got a int8 weight without a scale"):
        llm.update_weights({"layers": {"1": {"self_attn": {"q_proj": w["q_proj"]}}}})
    with pytest.raises(ValueError, match=r"got a float32 weight with a scale"):
        llm.update_weights({"layers": {"1": {"self_attn": {"q_proj": np.zeros(w["q_proj"].shape, np.float32),
                                                           "q_proj_scale": w["q_proj_scale"]}}}})


def test_tensor_parallel_shards_scales_with_their_output_axis(tiny, engines):
    import jax

    if len(jax.devices()) < 2:
        pytest.skip("needs 2 (fake) devices")
    llm = LLM(tiny, quantization="fp8", tensor_parallel_size=2, **KW)
    try:
        a = llm.get_weights()["layers"]["0"]
        assert tuple(a["self_attn"]["q_proj_scale"].sharding.spec) == (("tensor"), None)  # heads
        assert tuple(a["mlp"]["gate_proj_scale"].sharding.spec) == ("tensor",)            # mlp
        assert tuple(a["mlp"]["gate_proj"].sharding.spec) == (None, "tensor")
        np.testing.assert_allclose(_logits(llm), _logits(engines["fp8"]), rtol=2e-3, atol=2e-3)
    finally:
        llm.shutdown()
    llm = LLM(tiny, quantization="int8", quantization_group_size=16, tensor_parallel_size=2, **KW)  # [in / 16, out...]
    try:
        a = llm.get_weights()["layers"]["0"]
        spec = {k: tuple(a[p][k].sharding.spec) + (None,) * (a[p][k].ndim - len(a[p][k].sharding.spec))
                for p, k in (("self_attn", "o_proj_scale"), ("mlp", "down_proj_scale"), ("mlp", "gate_proj_scale"))}
        assert spec == {"o_proj_scale": ("tensor", None, None),   # heads, head_dim / 16, out
                        "down_proj_scale": ("tensor", None),      # intermediate / 16, out
                        "gate_proj_scale": (None, "tensor")}      # hidden / 16, mlp
        np.testing.assert_allclose(_logits(llm), _logits(engines["int8_g16"]), rtol=2e-3, atol=2e-3)
    finally:
        llm.shutdown()


def test_w8a8_engine_where_fp8_matmuls_exist(tiny, engines, ref_logits, monkeypatch):
    """The W8A8 path (fp8 activations per token; opt-in, on fp8-capable GPUs only), forced on the CPU."""
    import jvllm.quantization as quantization
    import jvllm.quantization.fp8 as fp8

    monkeypatch.setattr(fp8, "fp8_matmul_supported", lambda device=None: True)
    plain = quantization.apply_quantization
    monkeypatch.setattr(quantization, "apply_quantization", lambda cfg, q, **kw: plain(cfg, q, fp8_activations=True, **kw))
    llm = LLM(tiny, quantization="fp8", **KW)
    try:
        assert llm.llm_engine.model_config.quant.fp8_activations
        assert not engines["fp8"].llm_engine.model_config.quant.fp8_activations  # CPU default
        z = _logits(llm)
        rel = float(np.abs(z - ref_logits).max() / np.abs(ref_logits).max())
        print(f"fp8 W8A8: max |dlogit| / max |logit| = {rel:.4f}")
        assert rel < TOL["fp8"] and not np.allclose(z, _logits(engines["fp8"]))
    finally:
        llm.shutdown()


def test_unknown_quantization_is_refused(tiny):
    with pytest.raises(ValueError, match=r"quantization must be one of fp8, int8 \(or None\); got 'gptq'"):
        LLM(tiny, quantization="gptq", **KW)
    with pytest.raises(ValueError, match=r"quantization_group_size=32 must divide .*head_dim \(o_proj\) = 16"):
        LLM(tiny, quantization="int8", quantization_group_size=32, **KW)
    with pytest.raises(ValueError, match=r"quantization_group_size=16 is weight-only on XLA; fp8_matmul_backend='pallas'"):
        LLM(tiny, quantization="fp8", quantization_group_size=16, fp8_matmul_backend="pallas", **KW)


def test_cli_flag_reaches_the_engine_config():
    import argparse

    from jvllm.cli import add_engine_args

    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert p.parse_args(["--quantization", "int8"]).quantization == "int8"
    assert p.parse_args([]).quantization is None
    assert p.parse_args([]).quantization_group_size == "auto"
    assert p.parse_args(["--quantization-group-size", "16"]).quantization_group_size == 16
    assert p.parse_args(["--quantization-group-size", "channel"]).quantization_group_size == "channel"
    with pytest.raises(SystemExit):
        p.parse_args(["--quantization-group-size", "rows"])


def test_sleep_level_2_restores_quantized_weights(tiny):
    llm = LLM(tiny, quantization="int8", enable_sleep_mode=True, **KW)
    try:
        before = _logits(llm)
        llm.sleep(2)  # the weights (int8 values and their scales) go to host memory
        llm.wake_up()
        np.testing.assert_array_equal(_logits(llm), before)
        assert str(llm.get_weights()["layers"]["0"]["mlp"]["up_proj"].dtype) == "int8"
    finally:
        llm.shutdown()
