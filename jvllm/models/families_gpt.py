"""The built-in registrations of the GPT lineage and the parallel-layer families: Cohere, Phi-1/2,
GPT-J, Nemotron, StableLM 2, StarCoder2, GPT-2, OPT, GPTBigCode, Falcon and GPT-NeoX (LayerNorms,
ungated MLPs, biases, parallel attention and MLP; `jvllm.models.registry` says what the fields
mean). Imported by `jvllm.models.families`."""
from __future__ import annotations

from jvllm.models.registry import Derived, Family, register


# the GPT-2 model class's blocks (GPT-2, OPT, GPTBigCode): LayerNorms, a dense MLP, biases on every
# projection, learned positions
GPT_BLOCKS = {"norm_kind": "layer", "mlp_gated": False, "learned_positions": True, "attention_bias": True,
              "o_bias": True, "mlp_bias": True}


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
    unread={"*": ("partial_rotary_factor",)},
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
    unread={"*": ("num_key_value_heads", "head_dim", "intermediate_size", "partial_rotary_factor")},
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
    unread={"*": ("head_dim",)},
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
    unread={"*": ("partial_rotary_factor",)},
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
    unread={"*": ("num_key_value_heads", "head_dim", "intermediate_size", "partial_rotary_factor")},
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
    unread={"*": ("num_key_value_heads", "head_dim", "n_inner", "partial_rotary_factor")},
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
    unread={"*": ("num_key_value_heads", "head_dim", "intermediate_size", "partial_rotary_factor")},
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
    unread={"*": ("num_key_value_heads", "head_dim", "n_inner", "partial_rotary_factor")},
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
    unread={"*": ("num_key_value_heads", "head_dim")},
))
