"""Config keys read as transformers reads them: an attribute an architecture's transformers class
never reads (PretrainedConfig keeps any stray key, e.g. from a shared dict of tiny-config sizes)
changes nothing (`Family.unread`), a multimodal wrapper's plain LM head drops its decoder's logit
extras, and two router / rope fields the reference honours (ERNIE 4.5's `moe_norm_min`,
Phi-3.5-MoE's longrope `short_mscale` / `long_mscale`) change the logits exactly as there."""
import pytest

from jvllm.hf_config import model_config_from_hf
from tests.helpers import make_checkpoint, tiny_hf_config

# (arch, the config's own overrides, stray keys): each checked against transformers' logits when
# these tests were written (the reference runs these configs and ignores the stray keys)
UNREAD = [
    ("gpt2", dict(n_inner=None), dict(intermediate_size=128)), ("gptj", dict(n_inner=None), dict(intermediate_size=128)),
    ("gpt_bigcode", dict(n_inner=None), dict(intermediate_size=128)), ("gpt2", {}, dict(num_key_value_heads=2)),
    ("opt", {}, dict(num_key_value_heads=2)), ("gpt_neox", {}, dict(num_key_value_heads=2)),
    ("gptj", {}, dict(num_key_value_heads=2)), ("gpt2", {}, dict(head_dim=32)), ("gpt_neox", {}, dict(head_dim=32)),
    ("stablelm", {}, dict(head_dim=32)), ("mistral", {}, dict(attention_bias=True)),
    ("mixtral", {}, dict(attention_bias=True)), ("qwen2", {}, dict(mlp_bias=True)), ("qwen3", {}, dict(mlp_bias=True)),
    ("llama", {}, dict(partial_rotary_factor=0.5)), ("qwen2", {}, dict(partial_rotary_factor=0.5)),
    ("mistral", {}, dict(partial_rotary_factor=0.5)),
]


def _cfg(arch, **kw):
    return model_config_from_hf(tiny_hf_config(arch, **kw))


@pytest.mark.parametrize("arch,own,stray", UNREAD, ids=[f"{a}-{'-'.join(s)}" for a, _, s in UNREAD])
def test_keys_the_reference_never_reads_change_nothing(arch, own, stray):
    with_stray = tiny_hf_config(arch, **own, **stray)
    clean = tiny_hf_config(arch, **own)
    for k in list(stray) + ["intermediate_size", "head_dim", "num_key_value_heads"]:  # TINY's shared sizes too
        if k not in type(clean)().to_dict() and hasattr(clean, k):
            delattr(clean, k)
    rope = getattr(clean, "rope_parameters", None)
    if isinstance(rope, dict) and "partial_rotary_factor" in stray:  # transformers 5 moves it there
        rope.pop("partial_rotary_factor", None)
    assert model_config_from_hf(with_stray) == model_config_from_hf(clean)


@pytest.mark.parametrize("arch,keys,field", [("llama", dict(attention_bias=True), "attention_bias"),
                                             ("llama", dict(mlp_bias=True), "mlp_bias"),
                                             ("stablelm", dict(partial_rotary_factor=0.75), "partial_rotary_factor"),
                                             ("gpt_neox", dict(rotary_pct=0.5), "partial_rotary_factor")])
def test_keys_the_reference_reads_still_count(arch, keys, field):
    """The control: where the transformers class reads the key, it still changes the config."""
    assert getattr(_cfg(arch, **keys), field) != getattr(_cfg(arch), field)


def test_multimodal_wrappers_have_a_plain_head():
    """LLaVA / Gemma 3's multimodal classes end in a bias-free nn.Linear: the decoder's soft-cap,
    logit scales and head bias are not applied there."""
    import transformers

    text = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, vocab_size=300, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512)
    clip = dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=2, image_size=28, patch_size=14, projection_dim=32)
    for extra in (dict(model_type="granite", logits_scaling=0.25), dict(model_type="cohere", logit_scale=0.5),
                  dict(model_type="gemma2", head_dim=16, final_logit_softcapping=1.0), dict(model_type="phi")):
        hf = transformers.LlavaConfig(text_config=dict(text, **extra), vision_config=clip, image_token_index=299)
        hf.architectures = ["LlavaForConditionalGeneration"]
        c = model_config_from_hf(hf)
        assert (c.logits_scaling, c.logit_scale, c.final_logit_softcap, c.lm_head_bias) == (None, None, None, False)
    # the decoder alone keeps them
    assert _cfg("granite", logits_scaling=0.25).logits_scaling == 0.25


def _verify(path):
    from jvllm.verify import verify

    ok, reps = verify(path, prompts=[list(range(3, 40)), [5, 6, 7]], atol=1e-4, log=lambda *a: None)
    return ok, [r.max_abs_diff for r in reps]


@pytest.mark.parametrize("arch,kw", [
    ("ernie4_5_moe", dict(moe_norm_min=0.5)),
    ("phimoe", dict(initializer_range=0.1, max_position_embeddings=512, rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 256,
        "short_factor": [1.0] * 8, "long_factor": [2.0] * 8, "short_mscale": 2.0, "long_mscale": 3.0})),
])
def test_router_and_rope_fields_match_transformers(tmp_path, arch, kw):
    """Each field moves the logits (by >= 1e-3 without it, before these fields were read), and
    with it jvllm equals transformers within 1e-4."""
    make_checkpoint(str(tmp_path), arch, **kw)
    ok, diffs = _verify(str(tmp_path))
    assert ok, diffs
    c = model_config_from_hf(tiny_hf_config(arch, **kw))
    assert c.moe.norm_min == 0.5 if arch == "ernie4_5_moe" else c.longrope_mscale


def test_phimoe_longrope_without_mscales_is_an_error():
    """transformers' PhimoeConfig refuses them missing; a config object that lacks them anyway (edited
    after construction) is an error naming them, not the attention factor in their place."""
    hf = tiny_hf_config("phimoe", max_position_embeddings=512, rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 256,
        "short_factor": [1.0] * 8, "long_factor": [2.0] * 8, "short_mscale": 2.0, "long_mscale": 3.0})
    for k in ("short_mscale", "long_mscale"):
        del hf.rope_parameters[k]
    with pytest.raises(ValueError, match=r"short_mscale.*long_mscale"):
        model_config_from_hf(hf)
    assert _cfg("phimoe").longrope_mscale  # default rope: no mscales needed
