"""A transformers config (4.x or 5.x style, or any object with its attributes, such as the dict a
GGUF file's metadata gives) read into jvllm's `ModelConfig`: the fields every family shares here,
each family's own through its registration (`jvllm.models.registry.Family.config_fields`). No jax
import; transformers only to read a folder's config.json (`load_hf_config`)."""
from __future__ import annotations

import json
import os

from jvllm.config import _MOE_ARCHITECTURES, ModelConfig, MoEConfig, _freeze, supported_architectures


def model_config_from_hf(hf, *, generic_names: bool = False) -> ModelConfig:
    """jvllm's ModelConfig of HF config `hf`. ValueError naming the architecture when no family
    serves it (or a field the family refuses). `generic_names`: `hf` is not a transformers config
    but names every size by the shared keys (a GGUF file's `converters.gguf.gguf_hf_config`), so
    the attributes an architecture's transformers class never reads (`Family.unread`) are read."""
    from jvllm.models.registry import arch_of_model_type, family_of, text_only

    archs = list(getattr(hf, "architectures", None) or [])
    arch = archs[0] if archs else (arch_of_model_type(getattr(hf, "model_type", "")) or "<none>")
    if arch not in supported_architectures():
        raise ValueError(
            f"unsupported architecture {arch!r} (architectures={archs}, model_type="
            f"{getattr(hf, 'model_type', None)!r}); supported: {', '.join(supported_architectures())}")
    wrapper = text_only(arch)
    tied = bool(getattr(hf, "tie_word_embeddings", False))
    if wrapper is not None:  # a multimodal checkpoint served as its text decoder
        # transformers 5 ties the head by the wrapper's own tie_word_embeddings (its configs move a
        # pre-v5 text_config value up); absent there, the text config's
        top = getattr(hf, "tie_word_embeddings", None)
        hf, arch = hf.text_config, wrapper.text_arch(hf.text_config)
        tied = bool(top if top is not None else getattr(hf, "tie_word_embeddings", False))
    unread = frozenset() if generic_names else family_of(arch).unread_attrs(arch)

    def read(attr, default=None):  # an attribute the architecture's transformers class reads
        return default if attr in unread else getattr(hf, attr, default)

    heads = hf.num_attention_heads
    kv = read("num_key_value_heads") or heads
    head_dim = read("head_dim") or hf.hidden_size // heads
    rope = getattr(hf, "rope_parameters", None)
    if rope is None:  # transformers 4.x
        rope = dict(getattr(hf, "rope_scaling", None) or {})
        rope.setdefault("rope_theta", getattr(hf, "rope_theta", 10000.0))
        if getattr(hf, "rope_local_base_freq", None):
            rope = {"full_attention": rope, "sliding_attention": {"rope_theta": hf.rope_local_base_freq}}
    rope = dict(rope)
    local_theta = local_rope = None
    if "full_attention" in rope:  # per layer type (Gemma 3): global rope, and the sliding layers' own
        local = rope.get("sliding_attention")
        rope = dict(rope["full_attention"])
        if local is not None:
            local_theta, local_rope = _split_rope(dict(local), None)
    if wrapper is not None:
        # M-RoPE (Qwen-VL): a text-only prompt has the same position in every section, so its
        # rotation is plain rope's; the sections matter only for image tokens (not implemented)
        for k in ("mrope_section", "mrope_interleaved"):
            rope.pop(k, None)
        if rope.get("rope_type", rope.get("type")) == "mrope":  # transformers 4's name for it
            rope["rope_type"] = "default"
            rope.pop("type", None)
    temp_beta = rope.pop("llama_4_scaling_beta", None)  # Ministral 3: a query temperature, not rope
    theta, rope = _split_rope(rope, getattr(hf, "rope_theta", None))
    if arch == "HunYuanDenseV1ForCausalLM" and rope.get("rope_type") == "dynamic" and rope.get("alpha"):
        # HunYuan's NTK-alpha (checkpoints label it "dynamic"): a fixed alpha stretches the base,
        # static default frequencies over the whole head (transformers' ntk_alpha)
        theta *= float(rope["alpha"]) ** (head_dim / (head_dim - 2))
        rope = {}
    partial = float(rope.pop("partial_rotary_factor", None) or getattr(hf, "partial_rotary_factor", None) or 1.0)
    if "partial_rotary_factor" in unread:  # transformers 5 moves it into rope_parameters, where these ignore it
        partial = 1.0
    if rope.get("rope_type") == "longrope":
        rope.setdefault("original_max_position_embeddings",
                        getattr(hf, "original_max_position_embeddings", None) or hf.max_position_embeddings)
        rope.setdefault("max_position_embeddings", hf.max_position_embeddings)
    if local_rope is not None:
        local_rope.pop("partial_rotary_factor", None)
    n = hf.num_hidden_layers
    windows = [None] * n
    sw = getattr(hf, "sliding_window", None)
    layer_types = getattr(hf, "layer_types", None)
    if sw:
        # transformers applies these models' sliding_window to every layer and never reads
        # layer_types (Mistral reads layer_types when a config has them)
        if arch in ("Phi3ForCausalLM", "MixtralForCausalLM", "Qwen3MoeForCausalLM", "Starcoder2ForCausalLM",
                    "Ministral3ForCausalLM", "PhimoeForCausalLM"):
            windows = [sw] * n
        elif layer_types:
            windows = [sw if t == "sliding_attention" else None for t in layer_types]
        elif arch == "MistralForCausalLM":
            windows = [sw] * n
        elif getattr(hf, "use_sliding_window", False):
            mwl = getattr(hf, "max_window_layers", n)
            windows = [sw if i >= mwl else None for i in range(n)]
    eos = getattr(hf, "eos_token_id", None)
    eos = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())

    fields = dict(
        architecture=arch,
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        # GPT-2 names it n_inner (None: 4 x hidden)
        intermediate_size=(read("intermediate_size") or read("n_inner") or 4 * hf.hidden_size),
        num_layers=n,
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=head_dim,
        rms_norm_eps=float(getattr(hf, "rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=_freeze(rope),
        max_position_embeddings=int(getattr(hf, "max_position_embeddings", 2048) or 2048),
        tie_word_embeddings=tied,
        layer_windows=tuple(windows),
        hidden_act=getattr(hf, "hidden_act", None) or "silu",
        local_rope_theta=local_theta,
        local_rope_scaling=_freeze(local_rope),
        partial_rotary_factor=partial,
        bos_token_id=getattr(hf, "bos_token_id", None),
        eos_token_ids=eos,
        moe=_moe_from_hf(hf, arch),
    )
    if temp_beta:
        fields.update(attn_temperature_beta=float(temp_beta), attn_temperature_len=int(
            rope.get("original_max_position_embeddings") or hf.max_position_embeddings))
    fields.update(family_of(arch).config_fields(arch, hf, use_unread=not generic_names))
    if wrapper is not None:  # transformers' multimodal classes end in a plain bias-free Linear head
        fields.update(final_logit_softcap=None, logits_scaling=None, logit_scale=None, lm_head_bias=False)
    return ModelConfig(**fields)


def _split_rope(rope: dict, theta_default) -> tuple[float, dict]:
    """(rope_theta, scaling dict without it; {} for plain default rope) of one rope parameter set."""
    if "rope_type" not in rope and "type" in rope:
        rope["rope_type"] = rope["type"]
    theta = float(rope.pop("rope_theta", None) or theta_default or 10000.0)
    rope.pop("type", None)
    rope.setdefault("rope_type", "default")
    if rope["rope_type"] == "default" and set(rope) <= {"rope_type", "partial_rotary_factor"}:
        rope = {k: v for k, v in rope.items() if k == "partial_rotary_factor"}
    return theta, rope


def _noaux_tc_moe(hf, num_experts: int, shared_experts, mlp_only_layers: tuple) -> MoEConfig:
    """DeepSeek-V3's MoE as GLM-4.5, dots.llm1 and K-EXAONE configure it: the sigmoid router with a
    selection bias over expert groups ("noaux_tc"), `shared_experts` ungated shared experts of the
    routed experts' size."""
    return MoEConfig(num_experts=num_experts, top_k=hf.num_experts_per_tok, expert_size=hf.moe_intermediate_size,
                     norm_topk_prob=bool(getattr(hf, "norm_topk_prob", False)),
                     shared_expert_size=hf.moe_intermediate_size * int(shared_experts or 0), shared_expert_gate=False,
                     mlp_only_layers=mlp_only_layers, scoring="sigmoid", correction_bias=True,
                     num_groups=int(getattr(hf, "n_group", 1) or 1), topk_groups=int(getattr(hf, "topk_group", 1) or 1),
                     routed_scaling=float(getattr(hf, "routed_scaling_factor", 1.0) or 1.0))


def _moe_from_hf(hf, arch: str) -> MoEConfig | None:
    """The MoE settings of a transformers config (None for dense architectures). Router options
    jvllm does not implement are refused by name."""
    if arch not in _MOE_ARCHITECTURES:
        return None
    if arch == "MixtralForCausalLM":
        return MoEConfig(num_experts=hf.num_local_experts, top_k=hf.num_experts_per_tok,
                         expert_size=hf.intermediate_size, norm_topk_prob=True)
    if arch in ("Glm4MoeForCausalLM", "Dots1ForCausalLM"):  # dense first layers
        first_dense = int(getattr(hf, "first_k_dense_replace", 0) or 0)
        return _noaux_tc_moe(hf, hf.n_routed_experts, getattr(hf, "n_shared_experts", 0), tuple(range(first_dense)))
    if arch in ("GraniteMoeForCausalLM", "GraniteMoeSharedForCausalLM"):  # softmax over the top-k logits
        return MoEConfig(num_experts=hf.num_local_experts, top_k=hf.num_experts_per_tok,
                         expert_size=hf.intermediate_size, norm_topk_prob=True,
                         shared_expert_size=int(getattr(hf, "shared_intermediate_size", 0) or 0),
                         shared_expert_gate=False)
    if arch == "ExaoneMoeForCausalLM":  # DeepSeek-V3's router; sparse layers named by mlp_layer_types
        types = list(getattr(hf, "mlp_layer_types", None) or [])
        bad = sorted(set(types) - {"sparse", "dense"})
        if bad:
            raise ValueError(f"ExaoneMoeForCausalLM: unknown mlp_layer_types {bad}; known: sparse, dense")
        return _noaux_tc_moe(hf, hf.num_experts, getattr(hf, "num_shared_experts", 0),
                             tuple(i for i, t in enumerate(types) if t != "sparse"))
    if arch == "PhimoeForCausalLM":  # Mixtral's layout, the sparsemixer router
        return MoEConfig(num_experts=hf.num_local_experts, top_k=hf.num_experts_per_tok,
                         expert_size=hf.intermediate_size, scoring="sparsemixer",
                         jitter_eps=float(getattr(hf, "router_jitter_noise", 0.0) or 0.0))
    if arch == "MiniMaxM2ForCausalLM":  # Mixtral's layout, a sigmoid router choosing with a selection bias
        return MoEConfig(num_experts=hf.num_local_experts, top_k=hf.num_experts_per_tok,
                         expert_size=hf.intermediate_size, norm_topk_prob=True, scoring="sigmoid",
                         correction_bias=True)
    if arch == "Ernie4_5_MoeForCausalLM":  # softmax router choosing with a selection bias, ungated shared experts
        n, start, end = hf.num_hidden_layers, int(hf.moe_layer_start_index), int(hf.moe_layer_end_index)
        end = n - 1 if end == -1 else end
        return MoEConfig(num_experts=hf.moe_num_experts, top_k=hf.moe_k, expert_size=hf.moe_intermediate_size,
                         norm_topk_prob=True, correction_bias=True,
                         shared_expert_size=hf.moe_intermediate_size * int(hf.moe_num_shared_experts or 0),
                         shared_expert_gate=False, decoder_sparse_step=int(hf.moe_layer_interval or 1),
                         norm_min=float(getattr(hf, "moe_norm_min", None) or 0.0),
                         mlp_only_layers=tuple(i for i in range(n) if i < start or i > end))
    if arch == "OlmoeForCausalLM":  # every layer sparse; the experts' size is intermediate_size
        return MoEConfig(num_experts=hf.num_experts, top_k=hf.num_experts_per_tok, expert_size=hf.intermediate_size,
                         norm_topk_prob=bool(getattr(hf, "norm_topk_prob", False)))
    return MoEConfig(num_experts=hf.num_experts, top_k=hf.num_experts_per_tok, expert_size=hf.moe_intermediate_size,
                     norm_topk_prob=bool(getattr(hf, "norm_topk_prob", False)),
                     shared_expert_size=int(getattr(hf, "shared_expert_intermediate_size", 0) or 0)
                     if arch == "Qwen2MoeForCausalLM" else 0,
                     decoder_sparse_step=int(getattr(hf, "decoder_sparse_step", 1) or 1),
                     mlp_only_layers=tuple(getattr(hf, "mlp_only_layers", None) or ()))


def load_hf_config(path: str):
    """transformers' config of checkpoint folder `path` (ValueError naming the architecture before
    transformers is asked, when no family serves its model_type)."""
    import transformers

    cfg_file = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        raise FileNotFoundError(f"no config.json in {path!r}")
    try:
        with open(cfg_file) as f:
            raw = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg_file}: not valid JSON ({e})") from None
    from jvllm.models.registry import supported_model_types

    mt = raw.get("model_type")
    if mt not in supported_model_types():
        archs = raw.get("architectures")
        raise ValueError(f"unsupported architecture {archs!r} (model_type={mt!r}); "
                         f"supported: {', '.join(supported_architectures())}")
    hf = transformers.AutoConfig.from_pretrained(path)
    _untie_if_checkpoint_has_head(hf, path)
    return hf


def _untie_if_checkpoint_has_head(hf, path: str) -> None:
    """transformers 5 ties the LM head to the embedding only when the checkpoint has no head tensor
    of its own (or one equal to the embedding): a config that says tied over a checkpoint with a
    head (Mistral 3's default tie_word_embeddings=True over Mistral Small's untied head) loads
    untied. The same here, from the safetensors tensor names (a head equal to the embedding is then
    kept as a copy: the same logits); .bin checkpoints keep the config's word (their names need a
    full read, and torch saves tied tensors twice)."""
    if not getattr(hf, "tie_word_embeddings", False) and not getattr(getattr(hf, "text_config", None),
                                                                    "tie_word_embeddings", False):
        return
    from jvllm.converters.readers import has_head_tensor

    if has_head_tensor(path, getattr(hf, "to_dict", dict)()):
        hf.tie_word_embeddings = False
        if getattr(hf, "text_config", None) is not None:
            hf.text_config.tie_word_embeddings = False
