"""The families beyond Llama (Gemma 2 / 3, Phi-3, OLMo 2 / 3, SmolLM3, Granite, GPT-2, GPT-NeoX,
StarCoder2, Cohere 1 / 2, GLM-4) beyond logit parity
(tests/test_models.py has that): each variant really changes the numbers, the engine equals
transformers' greedy generation token for token with batching, chunked prefill, prefix-cache hits
and preemption all in one run per family, and tensor parallelism gives the one-device tokens."""
import dataclasses

import numpy as np
import pytest

from jvllm import LLM, SamplingParams
from tests.helpers import hf_greedy, hf_model

N_NEW = 10


def _logits(cfg, params, ids):
    import jax.numpy as jnp

    from jvllm.models import bind
    from jvllm.models.layers import head_of
    from jvllm.worker.model_runner import ModelRunner

    g, s = bind(cfg, params)
    head = head_of(cfg, params)
    r = ModelRunner(cfg, g, s, head, dtype=jnp.float32, block_size=16, num_blocks=4, max_model_len=40,
                    max_num_seqs=1, token_buckets=(len(ids),))
    return r.sequence_logits(ids)


@pytest.fixture(scope="module")
def base_logits(ckpt_dir):
    """arch -> (its checkpoint, the prompt, the unchanged model's logits), made once per arch for
    all of its variants."""
    from jvllm.converters import load_checkpoint

    made = {}

    def get(arch):
        if arch not in made:
            ck = load_checkpoint(ckpt_dir(arch))
            ids = list(range(3, 40))
            made[arch] = (ck, ids, _logits(ck.config, ck.params, ids))
        return made[arch]

    return get


@pytest.mark.parametrize("arch,field,value", [
    ("gemma2", "attn_logit_softcap", None), ("gemma2", "final_logit_softcap", None),
    ("gemma2", "query_pre_attn_scalar", None), ("gemma3", "local_rope_theta", None),
    ("gemma3", "embed_scale", False), ("phi3", "partial_rotary_factor", 1.0), ("smollm3", "nope_layers", ()),
    ("granite", "embedding_multiplier", None), ("granite", "residual_multiplier", 1.0),
    ("granite", "attention_multiplier", None), ("granite", "logits_scaling", None),
    ("gpt_neox", "parallel_residual", False), ("gpt_neox", "partial_rotary_factor", 0.5),
    ("cohere", "logit_scale", None), ("cohere2", "nope_layers", ()), ("cohere", "rope_interleaved", False),
    ("glm4", "rope_interleaved", False), ("ministral3", "attn_temperature_beta", None),
    ("gptj", "rope_interleaved", False), ("gptj", "partial_rotary_factor", 1.0),
    ("stablelm", "partial_rotary_factor", 1.0), ("ernie4_5", "rope_interleaved", False), ("arcee", "hidden_act", "relu"),
    ("nemotron", "norm_unit_offset", False), ("nemotron", "partial_rotary_factor", 1.0),
    ("exaone4", "nope_layers", ()), ("olmo", "clip_qkv", None), ("helium", "rope_interleaved", False),
    ("hunyuan_dense", "qk_norm_after_rope", False), ("hunyuan_dense", "rope_theta", 10000.0)])
def test_variant_matters(base_logits, arch, field, value):
    """Turning one variant off changes the logits by far more than the 1e-4 parity tolerance, so
    the parity tests would catch it missing."""
    ck, ids, base = base_logits(arch)
    if field == "partial_rotary_factor" and ck.config.rope_type == "longrope":  # factors for every pair
        rs = dict(ck.config.rope_params)
        rs.update(short_factor=rs["short_factor"] * 2, long_factor=rs["long_factor"] * 2)
        cfg = dataclasses.replace(ck.config, partial_rotary_factor=1.0, rope_scaling=tuple(sorted(rs.items())))
    else:
        cfg = dataclasses.replace(ck.config, **{field: value})
    assert np.abs(_logits(cfg, ck.params, ids) - base).max() > 1e-3


def test_activations_are_transformers():
    """Each hidden_act name is transformers' function (exact and tanh GELU differ by a few 1e-4, too
    little to show in the random models' logits, so they are checked here), and the config check
    knows the same names."""
    import torch
    from transformers.activations import ACT2FN

    from jvllm.config import _ACTIVATIONS
    from jvllm.ops.activations import NAMES, activation

    assert set(NAMES) == set(_ACTIVATIONS)
    x = np.linspace(-6, 6, 241, dtype=np.float32)
    for name in NAMES:
        want = ACT2FN[name](torch.from_numpy(x)).numpy()
        np.testing.assert_allclose(np.asarray(activation(name)(x)), want, atol=2e-6, err_msg=name)
    assert np.abs(np.asarray(activation("gelu")(x)) - np.asarray(activation("gelu_new")(x))).max() > 1e-4
    with pytest.raises(ValueError, match="unsupported activation 'xielu'; supported: silu"):
        activation("xielu")
    # xIELU has learned parameters: only Apertus declares them, any other architecture refuses it
    from jvllm.config import ModelConfig

    base = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=512,
                tie_word_embeddings=False, hidden_act="xielu")
    with pytest.raises(ValueError, match="unsupported hidden_act 'xielu'; supported: silu"):
        ModelConfig(architecture="LlamaForCausalLM", **base)
    assert ModelConfig(architecture="ApertusForCausalLM", **base).hidden_act == "xielu"


@pytest.mark.parametrize("arch", ["gemma2", "gemma3", "phi3", "olmo3", "smollm3_window", "gpt2", "opt", "gptj", "gpt_bigcode", "stablelm", "falcon_40b", "ernie4_5", "nemotron", "exaone4", "olmo", "helium", "hunyuan_dense", "apertus", "gpt_neox",
                                  "starcoder2", "cohere2", "glm4"])
def test_engine_modes_match_transformers(ckpt_dir, arch):
    """One engine: 8-token blocks and 13 of them (preemption), a 32-token budget (chunked
    prefill), prompts that share a 35-token prefix and a second pass (prefix-cache hits); the
    sliding windows (8) span block boundaries."""
    path = ckpt_dir(arch)
    rng = np.random.default_rng(2)
    shared = rng.integers(3, 256, 35).tolist()
    prompts = [rng.integers(3, 256, int(k)).tolist() for k in rng.integers(20, 60, 5)]
    prompts += [shared + [5, 6], shared + [9, 9, 9]]
    llm = LLM(path, dtype="float32", use_tqdm_on_load=False, max_model_len=96, num_gpu_blocks_override=13,
              block_size=8, max_num_batched_tokens=32, token_buckets=(8, 32), max_num_seqs=8)
    sp = SamplingParams(max_tokens=N_NEW, temperature=0.0, ignore_eos=True)
    try:
        run = lambda: [o.outputs[0].token_ids for o in llm.generate(  # noqa: E731
            [{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)]
        ours = run()
        assert run() == ours
        stats = llm.get_stats()
    finally:
        llm.shutdown()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hit_rate"] > 0.02, {k: stats[k] for k in ("num_preemptions", "prefix_cache_hit_rate")}
    assert stats["num_free_blocks"] == stats["num_blocks"] - 1
    assert stats["compiles_after_warmup"] == 0
    ref = hf_model(path)
    assert ours == [hf_greedy(ref, p, N_NEW) for p in prompts]


TP_PROMPTS = [[3, 4, 5, 6, 7], list(range(10, 37)), [200, 1, 2] * 6]


def _tp_run(path, **kw):
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    llm = LLM(path, dtype="float32", max_model_len=128, max_num_batched_tokens=32, max_num_seqs=8,
              token_buckets=(8, 32), use_tqdm_on_load=False, **kw)
    try:
        return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in TP_PROMPTS], sp,
                                                             use_tqdm=False)]
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def one_device(ckpt_dir):
    made = {}

    def run(arch):
        if arch not in made:
            made[arch] = (ckpt_dir(arch), _tp_run(ckpt_dir(arch)))
        return made[arch]

    return run


# TP=4 only where it takes another path than TP=2: fewer KV heads (2) than devices (replicated
# KV) meets Gemma 3's, OLMo 2's and Command R+'s q/k norms; NeoX's 4 KV heads stay sharded at 4
# devices as at 2 (one path: its TP=4 case checked nothing its TP=2 case does not)
TP_CASES = [(2, a) for a in ("gemma3", "olmo2", "gpt_neox", "cohere_qk")] + [(4, a) for a in (
    "gemma3", "olmo2", "cohere_qk")]


@pytest.mark.parametrize("tp,arch", TP_CASES, ids=[f"{tp}-{a}" for tp, a in TP_CASES])
def test_tensor_parallel_identical(one_device, arch, tp):
    """Gemma 3 (head_dim 256, sliding + global layers, q/k norms), OLMo 2 (q/k norms over all
    heads jointly, so over the sharded head axis), GPT-NeoX (biases, dense MLP, parallel residual)
    and Command R+ (q/k norm weights per head, sharded with them) on 2 fake CPU devices give the
    one-device tokens, and all but NeoX on 4 too, where they have fewer KV heads (2) than devices
    (replicated KV path)."""
    path, expected = one_device(arch)
    assert _tp_run(path, tensor_parallel_size=tp) == expected


def test_registry_and_errors():
    """Families are registered once; lookups and bad inputs fail naming the value and what exists."""
    from jvllm.converters import CheckpointError, model_config, resolve_model
    from jvllm.converters.name_map import map_name, t_split_qkv
    from jvllm.models.registry import Family, family_of, register, supported_architectures

    assert {"Gemma2ForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM", "LlamaForCausalLM"} <= set(
        supported_architectures())
    assert family_of("Gemma3ForCausalLM").model_class().__name__ == "GemmaForCausalLM"
    with pytest.raises(ValueError, match=r"unsupported architecture 'BloomForCausalLM'; supported: .*Gemma3ForCausalLM"):
        family_of("BloomForCausalLM")
    with pytest.raises(ValueError, match=r"architecture 'Gemma2ForCausalLM' is registered by 'gemma' and 'again'"):
        register(Family("again", ("Gemma2ForCausalLM",), {}, "jvllm.models.gemma:GemmaForCausalLM"))
    with pytest.raises(ValueError, match=r"model_types map to unregistered architectures \['X'\]"):
        Family("bad", ("Y",), {"y": "X"}, "m:C")
    with pytest.raises(ValueError, match=r"unknown name map 'moe2'; known: llama, gemma, fused"):
        map_name("model.norm.weight", "moe2")
    assert map_name("model.layers.3.self_attn.qkv_proj.weight", "fused")[0] == (
        "layers.3.self_attn.q_proj", "layers.3.self_attn.k_proj", "layers.3.self_attn.v_proj")
    with pytest.raises(CheckpointError, match=r"tensor 'qkv': shape \(10, 8\) but the model expects \(32, 8\)"):
        t_split_qkv("qkv", np.zeros((10, 8)), [(8, 2, 8), (8, 1, 8), (8, 1, 8)])
    c = model_config(resolve_model("random:gemma3-4b"))  # the GPU benchmark's shape
    assert (c.architecture, c.head_dim, c.layer_windows[:6], c.rope_type, c.local_rope_theta) == (
        "Gemma3ForCausalLM", 256, (1024,) * 5 + (None,), "linear", 10000.0)


def test_bigcode_qkv_layouts_differ():
    """GPTBigCode's fused c_attn: one KV head takes [q | k | v] blocks, MHA takes each head's
    [q; k; v] rows (transformers' view as [heads, 3 * head_dim]); the two splits of one MHA tensor
    differ, so a wrong choice cannot pass the parity tests."""
    from jvllm.converters.gpt_names import t_grouped_qkv as t_bigcode_qkv
    from jvllm.converters.name_map import t_split_qkv

    rng = np.random.default_rng(0)
    d, h, hd = 8, 2, 4
    w = rng.normal(size=(3 * h * hd, d)).astype(np.float32)
    mha = t_bigcode_qkv("c_attn", w, [(d, h, hd)] * 3)
    per_head = w.reshape(h, 3, hd, d)
    for i, got in enumerate(mha):
        np.testing.assert_array_equal(got, per_head[:, i].transpose(2, 0, 1))
    assert not np.array_equal(mha[0], t_split_qkv("c_attn", w, [(d, h, hd)] * 3)[0])
    mq = rng.normal(size=((h + 2) * hd, d)).astype(np.float32)
    q, k, v = t_bigcode_qkv("c_attn", mq, [(d, h, hd), (d, 1, hd), (d, 1, hd)])
    np.testing.assert_array_equal(k[:, 0], mq[h * hd:(h + 1) * hd].T)


def test_opt_names_and_refused_variants(ckpt_dir, tmp_path):
    """OPT: facebook/opt-* files name their tensors without the "model." prefix and leave the tied
    head out; such a file loads to the same params. The variants jvllm does not implement (OPT-350m's
    post-norm layers and projected embeddings, LayerNorms without weights; Falcon-RW's ALiBi and
    sequential Falcon layers; StableLM 2 12B's parallel residual and per-head q/k LayerNorms) are
    errors naming them."""
    import shutil

    import transformers
    from safetensors.numpy import load_file, save_file

    from jvllm.converters import load_checkpoint
    from jvllm.hf_config import model_config_from_hf

    path = ckpt_dir("opt")
    old = tmp_path / "opt_old_names"
    shutil.copytree(path, old)
    sd = load_file(f"{path}/model.safetensors")
    save_file({k.removeprefix("model."): v for k, v in sd.items() if k != "lm_head.weight"},
              str(old / "model.safetensors"), metadata={"format": "pt"})
    a, b = load_checkpoint(path).params, load_checkpoint(str(old)).params
    assert sorted(a) == sorted(b) and "pos_embed" in a
    for k in a:
        np.testing.assert_array_equal(np.asarray(a[k]), np.asarray(b[k]), err_msg=k)
    small = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=256)
    for bad, msg in [(dict(alibi=True), "alibi=True"), (dict(parallel_attn=False), "parallel_attn=False")]:
        cfg = transformers.FalconConfig(**{k: v for k, v in small.items() if k != "intermediate_size"}, **bad)
        cfg.architectures = ["FalconForCausalLM"]
        with pytest.raises(ValueError, match=f"FalconForCausalLM: config sets {msg}, which jvllm does not implement"):
            model_config_from_hf(cfg)
    for bad in ("use_parallel_residual", "qk_layernorm"):  # StableLM 2 12B's
        cfg = transformers.StableLmConfig(**small, **{bad: True})
        cfg.architectures = ["StableLmForCausalLM"]
        with pytest.raises(ValueError, match=f"StableLmForCausalLM: config sets {bad}=True, which jvllm does not implement"):
            model_config_from_hf(cfg)
    base = dict(hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=256)
    for bad, msg in [(dict(do_layer_norm_before=False), "do_layer_norm_before=False"),
                     (dict(word_embed_proj_dim=32), r"word_embed_proj_dim=32 \(hidden_size 64\)"),
                     (dict(layer_norm_elementwise_affine=False), "layer_norm_elementwise_affine=False")]:
        cfg = transformers.OPTConfig(**base, **bad)
        cfg.architectures = ["OPTForCausalLM"]
        with pytest.raises(ValueError, match=f"OPTForCausalLM: config sets {msg}, which jvllm does not implement"):
            model_config_from_hf(cfg)


def test_gemma2_pallas_kernels_match_transformers(ckpt_dir):
    """Gemma 2 through the Pallas backends (interpret mode): soft-capped and sliding layers take
    the ragged kernel on every step, decode-only steps too."""
    path = ckpt_dir("gemma2")
    prompts = [[5, 9, 200, 31] * 5, list(range(3, 20))]
    llm = LLM(path, dtype="float32", use_tqdm_on_load=False, max_model_len=32, max_num_batched_tokens=16,
              token_buckets=(16,), max_num_seqs=2, attention_backend="pallas_interpret")
    sp = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    try:
        ours = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp,
                                                             use_tqdm=False)]
    finally:
        llm.shutdown()
    ref = hf_model(path)
    assert ours == [hf_greedy(ref, p, 5) for p in prompts]


@pytest.mark.parametrize("arch", ["gpt2", "olmo2"])
def test_hidden_states_match_transformers(ckpt_dir, arch):
    """`return_hidden_states` in transformers' numbering for a family whose embedding stage adds
    learned positions (GPT-2: hidden state 0 is token + position embeddings) and a post-norm one
    (OLMo 2), within 1e-4 of each token's largest value."""
    import torch

    path = ckpt_dir(arch)
    llm = LLM(path, dtype="float32", max_model_len=64, max_num_batched_tokens=32, max_num_seqs=4,
              token_buckets=(8, 32), use_tqdm_on_load=False)
    try:
        L = llm.llm_engine.model_config.num_layers
        sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, return_hidden_states=list(range(L + 1)))
        c = llm.generate([{"prompt_token_ids": TP_PROMPTS[1]}], sp, use_tqdm=False)[0].outputs[0]
    finally:
        llm.shutdown()
    ids = TP_PROMPTS[1] + c.token_ids[:-1]
    with torch.no_grad():
        hf = hf_model(path)(torch.tensor([ids]), output_hidden_states=True).hidden_states
    for i in range(L + 1):
        want = hf[i][0].numpy()
        assert c.hidden_states[i].shape == want.shape
        assert (np.abs(c.hidden_states[i] - want) <= 1e-4 * np.abs(want).max(-1, keepdims=True)).all(), i


@pytest.mark.parametrize("arch", ["phi3", "gemma2", "cohere_qk", "gpt2", "opt", "gptj", "gpt_bigcode_mha", "falcon",
                                  "gpt_neox"])
def test_update_weights_from_hf_pairs_uses_the_family_name_map(ckpt_dir, arch):
    """`update_weights` with the checkpoint's own (HF name, array) pairs goes through the family's
    name map: fused tensors split (Phi-3's qkv_proj, GPT-2's c_attn, NeoX's per-head
    query_key_value), Gemma's extra norms, Cohere's q/k rows regrouped; after scrambling every
    weight, the pairs bring back exactly the loaded params."""
    from safetensors.numpy import load_file

    from jvllm.worker.weights import live_params

    path = ckpt_dir(arch)
    llm = LLM(path, dtype="float32", max_model_len=64, max_num_batched_tokens=32, max_num_seqs=4,
              token_buckets=(8, 32), use_tqdm_on_load=False)
    try:
        loaded = {k: np.asarray(v) for k, v in live_params(llm.llm_engine.runner).items()}
        llm.update_weights({k: v[::-1] * 0.5 for k, v in loaded.items()})
        llm.update_weights(load_file(f"{path}/model.safetensors").items())
        after = {k: np.asarray(v) for k, v in live_params(llm.llm_engine.runner).items()}
    finally:
        llm.shutdown()
    assert sorted(after) == sorted(loaded)
    for k in loaded:
        np.testing.assert_array_equal(after[k], loaded[k], err_msg=k)


def test_update_weights_refuses_one_expert_by_hf_name(ckpt_dir):
    from jvllm.worker.weights import normalize

    with pytest.raises(ValueError, match=r"one expert of the stacked parameter 'layers.0.mlp.expert_gate'"):
        normalize([("model.layers.0.mlp.experts.1.gate_proj.weight", np.zeros((32, 64), np.float32))],
                  {"layers.0.mlp.expert_gate": ((4, 64, 32), np.float32, ())}, tied=False, name_map="moe")


@pytest.mark.parametrize("arch", ["gpt2", "cohere2"])
def test_pipeline_stages_identical(one_device, arch):
    """Two pipeline stages (GPT-2's position table in the first, Cohere 2's rope-free global layer
    in the second) give the one-device tokens."""
    path, expected = one_device(arch)
    assert _tp_run(path, pipeline_parallel_size=2) == expected
