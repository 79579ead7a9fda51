"""The pallas backend of weight-only fp8 projections (`fp8_matmul_backend`, jvllm.ops.pallas_matmul in
interpret mode on CPU): the option's validation and resolution, where Fp8Pallas uses the kernel,
and an engine's greedy tokens equal to the XLA backend's on a tiny model."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jvllm import LLM, SamplingParams
from jvllm.ops import pallas_matmul
from jvllm.quantization import QuantConfig, apply_quantization
from jvllm.quantization.fp8 import Fp8Channel
from jvllm.quantization.fp8_pallas import PALLAS_MAX_TOKENS, Fp8Pallas

KW = dict(dtype="float32", quantization="fp8", max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32,
          token_buckets=(8, 32), use_tqdm_on_load=False, background_compile=False)


@pytest.fixture(scope="module")
def tiny(ckpt_dir):
    return ckpt_dir("llama")


def _model_config(path):
    from jvllm.converters import model_config, resolve_model

    return model_config(resolve_model(path))


def test_option_is_validated_and_resolved_once(tiny):
    cfg = _model_config(tiny)
    with pytest.raises(ValueError, match="fp8_matmul_backend must be one of auto, xla, pallas; got 'triton'"):
        apply_quantization(cfg, "fp8", fp8_matmul_backend="triton")
    with pytest.raises(ValueError, match="fp8_matmul_backend='pallas' needs fp8 weights .* not quantized"):
        apply_quantization(cfg, None, fp8_matmul_backend="pallas")
    with pytest.raises(ValueError, match="fp8_matmul_backend='pallas' needs fp8 weights .* int8"):
        apply_quantization(cfg, "int8", fp8_matmul_backend="pallas")
    assert apply_quantization(cfg, "fp8").quant.matmul == "xla"  # auto on a CPU
    assert apply_quantization(cfg, "fp8", fp8_matmul_backend="pallas").quant.matmul == "pallas"
    assert apply_quantization(cfg, "int8", fp8_matmul_backend="xla").quant.matmul == "xla"
    with pytest.raises(ValueError, match="QuantConfig.matmul must be one of xla, pallas, got 'cuda'"):
        QuantConfig("fp8", matmul="cuda")
    with pytest.raises(ValueError, match="pallas matmul is for weight-only fp8"):
        QuantConfig("fp8", fp8_activations=True, matmul="pallas")
    with pytest.raises(ValueError, match="the pallas backend is weight-only"):
        Fp8Pallas(activations=True)
    import dataclasses

    pre = dataclasses.replace(cfg, quant=QuantConfig("fp8", from_checkpoint=True, fp8_activations=False))
    with pytest.raises(ValueError, match="fp8_matmul_backend='pallas' .* already quantized"):
        apply_quantization(pre, None, fp8_matmul_backend="pallas")
    with pytest.raises(ValueError, match="fp8_matmul_backend must be one of"):
        LLM(tiny, **(KW | dict(fp8_matmul_backend="cutlass")))


def _uses_kernel(proj, spec, x, w, s) -> bool:
    return "pallas_call" in str(jax.make_jaxpr(lambda x, w, s: proj(spec, x, nnx.Param(w), nnx.Param(s)))(x, w, s))


def test_projection_uses_the_kernel_for_decode_sized_steps_only():
    """The pallas backend stores o_proj's [heads, head_dim, embed] as [embed, heads, head_dim]; the
    kernel and the einsum fallback over that layout both equal the XLA backend's projection."""
    proj, xla = Fp8Pallas(), Fp8Channel(activations=False)
    w = jax.random.normal(jax.random.PRNGKey(0), (4, 16, 64)) * 0.1  # o_proj-like [heads, head_dim, embed]
    q, s = proj.quantize(w, 2)
    qx, sx = xla.quantize(w, 2)
    assert q.shape == proj.stored_shape(w.shape, 2) == (64, 4, 16) and proj.model_shape(q.shape, 2) == w.shape
    np.testing.assert_array_equal(np.asarray(jnp.transpose(q, (1, 2, 0)), np.float32), np.asarray(qx, np.float32))
    np.testing.assert_array_equal(np.asarray(proj.dequantize(q, s, 2)), np.asarray(xla.dequantize(qx, sx, 2)))
    for T in (1, 7, PALLAS_MAX_TOKENS, PALLAS_MAX_TOKENS + 1):
        x = jax.random.normal(jax.random.PRNGKey(T), (T, 4, 16))
        assert _uses_kernel(proj, "thk,hkd->td", x, q, s) == (T <= PALLAS_MAX_TOKENS)
        y = proj("thk,hkd->td", x, nnx.Param(q), nnx.Param(s))
        ref = xla("thk,hkd->td", x, nnx.Param(qx), nnx.Param(sx))
        np.testing.assert_allclose(np.asarray(y), np.asarray(ref), rtol=1e-5, atol=1e-5)
    assert not _uses_kernel(proj, "tkh,hkd->td", jnp.ones((2, 16, 4)), q, s)  # contracted dims out of order
    assert not _uses_kernel(xla, "thk,hkd->td", jnp.ones((2, 4, 16)), qx, sx)


def test_many_runs_a_group_in_one_launch():
    proj = Fp8Pallas()
    ws = [proj.quantize(jax.random.normal(jax.random.PRNGKey(i), (64, h, 16)) * 0.1, 1) for i, h in enumerate((4, 2, 2))]
    x = jax.random.normal(jax.random.PRNGKey(9), (3, 64))
    params = [(nnx.Param(q), nnx.Param(s)) for q, s in ws]
    jaxpr = str(jax.make_jaxpr(lambda x: proj.many("td,dhk->thk", x, params))(x))
    assert jaxpr.count("pallas_call") == 1
    for y, (q, s) in zip(proj.many("td,dhk->thk", x, params), ws):
        np.testing.assert_allclose(np.asarray(y), np.asarray(proj("td,dhk->thk", x, nnx.Param(q), nnx.Param(s))),
                                   rtol=1e-5, atol=1e-5)


def test_projection_keeps_xla_under_tensor_parallelism():
    from jax.sharding import Mesh

    from jvllm.ops.attention import tensor_parallel_mesh

    proj = Fp8Pallas()
    q, s = proj.quantize(jnp.ones((64, 32)), 1)
    mesh = Mesh(np.array(jax.devices()[:2]).reshape(1, 2), ("data", "tensor"))
    with tensor_parallel_mesh(mesh):
        assert not _uses_kernel(proj, "td,di->ti", jnp.ones((2, 64)), q, s)
    assert _uses_kernel(proj, "td,di->ti", jnp.ones((2, 64)), q, s)


def test_engine_greedy_tokens_equal_xla(tiny, monkeypatch):
    """Prefill chunks and decode steps (buckets 8 and 32, both <= PALLAS_MAX_TOKENS) through the kernel
    in interpret mode: the same greedy tokens as the XLA backend."""
    traced = []
    real = pallas_matmul.matmuls
    monkeypatch.setattr(pallas_matmul, "matmuls",
                        lambda *a, **k: traced.append(tuple(w.shape for w in a[1])) or real(*a, **k))
    prompts = [[int(t) for t in np.random.default_rng(i).integers(3, 256, n)] for i, n in enumerate((5, 19, 40))]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    out = {}
    for backend in ("xla", "pallas"):
        llm = LLM(tiny, fp8_matmul_backend=backend, **KW)
        assert llm.llm_engine.model_config.quant.matmul == backend
        got = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        out[backend] = [list(o.outputs[0].token_ids) for o in got]
        llm.shutdown()
        if backend == "xla":
            assert not traced
    # stored [N, K]: q/k/v and gate/up one launch each, o and down one each
    assert {((64, 64), (32, 64), (32, 64)), ((128, 64), (128, 64)), ((64, 64),), ((64, 128),)} <= set(traced)
    assert out["pallas"] == out["xla"]


def test_cli_flag_reaches_the_engine_kwargs(monkeypatch):
    import argparse

    import jvllm.sharding as sharding
    from jvllm.cli import add_engine_args, engine_kwargs

    monkeypatch.setattr(sharding, "initialize_distributed", lambda *a: None)
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_kwargs(p.parse_args(["--fp8-matmul-backend", "pallas"]))["fp8_matmul_backend"] == "pallas"
    assert engine_kwargs(p.parse_args([]))["fp8_matmul_backend"] == "auto"
    with pytest.raises(SystemExit):
        p.parse_args(["--fp8-matmul-backend", "cutlass"])


def test_weights_stored_output_first_and_updates(tiny):
    """get_weights() of a pallas-backend engine gives the stored [out..., in...] layout; full-
    precision updates in the model layout (as from a trainer or an unquantized engine) are
    requantized into it, the get_weights pair goes back as it is, and a full-precision weight in the
    stored layout is an error naming both shapes."""
    kw = {k: v for k, v in KW.items() if k != "quantization"}
    f32 = LLM(tiny, **kw)
    llm = LLM(tiny, fp8_matmul_backend="pallas", **KW)
    try:
        ids = [int(t) for t in np.random.default_rng(1).integers(3, 256, 20)]
        logits = lambda: np.asarray(llm.llm_engine.runner.sequence_logits(ids))  # noqa: E731
        full = f32.get_weights()["layers"]["0"]
        w = llm.get_weights()["layers"]["0"]
        (d, h, k), (do, ho, ko) = full["self_attn"]["q_proj"].shape, full["self_attn"]["o_proj"].shape
        assert w["self_attn"]["q_proj"].shape == (h, k, d) and w["self_attn"]["o_proj"].shape == (ko, do, ho)
        assert w["mlp"]["down_proj"].shape == full["mlp"]["down_proj"].shape[::-1]
        before = logits()
        mlp = {n: np.asarray(a) for n, a in full["mlp"].items() if n.endswith("_proj")}
        llm.update_weights({"layers": {"0": {"mlp": {n: a * 0.5 for n, a in mlp.items()}}}})
        assert not np.allclose(logits(), before)
        llm.update_weights({"layers": {"0": {"mlp": mlp}}})
        np.testing.assert_array_equal(logits(), before)  # the same values quantize to the same weights
        llm.update_weights({"layers": {"0": {"mlp": {"up_proj": w["mlp"]["up_proj"], "up_proj_scale": w["mlp"]["up_proj_scale"]}}}})
        np.testing.assert_array_equal(logits(), before)
        llm.update_weights([("model.layers.0.mlp.up_proj.weight", mlp["up_proj"].T * 0.5)])  # HF's [out, in]
        assert not np.allclose(logits(), before)
        llm.update_weights([("model.layers.0.mlp.up_proj.weight", mlp["up_proj"].T)])
        np.testing.assert_array_equal(logits(), before)
        wrong = np.zeros(w["self_attn"]["q_proj"].shape, np.float32)
        with pytest.raises(ValueError, match=r"full-precision weight of shape \(4, 16, 64\); this engine takes "
                                             r"\(64, 4, 16\) \(its quantized weights are stored output dims first\)"):
            llm.update_weights({"layers": {"0": {"self_attn": {"q_proj": wrong}}}})
    finally:
        llm.shutdown()
        f32.shutdown()


def test_tensor_parallel_shards_the_stored_layout(tiny):
    """Under tensor parallelism the pallas backend's [out..., in...] weights shard along their own
    output axis and the steps take the einsum over that layout: logits equal the XLA backend's."""
    if len(jax.devices()) < 2:
        pytest.skip("needs 2 (fake) devices")
    ids = [int(t) for t in np.random.default_rng(2).integers(3, 256, 20)]
    got = {}
    for backend in ("xla", "pallas"):
        llm = LLM(tiny, fp8_matmul_backend=backend, tensor_parallel_size=2, **KW)
        try:
            a = llm.get_weights()["layers"]["0"]["mlp"]
            want = (None, "tensor") if backend == "xla" else ("tensor",)
            assert tuple(a["gate_proj"].sharding.spec)[:len(want)] == want
            got[backend] = np.asarray(llm.llm_engine.runner.sequence_logits(ids))
        finally:
            llm.shutdown()
    np.testing.assert_allclose(got["pallas"], got["xla"], rtol=1e-5, atol=1e-5)
