"""The built-in model families and multimodal text-only wrappers: one `register(Family(...))` or
`register_text_only(TextOnly(...))` each (`jvllm.models.registry` says what the fields mean).
Imported by the registry itself, so any lookup sees them; a new family is one model file plus one
registration here."""
from __future__ import annotations

from jvllm.models.registry import Derived, Family, FromHF, TextOnly, register, register_text_only


# the GPT-2 model class's blocks (GPT-2, OPT, GPTBigCode): LayerNorms, a dense MLP, biases on every
# projection, learned positions
GPT_BLOCKS = {"norm_kind": "layer", "mlp_gated": False, "learned_positions": True, "attention_bias": True,
              "o_bias": True, "mlp_bias": True}


def _smollm3_nope(hf) -> tuple:
    """SmolLM3's no_rope_layers: 1 = rope, 0 = no rotary embedding (NoPE)."""
    return tuple(i for i, r in enumerate(getattr(hf, "no_rope_layers", None) or ()) if not r)


def _smollm3_windows(hf) -> tuple:
    """SmolLM3 windows its layer_types' sliding layers only under use_sliding_window."""
    n, sw = hf.num_hidden_layers, getattr(hf, "sliding_window", None)
    types = getattr(hf, "layer_types", None) or ["full_attention"] * n
    on = bool(getattr(hf, "use_sliding_window", False) and sw)
    return tuple(sw if on and t == "sliding_attention" else None for t in types)


def _gpt2_attention_scale(hf) -> float | None:
    """GPT-2 with scale_attn_weights False does not scale its attention scores at all."""
    return None if getattr(hf, "scale_attn_weights", True) else 1.0


def _opt_position_offset(hf) -> int:
    """OPT's learned positions start 2 rows into their table. Raises ValueError for the variants
    transformers' OPT has and jvllm does not implement: post-norm layers (OPT-350m's
    do_layer_norm_before=False), embeddings projected in and out (word_embed_proj_dim !=
    hidden_size, also OPT-350m), LayerNorms without weights, no final LayerNorm."""
    bad = []
    if not getattr(hf, "do_layer_norm_before", True):
        bad.append("do_layer_norm_before=False")
    proj = getattr(hf, "word_embed_proj_dim", None)
    if proj is not None and proj != hf.hidden_size:
        bad.append(f"word_embed_proj_dim={proj!r} (hidden_size {hf.hidden_size})")
    if not getattr(hf, "layer_norm_elementwise_affine", True):
        bad.append("layer_norm_elementwise_affine=False")
    if getattr(hf, "_remove_final_layer_norm", False):
        bad.append("_remove_final_layer_norm=True")
    if bad:
        raise ValueError(f"OPTForCausalLM: config sets {', '.join(bad)}, which jvllm does not implement")
    return 2


def _bigcode_kv_heads(hf) -> int:
    """GPTBigCode: one KV head under multi_query (StarCoder 1, SantaCoder), else one per head."""
    return 1 if getattr(hf, "multi_query", True) else hf.num_attention_heads


def _falcon_parallel(hf) -> bool:
    """Falcon's layers run attention and MLP in parallel (every released rotary Falcon: 7B, 40B,
    180B). Raises ValueError for what jvllm does not implement: ALiBi (Falcon-RW) and sequential
    layers (parallel_attn=False)."""
    bad = [f"{a}={getattr(hf, a)!r}" for a, v in (("alibi", True), ("parallel_attn", False)) if getattr(hf, a, not v) == v]
    if bad:
        raise ValueError(f"FalconForCausalLM: config sets {', '.join(bad)}, which jvllm does not implement")
    return True


def _falcon_kv_heads(hf) -> int:
    """Falcon's KV heads as transformers counts them: num_kv_heads in the new decoder architecture
    (40B, 180B) or without multi_query, else one (7B)."""
    new, mq = getattr(hf, "new_decoder_architecture", False), getattr(hf, "multi_query", True)
    return (getattr(hf, "num_kv_heads", None) or hf.num_attention_heads) if (new or not mq) else 1


def _gptj_rotary_factor(hf) -> float:
    """GPT-J rotates the first rotary_dim dims of each head (None: all of them)."""
    head_dim = hf.hidden_size // hf.num_attention_heads
    return (getattr(hf, "rotary_dim", None) or head_dim) / head_dim


def _rope_on_sliding_layers_only(hf) -> tuple:
    """Cohere 2: its global layers have no rotary embedding."""
    return tuple(i for i, t in enumerate(hf.layer_types) if t != "sliding_attention")


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
))
register(Family(
    # Cohere Command R / R+ / Aya Expanse and Cohere 2 (Command R7B, Command A; jvllm.models.cohere):
    # one LayerNorm (no bias) feeding attention and MLP in parallel, interleaved rope, logits
    # scaled; Command R+'s q/k norms have a weight per head; Cohere 2 has no rotary embedding on its
    # global layers
    name="cohere",
    architectures=("CohereForCausalLM", "Cohere2ForCausalLM"),
    model_types={"cohere": "CohereForCausalLM", "cohere2": "Cohere2ForCausalLM"},
    model="jvllm.models.cohere:CohereForCausalLM",
    defaults={"norm_kind": "layer", "norm_bias": False, "qk_norm_layout": "per_head", "rope_interleaved": True},
    hf_fields={"rms_norm_eps": "layer_norm_eps", "logit_scale": "logit_scale", "qk_norm": "use_qk_norm",
               "attention_bias": "attention_bias", "o_bias": "attention_bias"},
    per_arch={"Cohere2ForCausalLM": {"nope_layers": Derived(_rope_on_sliding_layers_only)}},
))
register(Family(
    # Phi-1 / Phi-1.5 / Phi-2 (jvllm.models.cohere's parallel single-norm layer): LayerNorms with
    # biases, partial rotary, biases everywhere, an ungated gelu_new MLP (fc1 / fc2), optional q/k
    # LayerNorms (qk_layernorm) and an LM head with a bias
    name="phi",
    architectures=("PhiForCausalLM",),
    model_types={"phi": "PhiForCausalLM"},
    model="jvllm.models.cohere:CohereForCausalLM",
    name_map="phi",
    defaults={"norm_kind": "layer", "mlp_gated": False, "mlp_bias": True, "attention_bias": True, "o_bias": True,
              "lm_head_bias": True},
    hf_fields={"rms_norm_eps": "layer_norm_eps", "qk_norm": "qk_layernorm"},
))
register(Family(
    # GPT-J (jvllm.models.cohere's parallel single-norm layer, as Phi): a LayerNorm with a bias,
    # rope on interleaved pairs of the first rotary_dim dims, q/k/v/out_proj without biases, an
    # ungated gelu_new MLP with biases (fc_in / fc_out), an untied LM head with a bias
    name="gptj",
    architectures=("GPTJForCausalLM",),
    model_types={"gptj": "GPTJForCausalLM"},
    model="jvllm.models.cohere:CohereForCausalLM",
    name_map="gptj",
    defaults={"norm_kind": "layer", "mlp_gated": False, "mlp_bias": True, "lm_head_bias": True,
              "rope_interleaved": True, "rms_norm_eps": 1e-5},
    hf_fields={"rms_norm_eps": "layer_norm_epsilon", "hidden_act": "activation_function"},
    per_arch={"GPTJForCausalLM": {"partial_rotary_factor": Derived(_gptj_rotary_factor)}},
))
register(Family(
    # Nemotron (NemotronForCausalLM: Nemotron-4, Minitron, Mistral-NeMo-Minitron): the Llama decoder
    # with LayerNorm1P (LayerNorm scaled by 1 + w, with a bias), an ungated ReLU^2 MLP and rope on
    # half of each head; LayerNorm biases through name map "starcoder2"
    name="nemotron",
    architectures=("NemotronForCausalLM",),
    model_types={"nemotron": "NemotronForCausalLM"},
    model="jvllm.models.llama:LlamaForCausalLM",
    name_map="starcoder2",
    defaults={"norm_kind": "layer", "norm_unit_offset": True, "mlp_gated": False, "rms_norm_eps": 1e-5},
    hf_fields={"rms_norm_eps": "norm_eps", "attention_bias": "attention_bias", "o_bias": "attention_bias",
               "mlp_bias": "mlp_bias"},
))
register(Family(
    # StableLM 2 / StableLM Zephyr (StableLmForCausalLM): the Llama decoder with LayerNorms with
    # biases, rope on the first quarter of each head (partial_rotary_factor), optional q/k/v biases
    # (use_qkv_bias); LayerNorm biases through name map "starcoder2". StableLM 2 12B's parallel
    # residual and per-head q/k LayerNorms are refused by name.
    name="stablelm",
    architectures=("StableLmForCausalLM",),
    model_types={"stablelm": "StableLmForCausalLM"},
    model="jvllm.models.llama:LlamaForCausalLM",
    name_map="starcoder2",
    defaults={"norm_kind": "layer", "rms_norm_eps": 1e-5},
    hf_fields={"rms_norm_eps": "layer_norm_eps", "attention_bias": "use_qkv_bias"},
    refused={"StableLmForCausalLM": ("use_parallel_residual", "qk_layernorm")},
))
register(Family(
    # StarCoder2: the Llama decoder with LayerNorms, an ungated GELU MLP (c_fc / c_proj) and
    # biases everywhere (use_bias); its window applies to every layer
    name="starcoder2",
    architectures=("Starcoder2ForCausalLM",),
    model_types={"starcoder2": "Starcoder2ForCausalLM"},
    model="jvllm.models.llama:LlamaForCausalLM",
    name_map="starcoder2",
    defaults={"norm_kind": "layer", "mlp_gated": False},
    hf_fields={"rms_norm_eps": "norm_epsilon", "attention_bias": "use_bias", "o_bias": "use_bias",
               "mlp_bias": "use_bias"},
))
register(Family(
    # GPT-2 (jvllm.models.gpt2): LayerNorm, dense GELU MLP, biases, learned positions, tied head;
    # its Conv1D names and fused c_attn through name map "gpt2"
    name="gpt2",
    architectures=("GPT2LMHeadModel",),
    model_types={"gpt2": "GPT2LMHeadModel"},
    model="jvllm.models.gpt2:GPT2LMHeadModel",
    name_map="gpt2",
    defaults=GPT_BLOCKS,
    hf_fields={"hidden_act": "activation_function", "rms_norm_eps": "layer_norm_epsilon"},
    per_arch={"GPT2LMHeadModel": {"attention_multiplier": Derived(_gpt2_attention_scale)}},
    # attention variants transformers' GPT-2 honours and jvllm does not implement
    refused={"GPT2LMHeadModel": ("scale_attn_by_inverse_layer_idx",)},
))
register(Family(
    # OPT (jvllm.models.gpt2, as GPT-2): LayerNorm, dense ReLU MLP (fc1 / fc2), biases, learned
    # positions offset by 2, tied head; HF's Linear names through name map "opt"
    name="opt",
    architectures=("OPTForCausalLM",),
    model_types={"opt": "OPTForCausalLM"},
    model="jvllm.models.gpt2:GPT2LMHeadModel",
    name_map="opt",
    defaults={**GPT_BLOCKS, "rms_norm_eps": 1e-5},
    hf_fields={"hidden_act": "activation_function", "intermediate_size": "ffn_dim", "attention_bias": "enable_bias",
               "o_bias": "enable_bias", "mlp_bias": "enable_bias"},
    per_arch={"OPTForCausalLM": {"position_offset": Derived(_opt_position_offset)}},
))
register(Family(
    # GPTBigCode (StarCoder 1, SantaCoder, jvllm.models.gpt2 as GPT-2): LayerNorm, dense GELU MLP,
    # biases, learned positions, tied head, one KV head (multi_query) or MHA; its fused c_attn
    # (Linear layout) through name map "gpt_bigcode"
    name="gpt_bigcode",
    architectures=("GPTBigCodeForCausalLM",),
    model_types={"gpt_bigcode": "GPTBigCodeForCausalLM"},
    model="jvllm.models.gpt2:GPT2LMHeadModel",
    name_map="gpt_bigcode",
    defaults={**GPT_BLOCKS, "rms_norm_eps": 1e-5},
    hf_fields={"hidden_act": "activation_function", "rms_norm_eps": "layer_norm_epsilon"},
    per_arch={"GPTBigCodeForCausalLM": {"num_kv_heads": Derived(_bigcode_kv_heads),
                                        "attention_multiplier": Derived(_gpt2_attention_scale)}},
))
register(Family(
    # Falcon 7B / 40B / 180B (jvllm.models.neox's parallel layer): LayerNorms, a dense GELU MLP,
    # multi-query or grouped KV heads, biases per `bias`; name map "falcon" splits the grouped
    # query_key_value and gives a norm both branches share to both of the layer's norms
    name="falcon",
    architectures=("FalconForCausalLM",),
    model_types={"falcon": "FalconForCausalLM"},
    model="jvllm.models.neox:GPTNeoXForCausalLM",
    name_map="falcon",
    defaults={"norm_kind": "layer", "mlp_gated": False, "rms_norm_eps": 1e-5},
    hf_fields={"rms_norm_eps": "layer_norm_epsilon", "hidden_act": "activation", "intermediate_size": "ffn_hidden_size",
               "attention_bias": "bias", "o_bias": "bias", "mlp_bias": "bias"},
    per_arch={"FalconForCausalLM": {"parallel_residual": Derived(_falcon_parallel),
                                    "num_kv_heads": Derived(_falcon_kv_heads)}},
))
register(Family(
    # GPT-NeoX / Pythia (jvllm.models.neox): LayerNorm, dense GELU MLP, biases, partial rotary,
    # parallel residual; its fused per-head query_key_value through name map "gpt_neox"
    name="gpt_neox",
    architectures=("GPTNeoXForCausalLM",),
    model_types={"gpt_neox": "GPTNeoXForCausalLM"},
    model="jvllm.models.neox:GPTNeoXForCausalLM",
    name_map="gpt_neox",
    defaults={"norm_kind": "layer", "mlp_gated": False, "mlp_bias": True},
    hf_fields={"rms_norm_eps": "layer_norm_eps", "attention_bias": "attention_bias", "o_bias": "attention_bias",
               "parallel_residual": "use_parallel_residual"},
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
    # Phi-3.5-MoE: Mixtral's names, the sparsemixer router
    architectures=("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "OlmoeForCausalLM",
                   "Glm4MoeForCausalLM", "Dots1ForCausalLM", "Ernie4_5_MoeForCausalLM", "MiniMaxM2ForCausalLM",
                   "PhimoeForCausalLM"),
    model_types={"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM", "olmoe": "OlmoeForCausalLM", "glm4_moe": "Glm4MoeForCausalLM",
                 "dots1": "Dots1ForCausalLM", "ernie4_5_moe": "Ernie4_5_MoeForCausalLM",
                 "minimax_m2": "MiniMaxM2ForCausalLM", "phimoe": "PhimoeForCausalLM"},
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
              "PhimoeForCausalLM": {"norm_kind": "layer", "lm_head_bias": FromHF("lm_head_bias", False)}},
    refused={"OlmoeForCausalLM": ("clip_qkv",), "Ernie4_5_MoeForCausalLM": ("use_bias",)},
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
