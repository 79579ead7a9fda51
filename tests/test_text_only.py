"""Multimodal checkpoints served as their text decoder (jvllm.models.registry.TextOnly): a tiny
random Gemma3ForConditionalGeneration (SigLIP tower + projector around a Gemma 3 decoder, as the
4B / 12B / 27B checkpoints ship) against transformers' own multimodal model on text prompts, in
the hub's tensor layout and in transformers 5's."""
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
