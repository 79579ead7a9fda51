"""GGUF files of every family whose llama.cpp layout differs from a plain Llama's: the mixture-of-
experts files (Mixtral as arch llama with experts, qwen2moe, qwen3moe, olmoe), Gemma 1, 2 and 3, Phi-3,
Qwen2/3, SmolLM3, Granite, OLMo 2, Command R, Cohere 2, StarCoder2, Phi-2, GPT-2, GPT-NeoX and GLM-4: tiny random HF checkpoints re-encoded the way llama.cpp does
(tests.gguf_util.write_hf_as_gguf, names from the gguf package's own table), read back name by
name and shape by shape, their config and rope read back from the metadata, and their float32
logits against transformers on the original checkpoint; quantized experts against the gguf
package's dequantization."""
import dataclasses

import numpy as np
import pytest

from tests.gguf_util import jvllm_logits, write_hf_as_gguf

PROMPTS = [list(range(3, 40)), [5, 6, 7], [200, 17, 3, 3, 3, 9] * 5]
# case -> (tests.helpers.ARCHS key, overrides llama.cpp's format can carry): Qwen2-MoE with every
# layer sparse (its converter has no dense-layer names), Gemma 2 with query_pre_attn_scalar =
# head_dim (GGUF does not store it), Gemma 3 in llama.cpp's fixed layer pattern (5 sliding, then 1
# global with the linear rope scaling of the 4B and larger), Qwen2 without its window (llama.cpp
# stores none), Phi-3 with longrope + partial rotary + a window, a 4k Phi-3 with plain rope, SmolLM3
# in llama.cpp's fixed NoPE pattern (every 4th layer), Granite's multipliers, OLMo 2's post-norms,
# Command R+ (per-head q/k norms), Cohere 2 (3 sliding layers, then a rope-free global one) and
# StarCoder2 without its window (llama.cpp stores none); Phi-2 with q/k/v apart and fused (older files), GPT-NeoX with and without the parallel residual,
# GPT-2 with an n_inner other than 4 x hidden, GLM-4-0414 (sandwich norms, fused gate_up, half rotary)
CASES = {"mixtral": ("mixtral", {}), "qwen2_moe": ("qwen2_moe", dict(mlp_only_layers=None)),
         "qwen3_moe": ("qwen3_moe", {}), "gemma": ("gemma", {}), "gemma2": ("gemma2", dict(query_pre_attn_scalar=16)),
         "gemma3": ("gemma3", dict(num_hidden_layers=6, layer_types=None)),
         "qwen2": ("qwen2", dict(use_sliding_window=False)), "qwen3": ("qwen3", {}),
         "phi3": ("phi3", dict(sliding_window=8)),
         "phi3_4k": ("phi3", dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
         "smollm3": ("smollm3", dict(num_hidden_layers=4, no_rope_layer_interval=4)), "granite": ("granite", {}),
         "olmo2": ("olmo2", {}), "cohere": ("cohere_qk", {}), "cohere2": ("cohere2", {}),
         "starcoder2": ("starcoder2", dict(sliding_window=None)), "olmoe": ("olmoe", {}),
         "phi2": ("phi", {}), "phi2_fused_qkv": ("phi", dict(fuse_qkv=True)),
         "gptneox": ("gpt_neox", {}), "gptneox_seq": ("gpt_neox_seq", {}), "gpt2": ("gpt2", {}), "glm4": ("glm4", {})}


@pytest.fixture(scope="module")
def gguf_case(ckpt_dir, tmp_path_factory):
    made = {}

    def make(case, qtype="F32"):
        if (case, qtype) not in made:
            arch, overrides = CASES[case]
            fuse = overrides.get("fuse_qkv", False)
            hf = ckpt_dir(arch, **{k: v for k, v in overrides.items() if k != "fuse_qkv"})
            out = str(tmp_path_factory.mktemp(f"gguf_{case}") / f"{case}-{qtype}.gguf")
            made[case, qtype] = (hf, write_hf_as_gguf(hf, out, lambda n, s: qtype, fuse_qkv=fuse))
        return made[case, qtype]

    return make


@pytest.mark.parametrize("case", sorted(CASES))
def test_gguf_names_shapes_and_config(gguf_case, case):
    """Every tensor of the file comes back under the checkpoint's HF name with its shape and
    values (float32 file), and the config read from the metadata is the checkpoint's, its rope
    per layer kind included (GGUF stores floats as float32)."""
    from safetensors.numpy import load_file

    from jvllm.config import ModelConfig
    from jvllm.converters.gguf import gguf_hf_config, gguf_tensor_stream, model_config_from_dict
    from jvllm.models.layers import layer_rope

    hf, path = gguf_case(case)
    want = load_file(f"{hf}/model.safetensors")
    got = {name: load() for name, load in gguf_tensor_stream(path)}
    assert sorted(got) == sorted(want)
    for name, a in got.items():
        assert a.shape == want[name].shape, name
        np.testing.assert_allclose(a, want[name], atol=1e-6, err_msg=name)
    ours = model_config_from_dict(gguf_hf_config(path))
    ref = ModelConfig.from_pretrained(hf)
    skip = {"max_position_embeddings", "bos_token_id", "eos_token_ids", "rope_scaling", "local_rope_scaling"}

    def same(a, b):
        return a == pytest.approx(b, rel=1e-6) if isinstance(b, float) else a == b

    diff = {f.name: (getattr(ours, f.name), getattr(ref, f.name)) for f in dataclasses.fields(ModelConfig)
            if f.name not in skip and not same(getattr(ours, f.name), getattr(ref, f.name))}
    assert diff == {}
    assert ours.rope_type == ref.rope_type
    for local in (False, True):
        a, b = layer_rope(ours, local), layer_rope(ref, local)
        assert (a.long_inv_freq is None) == (b.long_inv_freq is None) and a.long_from == b.long_from
        np.testing.assert_allclose(a.inv_freq + (a.long_inv_freq or ()), b.inv_freq + (b.long_inv_freq or ()),
                                   rtol=1e-6)
        assert a.scale == pytest.approx(b.scale, rel=1e-6)


@pytest.mark.parametrize("case", sorted(CASES))
def test_gguf_logits_match_transformers(gguf_case, case):
    """jvllm from the GGUF file == transformers from the original safetensors (float32, 1e-4); and,
    for longrope (Phi-3, the only rope here whose frequencies depend on the position past a
    threshold), == jvllm from the safetensors on a prompt past the original context (its long
    factors: transformers switches a whole pass to them there, jvllm per position, so transformers
    is no reference for that prompt). The other ropes see nothing new at 80 tokens: the 37- and
    30-token prompts already span every window (8) and rope of theirs."""
    import torch
    import transformers

    from jvllm.config import ModelConfig

    hf, path = gguf_case(case)
    ref = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    for ids, ours in zip(PROMPTS, jvllm_logits(path, PROMPTS)):
        with torch.no_grad():
            theirs = ref(torch.tensor([ids])).logits[0].numpy()
        assert np.abs(ours - theirs).max() < 1e-4, (case, float(np.abs(ours - theirs).max()))
    longrope = ModelConfig.from_pretrained(hf).rope_type == "longrope"
    assert longrope == (case == "phi3"), case  # the long prompt below runs where it matters
    if not longrope:
        return
    long = [list(range(3, 83))]
    (ours,), (want,) = jvllm_logits(path, long), jvllm_logits(hf, long)
    assert np.abs(ours - want).max() < 1e-4, (case, float(np.abs(ours - want).max()))


@pytest.mark.parametrize("arch,qtype", [("qwen3_moe", "Q8_0"), ("mixtral", "Q4_0")])
def test_gguf_quantized_experts(gguf_case, arch, qtype):
    """Quantized stacked experts (and permuted q/k for arch llama) read back as the gguf
    package's own dequantization of each expert's quantized rows. (transformers' GGUF reader is
    no reference for these tiny files: it ignores expert_feed_forward_length and norm_topk_prob.)"""
    import gguf
    from safetensors.numpy import load_file

    from jvllm.converters.gguf import gguf_tensor_stream

    hf, path = gguf_case(arch, qtype)
    want = load_file(f"{hf}/model.safetensors")
    Q = gguf.GGMLQuantizationType[qtype]
    got = {name: load() for name, load in gguf_tensor_stream(path)}
    assert sorted(got) == sorted(want)
    n_quant = 0
    for name, a in got.items():
        w = want[name]
        if w.ndim == 2:  # quantized row-wise; a row permutation commutes with it
            w = gguf.quants.dequantize(gguf.quants.quantize(w, Q), Q)
            n_quant += 1
        np.testing.assert_allclose(a, w, atol=1e-6, err_msg=name)
    assert n_quant > len(got) // 2


def test_gguf_moe_errors(gguf_case, tmp_path):
    import gguf

    from jvllm.converters import CheckpointError
    from jvllm.converters.gguf import gguf_hf_config, gguf_tensor_stream

    _, path = gguf_case("qwen3_moe")
    r = gguf.GGUFReader(path)

    def rewrite(out, drop_key=None, set_u32=None, cut_experts=False):
        w = gguf.GGUFWriter(out, "qwen3moe")
        for k, f in r.fields.items():
            if k.startswith("GGUF.") or k == "general.architecture" or k == drop_key:
                continue
            v = f.contents()
            if isinstance(v, int):
                w.add_uint32(k, v)
            elif isinstance(v, float):
                w.add_float32(k, v)
            elif isinstance(v, str):
                w.add_string(k, v)
        for k, v in (set_u32 or {}).items():
            w.add_uint32(k, v)
        for t in r.tensors:
            a = np.asarray(t.data).reshape(tuple(reversed([int(d) for d in t.shape])))
            if cut_experts and t.name == "blk.0.ffn_up_exps.weight":
                a = a[:-1]
            w.add_tensor(t.name, np.ascontiguousarray(a))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return out

    with pytest.raises(ValueError, match="needs qwen3moe.expert_count and qwen3moe.expert_used_count"):
        gguf_hf_config(rewrite(str(tmp_path / "a.gguf"), drop_key="qwen3moe.expert_count"))
    with pytest.raises(ValueError, match="qwen3moe.expert_gating_func 2 is not supported"):
        gguf_hf_config(rewrite(str(tmp_path / "b.gguf"), set_u32={"qwen3moe.expert_gating_func": 2}))
    cut = rewrite(str(tmp_path / "c.gguf"), cut_experts=True)
    with pytest.raises(CheckpointError, match=r"'blk.0.ffn_up_exps.weight' has shape \(15, 32, 64\); expected \[16"):
        for _, load in gguf_tensor_stream(cut):
            load()
