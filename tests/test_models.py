"""Parity with transformers (float32 logits) for every supported family and checkpoint format."""
import numpy as np
import pytest

from jvllm.config import ModelConfig
from jvllm.verify import verify
from tests.helpers import ARCHS

# float32 on both sides; observed differences are ~1e-6. A real bug (wrong rope, window, bias,
# norm placement, permutation) gives differences of 1e-2 .. 1 on these random models.
ATOL = 1e-4
PROMPTS = [list(range(3, 40)), [5, 6, 7], [200, 17, 3, 3, 3, 9] * 5]


def _check(path):
    ok, reports = verify(path, prompts=PROMPTS, atol=ATOL, log=lambda *a: None)
    assert ok, [(r.max_abs_diff, r.top1_agreement) for r in reports]
    return reports


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_family_parity(ckpt_dir, arch):
    _check(ckpt_dir(arch))


@pytest.mark.parametrize("fmt", ["sharded", "bin", "bin_sharded", "bf16", "f16"])
def test_format_parity(ckpt_dir, fmt):
    _check(ckpt_dir("qwen2", fmt=fmt))


def test_moe_state_dict_layout(ckpt_dir):
    """A torch.save of transformers 5's state dict fuses every layer's experts (experts.gate_up_proj
    [E, 2I, D], experts.down_proj [E, D, I]); it loads like the per-expert files save_pretrained writes."""
    _check(ckpt_dir("qwen2_moe", fmt="bin"))


# config fields that change what transformers computes, beyond each family's test checkpoint:
# (family, overrides, extra config.json keys written after save_pretrained)
VARIANTS = {
    "moe_experts_gelu": ("mixtral", dict(hidden_act="gelu_pytorch_tanh"), {}),
    "qwen2_moe_no_qkv_bias_no_shared": ("qwen2_moe", dict(qkv_bias=False, shared_expert_intermediate_size=0), {}),
    # Mixtral windows every layer and never reads layer_types (Mistral does)
    "mixtral_ignores_layer_types": ("mixtral_window", {}, {"layer_types": ["full_attention", "sliding_attention"]}),
    # transformers' Gemma 3 reads attn_logit_softcapping nowhere
    "gemma3_attn_softcap_unused": ("gemma3", dict(attn_logit_softcapping=0.5), {}),
    # GPT-2 without the 1 / sqrt(head_dim) attention scale
    "gpt2_unscaled_attention": ("gpt2", dict(scale_attn_weights=False), {}),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_config_variant_parity(tmp_path, variant):
    import json

    from tests.helpers import make_checkpoint

    arch, overrides, extra = VARIANTS[variant]
    make_checkpoint(str(tmp_path), arch, **overrides)
    if extra:
        cfg = json.loads((tmp_path / "config.json").read_text())
        (tmp_path / "config.json").write_text(json.dumps({**cfg, **extra}))
    _check(str(tmp_path))


def test_refused_config_fields(tmp_path):
    """Fields the reference honours and jvllm does not implement are errors naming them."""
    import transformers

    from jvllm import LLM

    cfg = transformers.Gemma3TextConfig(use_bidirectional_attention=True, architectures=["Gemma3ForCausalLM"])
    with pytest.raises(ValueError, match="use_bidirectional_attention=True"):
        ModelConfig.from_hf_config(cfg)
    from tests.helpers import make_checkpoint

    make_checkpoint(str(tmp_path), "llama", max_position_embeddings=64,
                    rope_scaling=dict(rope_type="dynamic", factor=4.0))
    with pytest.raises(ValueError, match=r"max_model_len \(128\) exceeds .*\(64\); rope_scaling 'dynamic'"):
        LLM(str(tmp_path), dtype="float32", max_model_len=128, use_tqdm_on_load=False)


def test_sliding_window_matters(ckpt_dir):
    """The window really is applied: the same weights without it give different logits."""
    import jax.numpy as jnp

    from jvllm.converters import load_checkpoint
    from jvllm.models import bind
    from jvllm.worker.model_runner import ModelRunner

    ck = load_checkpoint(ckpt_dir("mistral"))
    outs = []
    for windows in (ck.config.layer_windows, (None,) * ck.config.num_layers):
        import dataclasses

        cfg = dataclasses.replace(ck.config, layer_windows=windows)
        g, s = bind(cfg, ck.params)
        r = ModelRunner(cfg, g, s, ck.params["lm_head"], dtype=jnp.float32, block_size=16, num_blocks=4,
                        max_model_len=40, max_num_seqs=1, token_buckets=(37,))
        outs.append(r.sequence_logits(PROMPTS[0]))
    assert np.abs(outs[0][:8] - outs[1][:8]).max() < 1e-6  # inside the window: identical
    assert np.abs(outs[0][-1] - outs[1][-1]).max() > 1e-3  # beyond it: different


def test_config_styles_and_errors():
    import transformers

    rs = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=64)
    c = ModelConfig.from_hf_config(transformers.LlamaConfig(rope_theta=500000.0, rope_scaling=rs,
                                                            max_position_embeddings=1024))
    assert c.rope_type == "llama3" and c.rope_theta == 500000.0 and c.rope_params["factor"] == 8.0
    # transformers 4.x style (no rope_parameters attribute)
    fields = dict(architectures=["LlamaForCausalLM"], vocab_size=10, hidden_size=8,
                  intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, rope_theta=1234.0, rope_scaling={"type": "linear", "factor": 2.0},
                  max_position_embeddings=64, rms_norm_eps=1e-5)
    ns = type("Cfg", (), fields)()
    c4 = ModelConfig.from_hf_config(ns)
    assert c4.rope_theta == 1234.0 and c4.rope_type == "linear" and c4.head_dim == 4
    with pytest.raises(ValueError, match="unsupported architecture 'BloomForCausalLM'.*LlamaForCausalLM"):
        ModelConfig.from_hf_config(transformers.BloomConfig(architectures=["BloomForCausalLM"]))
    with pytest.raises(ValueError, match="unsupported rope scaling type 'ntk_by_parts'"):
        ModelConfig.from_hf_config(type("C", (), dict(fields, rope_scaling={"rope_type": "ntk_by_parts"}))())
    with pytest.raises(ValueError, match="longrope short_factor needs 2 values"):
        ModelConfig.from_hf_config(type("C", (), dict(fields, rope_scaling={"rope_type": "longrope"}))())
    with pytest.raises(ValueError, match="num_heads"):
        ModelConfig(architecture="LlamaForCausalLM", vocab_size=8, hidden_size=8, intermediate_size=8,
                    num_layers=1, num_heads=3, num_kv_heads=2, head_dim=4)


def test_param_declarations_have_logical_axes():
    from jvllm.models import param_specs
    from jvllm.models.layers import LOGICAL_AXES

    cfg = ModelConfig(architecture="Qwen3ForCausalLM", vocab_size=32, hidden_size=16, intermediate_size=24,
                      num_layers=1, num_heads=4, num_kv_heads=2, head_dim=4, qk_norm=True)
    specs = param_specs(cfg)
    assert specs["layers.0.self_attn.q_proj"] == ((16, 4, 4), np.dtype("float32"), ("embed", "heads", "head_dim"))
    assert specs["layers.0.self_attn.k_norm.weight"][2] == ("head_dim",)
    for name, (shape, _, axes) in specs.items():
        assert len(axes) == len(shape) and set(axes) <= set(LOGICAL_AXES), name
