"""Multimodal checkpoints served as their text decoder (jvllm.models.registry.TextOnly): tiny
random Gemma 3 (SigLIP tower + projector around a Gemma 3 decoder, as the 4B / 12B / 27B ship),
LLaVA, Mistral 3 / Ministral 3, Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen3-VL-MoE models against
transformers' own multimodal classes on text prompts, in the hub's tensor layouts and in
transformers 5's; and transformers 5's rule for tying the LM head (the config's word, unless the
checkpoint has a head of its own)."""
import json
import os

import numpy as np
import pytest

from jvllm.verify import verify

PROMPTS = [list(range(3, 40)), [5, 6, 7], [200, 17, 3, 3, 3, 9] * 5]
# the text decoder in llama.cpp-free Gemma 3 4B form: 5 sliding layers then a global one with the
# global layers' linear rope scaling; head_dim != hidden / heads
TEXT = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=6, vocab_size=300, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=32, sliding_window=8,
            max_position_embeddings=512, bos_token_id=2, eos_token_id=1, pad_token_id=0,
            rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
              patch_size=14)


@pytest.fixture(scope="module")
def gemma3_mm(tmp_path_factory):
    import torch
    import transformers

    cfg = transformers.Gemma3Config(text_config=TEXT, vision_config=VISION, mm_tokens_per_image=4,
                                    image_token_index=299, boi_token_index=297, eoi_token_index=298)
    cfg.architectures = ["Gemma3ForConditionalGeneration"]
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # random norms, so a misplaced or un-offset norm weight is caught
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(0.1 * torch.randn_like(p))
    d = str(tmp_path_factory.mktemp("gemma3_mm"))
    model.save_pretrained(d)
    return d, model


def test_gemma3_multimodal_text_logits_match_transformers(gemma3_mm):
    """jvllm's text decoder of the multimodal checkpoint == transformers' Gemma3ForConditionalGeneration
    on text-only input ids (float32, 1e-4); the vision tensors are never needed."""
    import torch

    from jvllm.config import ModelConfig
    from jvllm.converters import load_checkpoint
    from safetensors import safe_open

    d, model = gemma3_mm
    names = safe_open(os.path.join(d, "model.safetensors"), "np").keys()
    assert any(n.startswith("language_model.model.") for n in names) and any("vision_tower" in n for n in names)
    cfg = ModelConfig.from_pretrained(d)
    assert cfg.architecture == "Gemma3ForCausalLM" and cfg.tie_word_embeddings
    assert cfg.layer_windows == (8, 8, 8, 8, 8, None) and cfg.rope_type == "linear"
    ck = load_checkpoint(d, "float32")
    assert not any("vision" in k or "projector" in k for k in ck.params)
    ok, reps = verify(d, prompts=PROMPTS, atol=1e-4, log=lambda *a: None)
    assert ok, [r.max_abs_diff for r in reps]
    # the reference verify used is the multimodal model itself, not a text-only stand-in
    from tests.gguf_util import jvllm_logits

    for ids, ours in zip(PROMPTS, jvllm_logits(d, PROMPTS)):
        with torch.no_grad():
            theirs = model(input_ids=torch.tensor([ids])).logits[0].numpy()
        assert np.abs(ours - theirs).max() < 1e-4


def test_gemma3_multimodal_transformers5_layout(gemma3_mm, tmp_path):
    """The same weights under transformers 5's in-memory names (model.language_model.*,
    model.vision_tower.*) load to the same params."""
    from safetensors.numpy import load_file, save_file

    from jvllm.converters import load_checkpoint

    d, _ = gemma3_mm
    sd = load_file(os.path.join(d, "model.safetensors"))
    moves = (("language_model.model.", "model.language_model."), ("vision_tower.", "model.vision_tower."),
             ("multi_modal_projector.", "model.multi_modal_projector."))

    def t5_name(k):
        for old, new in moves:
            if k.startswith(old):
                return new + k[len(old):]
        return k

    renamed = {t5_name(k): v for k, v in sd.items()}
    assert any(k.startswith("model.language_model.layers.") for k in renamed)
    save_file(renamed, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(open(os.path.join(d, "config.json")).read())
    a, b = load_checkpoint(d, "float32").params, load_checkpoint(str(tmp_path), "float32").params
    assert sorted(a) == sorted(b)
    for k in a:
        assert np.array_equal(np.asarray(a[k]), np.asarray(b[k])), k


def test_gemma3_multimodal_orbax_roundtrip(gemma3_mm, tmp_path):
    """`jvllm convert` of the multimodal checkpoint writes the text decoder's params beside the
    multimodal config.json, and they load back equal."""
    from jvllm.converters import convert_to_orbax, load_checkpoint

    d, _ = gemma3_mm
    convert_to_orbax(d, str(tmp_path / "o"), "float32")
    a, b = load_checkpoint(d, "float32"), load_checkpoint(str(tmp_path / "o"), "float32")
    assert a.config == b.config and sorted(a.params) == sorted(b.params)
    for k in a.params:
        assert np.array_equal(np.asarray(a.params[k]), np.asarray(b.params[k])), k


def test_multimodal_errors(gemma3_mm, tmp_path):
    """An image part in a chat message is refused by name (the decoder has no vision tower); an
    unregistered multimodal architecture names the supported ones, the wrapper among them."""
    from jvllm.config import ModelConfig
    from jvllm.inputs import content_text

    d, _ = gemma3_mm
    with pytest.raises(ValueError, match="image_url"):
        content_text([{"type": "text", "text": "what is this?"},
                      {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}])
    cfg = json.load(open(os.path.join(d, "config.json")))
    cfg["architectures"] = ["PaliGemmaForConditionalGeneration"]
    cfg["model_type"] = "gemma3"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"unsupported architecture 'PaliGemma.*Gemma3ForConditionalGeneration"):
        ModelConfig.from_pretrained(str(tmp_path))


# ------------------------------------------------- LLaVA, Mistral 3, Qwen2-VL / 2.5-VL / 3-VL
TINY_TEXT = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, vocab_size=300, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2)
MROPE = {"rope_type": "default", "mrope_section": [2, 3, 3]}  # 2 + 3 + 3 = head_dim 16 / 2


def _wrapper_model(kind: str, tie=None):
    """A tiny random multimodal model of `kind` (transformers' own class) with random norms."""
    import torch
    import transformers as T

    vis_qwen = dict(depth=1, hidden_size=32, num_heads=2, out_hidden_size=64, intermediate_size=64, spatial_merge_size=2)
    if kind == "llava":
        cfg = T.LlavaConfig(text_config=dict(model_type="llama", **TINY_TEXT), image_token_index=299,
                            vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64,
                                               num_hidden_layers=1, num_attention_heads=2, image_size=28,
                                               patch_size=14, projection_dim=32))
        cls = T.LlavaForConditionalGeneration
    elif kind in ("mistral3", "ministral3"):  # Mistral Small 3.1 / 3.2; Ministral 3 (yarn, query temperature)
        text = dict(model_type="mistral", head_dim=16, sliding_window=None, **TINY_TEXT)
        if kind == "ministral3":
            text.update(model_type="ministral3", rope_parameters=dict(
                rope_type="yarn", rope_theta=1e6, factor=16.0, original_max_position_embeddings=8,
                llama_4_scaling_beta=0.5, mscale=1.0, mscale_all_dim=1.0, beta_fast=32.0, beta_slow=1.0))
        cfg = T.Mistral3Config(text_config=text,
                               vision_config=dict(model_type="pixtral", hidden_size=32, intermediate_size=64,
                                                  num_hidden_layers=1, num_attention_heads=2, image_size=28,
                                                  patch_size=14, head_dim=16), image_token_index=299)
        cls = T.Mistral3ForConditionalGeneration
    elif kind == "qwen2_vl":
        cfg = T.Qwen2VLConfig(text_config=dict(rope_parameters={**MROPE, "rope_theta": 1e6}, **TINY_TEXT),
                              vision_config=dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2),
                              image_token_id=299, video_token_id=298, vision_start_token_id=297)
        cls = T.Qwen2VLForConditionalGeneration
    elif kind == "qwen2_5_vl":
        cfg = T.Qwen2_5_VLConfig(text_config=dict(rope_parameters={**MROPE, "rope_theta": 1e6}, **TINY_TEXT),
                                 vision_config=vis_qwen, image_token_id=299, video_token_id=298,
                                 vision_start_token_id=297)
        cls = T.Qwen2_5_VLForConditionalGeneration
    else:  # Qwen3-VL, Qwen3-VL-MoE (4 experts, top-2)
        moe = kind == "qwen3_vl_moe"
        C, cls = ((T.Qwen3VLMoeConfig, T.Qwen3VLMoeForConditionalGeneration) if moe else
                  (T.Qwen3VLConfig, T.Qwen3VLForConditionalGeneration))
        text = dict(head_dim=16, **TINY_TEXT, rope_parameters={**MROPE, "mrope_interleaved": True, "rope_theta": 5e6})
        if moe:
            # 2 x 24 != hidden 64: the two fused-expert layouts differ in shape
            text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, norm_topk_prob=True)
        cfg = C(text_config=text, vision_config=dict(vis_qwen, patch_size=16, num_position_embeddings=16,
                                                     deepstack_visual_indexes=[0]),
                image_token_id=299, video_token_id=298, vision_start_token_id=297)
    if tie is not None:
        cfg.tie_word_embeddings = tie
    torch.manual_seed(0)
    model = cls(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
    return model


def _max_diff(d, model, prompts=PROMPTS[:2]):
    import torch

    from tests.gguf_util import jvllm_logits

    worst = 0.0
    for ids, ours in zip(prompts, jvllm_logits(d, prompts)):
        with torch.no_grad():
            theirs = model(input_ids=torch.tensor([ids])).logits[0].numpy()
        worst = max(worst, float(np.abs(ours - theirs).max()))
    return worst


@pytest.mark.parametrize("kind, decoder, top", [
    ("llava", "LlamaForCausalLM", "language_model.model."), ("mistral3", "MistralForCausalLM", "language_model.model."),
    ("ministral3", "Ministral3ForCausalLM", "language_model.model."),
    ("qwen2_vl", "Qwen2ForCausalLM", "model.layers."), ("qwen2_5_vl", "Qwen2ForCausalLM", "model.layers."),
    ("qwen3_vl", "Qwen3ForCausalLM", "model.language_model."),
    ("qwen3_vl_moe", "Qwen3MoeForCausalLM", "model.language_model.")])
def test_multimodal_wrappers_text_logits_match_transformers(kind, decoder, top, tmp_path):
    """Each wrapper's text decoder (the decoder taken from its text_config for LLaVA / Mistral 3;
    Qwen-VL's M-RoPE as plain rope for text) == transformers' multimodal model on text input ids,
    float32 within 1e-4, from the checkpoint as save_pretrained writes it (the hub's layout)."""
    from safetensors import safe_open

    from jvllm.config import ModelConfig

    model = _wrapper_model(kind)
    model.save_pretrained(str(tmp_path))
    names = list(safe_open(str(tmp_path / "model.safetensors"), "np").keys())
    assert any(n.startswith(top) for n in names) and any("vision" in n or "visual" in n for n in names)
    cfg = ModelConfig.from_pretrained(str(tmp_path))
    assert cfg.architecture == decoder and cfg.tie_word_embeddings == (kind in ("mistral3", "ministral3"))
    assert "mrope_section" not in dict(cfg.rope_scaling or ())
    assert _max_diff(str(tmp_path), model) < 1e-4


def test_wrapper_config_tied_but_checkpoint_has_a_head(tmp_path):
    """Mistral Small 3.1's config.json sets no top-level tie_word_embeddings (transformers 5's
    Mistral 3 default: True) over a checkpoint with its own lm_head: transformers unties, and so
    does jvllm (the checkpoint's head is used, not the embedding)."""
    import transformers

    from jvllm.config import ModelConfig

    _wrapper_model("mistral3", tie=False).save_pretrained(str(tmp_path))
    raw = json.load(open(tmp_path / "config.json"))
    raw.pop("tie_word_embeddings", None)
    raw["text_config"].pop("tie_word_embeddings", None)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    ref = transformers.Mistral3ForConditionalGeneration.from_pretrained(str(tmp_path)).eval()
    assert ref.config.tie_word_embeddings  # what the config says ...
    assert not np.array_equal(ref.lm_head.weight.detach().numpy(),  # ... and what transformers did
                              ref.get_input_embeddings().weight.detach().numpy())
    assert not ModelConfig.from_pretrained(str(tmp_path)).tie_word_embeddings
    assert _max_diff(str(tmp_path), ref) < 1e-4


def test_qwen2_5_vl_transformers5_layout_and_unsupported_decoder(tmp_path):
    """Qwen2.5-VL under transformers 5's names (model.language_model.*, model.visual.*) loads the
    same params as the hub layout; a LLaVA around a decoder jvllm has no family for is refused
    naming its text model_type."""
    from safetensors.numpy import load_file, save_file

    from jvllm.config import ModelConfig
    from jvllm.converters import load_checkpoint

    hub = tmp_path / "hub"
    _wrapper_model("qwen2_5_vl").save_pretrained(str(hub))
    sd = load_file(str(hub / "model.safetensors"))
    t5 = {("model.language_model." + k[len("model."):] if k.startswith("model.") else
           "model." + k if k.startswith("visual.") else k): v for k, v in sd.items()}
    assert any(k.startswith("model.visual.") for k in t5)
    (tmp_path / "t5").mkdir()
    save_file(t5, str(tmp_path / "t5" / "model.safetensors"))
    (tmp_path / "t5" / "config.json").write_text((hub / "config.json").read_text())
    a, b = load_checkpoint(str(hub), "float32").params, load_checkpoint(str(tmp_path / "t5"), "float32").params
    assert sorted(a) == sorted(b)
    for k in a:
        assert np.array_equal(np.asarray(a[k]), np.asarray(b[k])), k

    llava = tmp_path / "llava"
    _wrapper_model("llava").save_pretrained(str(llava))
    raw = json.load(open(llava / "config.json"))
    raw["text_config"] = {**raw["text_config"], "model_type": "bloom"}  # BLOOM: no jvllm family
    (llava / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=r"LlavaForConditionalGeneration: its text decoder \(text_config model_type 'bloom'\)"):
        ModelConfig.from_pretrained(str(llava))


def test_qwen3_vl_moe_hub_expert_layout(tmp_path):
    """Qwen3-VL-MoE's hub checkpoints fuse the experts as [E, D, 2I] / [E, I, D] (transformers 4's
    layout; transformers 5 saves [E, 2I, D] / [E, D, I] and reads both): both load to the same
    params."""
    from safetensors.numpy import load_file, save_file

    from jvllm.converters import load_checkpoint

    v5 = tmp_path / "v5"
    _wrapper_model("qwen3_vl_moe").save_pretrained(str(v5))
    sd = load_file(str(v5 / "model.safetensors"))
    hub = {k: (v.transpose(0, 2, 1).copy() if k.endswith(("experts.gate_up_proj", "experts.down_proj")) else v)
           for k, v in sd.items()}
    assert sd["model.language_model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 48, 64)
    assert hub["model.language_model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 64, 48)
    (tmp_path / "hub").mkdir()
    save_file(hub, str(tmp_path / "hub" / "model.safetensors"))
    (tmp_path / "hub" / "config.json").write_text((v5 / "config.json").read_text())
    a, b = load_checkpoint(str(v5), "float32").params, load_checkpoint(str(tmp_path / "hub"), "float32").params
    assert sorted(a) == sorted(b) and any("expert_gate" in k for k in a)
    for k in a:
        assert np.array_equal(np.asarray(a[k]), np.asarray(b[k])), k


def test_verify_loads_the_wrappers_own_class(tmp_path):
    """`jvllm verify` of a LLaVA checkpoint (which AutoModelForCausalLM cannot load) compares
    against transformers' LlavaForConditionalGeneration."""
    _wrapper_model("llava").save_pretrained(str(tmp_path))
    ok, reps = verify(str(tmp_path), prompts=PROMPTS[:2], atol=1e-4, log=lambda *a: None)
    assert ok and len(reps) == 2, [r.max_abs_diff for r in reps]


def test_any_checkpoint_with_its_own_head_loads_untied(ckpt_dir, tmp_path):
    """The tie rule is transformers 5's for every family: a Llama checkpoint whose config says
    tied over a safetensors file with a distinct lm_head loads untied, in transformers and here."""
    import shutil

    import transformers

    from jvllm.config import ModelConfig

    src = ckpt_dir("llama")  # untied
    for f in os.listdir(src):
        shutil.copy(os.path.join(src, f), tmp_path / f)
    raw = json.load(open(tmp_path / "config.json"))
    raw["tie_word_embeddings"] = True
    (tmp_path / "config.json").write_text(json.dumps(raw))
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    assert not np.array_equal(ref.lm_head.weight.detach().numpy(), ref.get_input_embeddings().weight.detach().numpy())
    assert not ModelConfig.from_pretrained(str(tmp_path)).tie_word_embeddings
    assert _max_diff(str(tmp_path), ref) < 1e-4
