"""The built-in model families and multimodal text-only wrappers: one `register(Family(...))` or
`register_text_only(TextOnly(...))` each (`jvllm.models.registry` says what the fields mean).
Imported by the registry itself, so any lookup sees them; a new family is one model file plus one
registration here. The GPT lineage and the parallel-layer families (Cohere, Phi, GPT-J, Nemotron,
StableLM, StarCoder2, GPT-2, OPT, GPTBigCode, Falcon, GPT-NeoX) are in `families_gpt`."""
from __future__ import annotations

import importlib

from jvllm.models.registry import Derived, Family, FromHF, TextOnly, register, register_text_only


def _smollm3_nope(hf) -> tuple:
    """SmolLM3's no_rope_layers: 1 = rope, 0 = no rotary embedding (NoPE)."""
    return tuple(i for i, r in enumerate(getattr(hf, "no_rope_layers", None) or ()) if not r)


def _smollm3_windows(hf) -> tuple:
    """SmolLM3 windows its layer_types' sliding layers only under use_sliding_window."""
    n, sw = hf.num_hidden_layers, getattr(hf, "sliding_window", None)
    types = getattr(hf, "layer_types", None) or ["full_attention"] * n
    on = bool(getattr(hf, "use_sliding_window", False) and sw)
    return tuple(sw if on and t == "sliding_attention" else None for t in types)


def _exaone4_nope(hf) -> tuple:
    """EXAONE 4: with a sliding window set, the layers that are not sliding-window layers have no
    rotary embedding (transformers: rope iff sliding_window is None or the layer slides)."""
    if getattr(hf, "sliding_window", None) is None:
        return ()
    types = getattr(hf, "layer_types", None) or ["full_attention"] * hf.num_hidden_layers
    return tuple(i for i, t in enumerate(types) if t != "sliding_attention")


register(Family(
    name="llama",
    # Ministral (8B, 2410: alternating sliding layers) and Ministral 3 (3B / 8B / 14B, the decoder
    # of Mistral 3 checkpoints: yarn rope and Llama 4's query temperature) are Mistral decoders
    # Arcee (AFM-4.5B) has an ungated ReLU^2 MLP; ERNIE 4.5 rotates interleaved pairs and has a
    # bias on every projection (use_bias); Seed-OSS sets o_proj's bias apart (attention_out_bias);
    # Helium (Kyutai) rotates interleaved pairs, scales its RMSNorms by w in float32 and has no
    # o_proj bias (q/k/v biases under attention_bias)
    architectures=("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                   "SmolLM3ForCausalLM", "MinistralForCausalLM", "Ministral3ForCausalLM", "ArceeForCausalLM",
                   "Ernie4_5ForCausalLM", "SeedOssForCausalLM", "HeliumForCausalLM"),
    model_types={"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "smollm3": "SmolLM3ForCausalLM", "ministral": "MinistralForCausalLM",
                 "ministral3": "Ministral3ForCausalLM", "arcee": "ArceeForCausalLM", "ernie4_5": "Ernie4_5ForCausalLM",
                 "seed_oss": "SeedOssForCausalLM", "helium": "HeliumForCausalLM"},
    model="jvllm.models.llama:LlamaForCausalLM",
    hf_fields={"attention_bias": "attention_bias", "o_bias": "attention_bias", "mlp_bias": "mlp_bias"},
    per_arch={"Qwen2ForCausalLM": {"attention_bias": True, "o_bias": False},
              "Qwen3ForCausalLM": {"qk_norm": True},
              "ArceeForCausalLM": {"mlp_gated": False},
              "SeedOssForCausalLM": {"o_bias": FromHF("attention_out_bias", False)},
              "HeliumForCausalLM": {"rope_interleaved": True, "norm_scale_f32": True, "o_bias": False},
              "Ernie4_5ForCausalLM": {"rope_interleaved": True, "attention_bias": FromHF("use_bias", False),
                                      "o_bias": FromHF("use_bias", False), "mlp_bias": FromHF("use_bias", False)},
              "SmolLM3ForCausalLM": {"nope_layers": Derived(_smollm3_nope), "layer_windows": Derived(_smollm3_windows)}},
    unread={"*": ("partial_rotary_factor",), "MistralForCausalLM": ("attention_bias", "mlp_bias"), "Qwen2ForCausalLM": ("attention_bias", "mlp_bias"), "Qwen3ForCausalLM": ("mlp_bias",),
            "MinistralForCausalLM": ("attention_bias", "mlp_bias"), "Ministral3ForCausalLM": ("attention_bias", "mlp_bias"), "Ernie4_5ForCausalLM": ("attention_bias", "mlp_bias")},
))
register(Family(
    # Phi-3 is a Llama-shaped decoder; its fused qkv_proj / gate_up_proj are split by the name map
    # at load time (q heads and kv heads shard differently under TP, so the model keeps them apart)
    name="phi3",
    architectures=("Phi3ForCausalLM",),
    model_types={"phi3": "Phi3ForCausalLM"},
    model="jvllm.models.llama:LlamaForCausalLM",
    name_map="fused",
))
register(Family(
    # GLM-4 (GLM-4-9B-chat-hf, glm-edge; jvllm.models.llama) and GLM-4-0414 / GLM-Z1 (sandwich norms:
    # jvllm.models.gemma's layer, plain RMSNorms): interleaved rope on half of each head, q/k/v biases
    # without an o bias, a fused gate_up_proj
    name="glm",
    architectures=("GlmForCausalLM",),
    model_types={"glm": "GlmForCausalLM"},
    model="jvllm.models.llama:LlamaForCausalLM",
    name_map="fused",
    defaults={"rope_interleaved": True, "o_bias": False},
    hf_fields={"attention_bias": "attention_bias"},
))
register(Family(
    name="glm4",
    architectures=("Glm4ForCausalLM",),
    model_types={"glm4": "Glm4ForCausalLM"},
    model="jvllm.models.gemma:GemmaForCausalLM",
    name_map="glm4",
    defaults={"rope_interleaved": True, "o_bias": False, "sandwich_norms": True},
    hf_fields={"attention_bias": "attention_bias"},
))
register(Family(
    # Gemma (1) and CodeGemma: a Llama-shaped decoder with Gemma's (1 + w) norms, embeddings scaled
    # by sqrt(hidden) and GeGLU (transformers reads a legacy hidden_act "gelu" as the tanh form)
    name="gemma1",
    architectures=("GemmaForCausalLM",),
    model_types={"gemma": "GemmaForCausalLM"},
    model="jvllm.models.llama:LlamaForCausalLM",
    defaults={"norm_unit_offset": True, "embed_scale": True},
    hf_fields={"attention_bias": "attention_bias", "o_bias": "attention_bias"},
    unread={"*": ("partial_rotary_factor",)},
))
register(Family(
    name="gemma",
    architectures=("Gemma2ForCausalLM", "Gemma3ForCausalLM"),
    model_types={"gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"},
    model="jvllm.models.gemma:GemmaForCausalLM",
    name_map="gemma",
    defaults={"norm_unit_offset": True, "embed_scale": True, "sandwich_norms": True},
    hf_fields={"hidden_act": "hidden_activation", "query_pre_attn_scalar": "query_pre_attn_scalar",
               "attn_logit_softcap": "attn_logit_softcapping", "final_logit_softcap": "final_logit_softcapping",
               "attention_bias": "attention_bias", "o_bias": "attention_bias"},
    # transformers' Gemma 3 reads attn_logit_softcapping nowhere (real configs set it null): no cap
    per_arch={"Gemma3ForCausalLM": {"qk_norm": True, "attn_logit_softcap": None}},
    refused={"Gemma3ForCausalLM": ("use_bidirectional_attention",)},  # EmbeddingGemma-style non-causal attention
    unread={"*": ("partial_rotary_factor",)},
))
register(Family(
    # IBM Granite 3.x (jvllm.models.granite): Llama with embedding / residual / attention / logit scales
    name="granite",
    architectures=("GraniteForCausalLM",),
    model_types={"granite": "GraniteForCausalLM"},
    model="jvllm.models.granite:GraniteForCausalLM",
    hf_fields={"attention_bias": "attention_bias", "o_bias": "attention_bias", "mlp_bias": "mlp_bias",
               "embedding_multiplier": "embedding_multiplier", "residual_multiplier": "residual_multiplier",
               "attention_multiplier": "attention_multiplier", "logits_scaling": "logits_scaling"},
    unread={"*": ("partial_rotary_factor",)},
))
register(Family(
    # Granite 3.0 / 3.1 MoE (1B-A400M, 3B-A800M) and GraniteMoeShared (jvllm.models.granite): the MoE
    # model with Granite's scales; softmax over the top-k router logits (= renormalised top-k
    # probabilities), fused expert tensors (input_linear / output_linear), an ungated shared MLP
    name="granite_moe",
    architectures=("GraniteMoeForCausalLM", "GraniteMoeSharedForCausalLM"),
    model_types={"granitemoe": "GraniteMoeForCausalLM", "granitemoeshared": "GraniteMoeSharedForCausalLM"},
    model="jvllm.models.granite:GraniteMoeForCausalLM",
    name_map="moe",
    hf_fields={"attention_bias": "attention_bias", "o_bias": "attention_bias",
               "embedding_multiplier": "embedding_multiplier", "residual_multiplier": "residual_multiplier",
               "attention_multiplier": "attention_multiplier", "logits_scaling": "logits_scaling"},
    unread={"*": ("partial_rotary_factor",)},
))
register(Family(
    # OLMo 2 / OLMo 3 (jvllm.models.olmo): post-norm blocks, q/k norms over all heads jointly
    name="olmo",
    architectures=("Olmo2ForCausalLM", "Olmo3ForCausalLM"),
    model_types={"olmo2": "Olmo2ForCausalLM", "olmo3": "Olmo3ForCausalLM"},
    model="jvllm.models.olmo:Olmo2ForCausalLM",
    name_map="olmo",
    defaults={"qk_norm": True, "qk_norm_layout": "all", "norm_scale_f32": True},
    hf_fields={"attention_bias": "attention_bias", "o_bias": "attention_bias"},
    unread={"*": ("partial_rotary_factor",)},
))
register(Family(
    # Apertus (swiss-ai, jvllm.models.apertus): the Llama decoder with q/k RMSNorms per head (before
    # rope), an ungated MLP whose xIELU activation has learned scalars per layer, its norms named
    # attention_layernorm / feedforward_layernorm (name map "apertus"); q/k/v/o biases under
    # attention_bias
    name="apertus",
    architectures=("ApertusForCausalLM",),
    model_types={"apertus": "ApertusForCausalLM"},
    model="jvllm.models.apertus:ApertusForCausalLM",
    name_map="apertus",
    defaults={"qk_norm": True, "mlp_gated": False},
    hf_fields={"attention_bias": "attention_bias", "o_bias": "attention_bias"},
    unread={"*": ("partial_rotary_factor",)},
))
register(Family(
    # HunYuan dense (Hunyuan-0.5B / 1.8B / 4B / 7B): the Llama decoder with q/k RMSNorms per head
    # over head_dim applied after rope (query_layernorm / key_layernorm: name map "hunyuan"); its
    # "dynamic" rope with a fixed alpha is a static stretched base (jvllm.hf_config)
    name="hunyuan_dense",
    architectures=("HunYuanDenseV1ForCausalLM",),
    model_types={"hunyuan_v1_dense": "HunYuanDenseV1ForCausalLM"},
    model="jvllm.models.llama:LlamaForCausalLM",
    name_map="hunyuan",
    defaults={"qk_norm": True, "qk_norm_after_rope": True},
    hf_fields={"attention_bias": "attention_bias", "o_bias": "attention_bias"},
    unread={"*": ("partial_rotary_factor",)},
))
register(Family(
    # OLMo 1 (OlmoForCausalLM, AI2's allenai/OLMo-*-hf): the Llama decoder with LayerNorms that have
    # no weight or bias (eps 1e-5, fixed), q/k/v clamped to +-clip_qkv when set, biases on every
    # attention projection under attention_bias
    name="olmo1",
    architectures=("OlmoForCausalLM",),
    model_types={"olmo": "OlmoForCausalLM"},
    model="jvllm.models.llama:LlamaForCausalLM",
    defaults={"norm_kind": "layer", "norm_affine": False, "rms_norm_eps": 1e-5},
    hf_fields={"attention_bias": "attention_bias", "o_bias": "attention_bias", "clip_qkv": "clip_qkv"},
    unread={"*": ("partial_rotary_factor",)},
))
register(Family(
    # EXAONE 4.0 (jvllm.models.olmo's post-norm layer, as OLMo 2): no norm before attention or the
    # MLP, each block's output normalised before its residual add; q/k RMSNorms per head over
    # head_dim (Qwen3's) before rope; Llama's RMSNorm (cast, then scaled by w); sliding-window
    # layers from layer_types, and with a window set the global layers have no rope (NoPE)
    name="exaone4",
    architectures=("Exaone4ForCausalLM",),
    model_types={"exaone4": "Exaone4ForCausalLM"},
    model="jvllm.models.olmo:Olmo2ForCausalLM",
    name_map="olmo",
    defaults={"qk_norm": True},
    per_arch={"Exaone4ForCausalLM": {"nope_layers": Derived(_exaone4_nope)}},
    unread={"*": ("partial_rotary_factor",)},
))
register(Family(
    # mixture of experts (jvllm.models.moe): Llama's attention, norms and head around a routed,
    # grouped-matmul expert MLP; the MoE settings come from `ModelConfig.moe` (hf_config._moe_from_hf)
    name="moe",
    # GLM-4.5 / 4.6: q/k/v biases without an o bias, optional per-head q/k norms, rope on part of each
    # head, a sigmoid router (jvllm.models.moe_routers); its next-token-prediction layers after the
    # decoder stack are not read (converters.readers.mtp_layers_skipped). dots.llm1: the same router
    # and shared experts, Qwen3's per-head q/k norms, biases per attention_bias. ERNIE 4.5 MoE: a
    # softmax router with the same kind of selection bias, ungated shared experts. MiniMax-M2:
    # Mixtral's names, a sigmoid router with a selection bias (no groups, no shared expert).
    # Phi-3.5-MoE: Mixtral's names, the sparsemixer router. EXAONE MoE: GLM-4.5's router and shared
    # experts with EXAONE 4's attention
    architectures=("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "OlmoeForCausalLM",
                   "Glm4MoeForCausalLM", "Dots1ForCausalLM", "Ernie4_5_MoeForCausalLM", "MiniMaxM2ForCausalLM",
                   "PhimoeForCausalLM", "ExaoneMoeForCausalLM"),
    model_types={"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM", "olmoe": "OlmoeForCausalLM", "glm4_moe": "Glm4MoeForCausalLM",
                 "dots1": "Dots1ForCausalLM", "ernie4_5_moe": "Ernie4_5_MoeForCausalLM",
                 "minimax_m2": "MiniMaxM2ForCausalLM", "phimoe": "PhimoeForCausalLM", "exaone_moe": "ExaoneMoeForCausalLM"},
    model="jvllm.models.moe:MoEForCausalLM",
    name_map="moe",
    hf_fields={"attention_bias": "attention_bias", "o_bias": "attention_bias", "mlp_bias": "mlp_bias"},
    per_arch={"Qwen2MoeForCausalLM": {"attention_bias": FromHF("qkv_bias", True), "o_bias": False},
              "Qwen3MoeForCausalLM": {"qk_norm": True},
              "OlmoeForCausalLM": {"qk_norm": True, "qk_norm_layout": "all"},  # OLMoE: AI2's, OLMo's q/k norms
              "Glm4MoeForCausalLM": {"o_bias": False, "qk_norm": FromHF("use_qk_norm", False)},
              "Dots1ForCausalLM": {"qk_norm": True},
              # ERNIE 4.5 MoE: interleaved rope; use_bias (biases on every projection and the LM head,
              # none on the experts) is refused: the real checkpoints have none
              "Ernie4_5_MoeForCausalLM": {"rope_interleaved": True},
              # MiniMax-M2: q/k norms over all heads jointly (OLMo's layout), rope on part of each head
              "MiniMaxM2ForCausalLM": {"qk_norm": True, "qk_norm_layout": "all"},
              # Phi-3.5-MoE: LayerNorms with biases, biases on q/k/v/o, a biased LM head, a window on
              # every layer, longrope
              "PhimoeForCausalLM": {"norm_kind": "layer", "lm_head_bias": FromHF("lm_head_bias", False),
                                    "longrope_mscale": True},
              # K-EXAONE (EXAONE MoE): EXAONE 4's per-head q/k norms and rope-free global layers under a
              # window, on Llama's pre-norm layer
              "ExaoneMoeForCausalLM": {"qk_norm": True, "nope_layers": Derived(_exaone4_nope)}},
    refused={"OlmoeForCausalLM": ("clip_qkv",), "Ernie4_5_MoeForCausalLM": ("use_bias",)},
    unread={"*": ("mlp_bias",), "MixtralForCausalLM": ("attention_bias", "partial_rotary_factor"), "Qwen2MoeForCausalLM": ("attention_bias", "partial_rotary_factor"),
            "Qwen3MoeForCausalLM": ("partial_rotary_factor",), "OlmoeForCausalLM": ("partial_rotary_factor",), "Dots1ForCausalLM": ("partial_rotary_factor",),
            "Ernie4_5_MoeForCausalLM": ("attention_bias", "partial_rotary_factor"), "MiniMaxM2ForCausalLM": ("attention_bias",),
            "PhimoeForCausalLM": ("partial_rotary_factor",), "ExaoneMoeForCausalLM": ("attention_bias", "partial_rotary_factor")},
))
register_text_only(TextOnly(
    # Gemma 3 4B / 12B / 27B (SigLIP vision tower + projector around a Gemma 3 decoder)
    architecture="Gemma3ForConditionalGeneration", model_type="gemma3", text_architecture="Gemma3ForCausalLM",
))
# LLaVA (1.5 and the LLaVA-style checkpoints: a Llama / Mistral / Qwen2 / ... decoder) and Mistral 3
# (Mistral Small 3.1 / 3.2: Pixtral tower around a Mistral decoder): the decoder is the text_config's
register_text_only(TextOnly(architecture="LlavaForConditionalGeneration", model_type="llava", text_architecture=None))
register_text_only(TextOnly(architecture="Mistral3ForConditionalGeneration", model_type="mistral3",
                            text_architecture=None))
# Qwen2-VL / Qwen2.5-VL (a Qwen2 decoder) and Qwen3-VL (a Qwen3 decoder). Hub checkpoints of the
# first two keep the decoder at the top (`model.layers.*`, `lm_head.*`) and the tower under
# `visual.`; Qwen3-VL's and transformers 5's nest it under `model.language_model.`. Their M-RoPE
# gives a text-only prompt the same position in all three sections: plain rope (hf_config).
_QWEN_VL = dict(prefixes=(("model.language_model.", "model."),), skipped=("visual.", "model.visual."))
register_text_only(TextOnly(architecture="Qwen2VLForConditionalGeneration", model_type="qwen2_vl",
                            text_architecture="Qwen2ForCausalLM", **_QWEN_VL))
register_text_only(TextOnly(architecture="Qwen2_5_VLForConditionalGeneration", model_type="qwen2_5_vl",
                            text_architecture="Qwen2ForCausalLM", **_QWEN_VL))
register_text_only(TextOnly(architecture="Qwen3VLForConditionalGeneration", model_type="qwen3_vl",
                            text_architecture="Qwen3ForCausalLM", **_QWEN_VL))
register_text_only(TextOnly(architecture="Qwen3VLMoeForConditionalGeneration", model_type="qwen3_vl_moe",
                            text_architecture="Qwen3MoeForCausalLM", **_QWEN_VL))  # fused experts: name_map

importlib.import_module("jvllm.models.families_gpt")  # the GPT lineage and the parallel-layer families
