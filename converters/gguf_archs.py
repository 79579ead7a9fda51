"""GGUF files of the dense families whose llama.cpp layout or metadata differs from Llama's: Gemma
1, 2 and 3, Phi-3, SmolLM3, Granite, OLMo 2, Command R, Cohere 2, Phi-2, GPT-2, GPT-NeoX, StarCoder2 and
GLM-4-0414. Per architecture, the HF
config fields llama.cpp stores under its own names or fixes in its graph code instead of storing
(`ARCH_FIELDS`), and the GGUF -> HF tensor-name rules (`GEMMA_RULES`, `PHI3_RULES`, each put in
front of the Llama rules: the first match wins).

  GGUF arch   what llama.cpp's converter (convert_hf_to_gguf.py) writes
  gemma       Llama's names; norms stored as 1 + w; GeGLU (not stored)
  gemma2      norms stored as 1 + w; ffn_norm is the pre-MLP norm, the sandwich norms have names
              of their own; even layers sliding, odd global (not stored)
  gemma3      as gemma2; every 6th layer global, the sliding layers' rope base 10000 (not stored)
  phi3        fused attn_qkv and ffn_up (gate rows first, HF's qkv_proj / gate_up_proj); longrope
              as two F32 tensors rope_factors_{short,long} plus rope.scaling.attn_factor and
              rope.scaling.original_context_length; partial rotary as rope.dimension_count;
              sliding_window 0 for "none" (Phi-4)
  smollm3     Llama's (q/k permuted); every 4th layer without rope (not stored)
  granite     Llama's (q/k permuted); its multipliers as embedding_scale, residual_scale,
              attention.scale and logit_scale (the logits' divisor), each stored when non-zero
  olmo2       the post-norms as post_attention_norm / post_ffw_norm (no pre-norms), q/k norms over
              the whole projection
  command-r   one bias-free LayerNorm (attn_norm, its epsilon attention.layer_norm_epsilon),
              logit_scale; rope pairs interleaved (llama.cpp's own rope layout: nothing permuted)
  cohere2     as command-r, plus attention.sliding_window; every 4th layer global and rope-free
              (not stored)
  phi2        Phi-1 / 1.5 / 2's parallel layer: one LayerNorm (attn_norm, weight and bias), q/k/v
              separate or fused as attn_qkv (older files: split here into q_proj / k_proj /
              v_proj), the output projection as attn_output (HF's dense), ffn_up / ffn_down (fc1 /
              fc2), output_norm (final_layernorm) and output with biases; partial rotary as
              rope.dimension_count, rotate-half (nothing permuted)
  glm4        GLM-4-0414 / GLM-Z1: Llama's names and q/k/v biases, the sandwich norms as
              post_attention_norm / post_ffw_norm, the fused gate_up as ffn_up; partial rotary as
              rope.dimension_count; interleaved rope pairs, llama.cpp's own rope layout (nothing
              permuted)
  gpt2        GPT-2: token_embd, position_embd, LayerNorms (attn_norm, ffn_norm, output_norm), the
              fused attn_qkv and the other Conv1D weights transposed to [out, in] (read back into
              HF's [in, out]), all with biases; output is a copy of token_embd (GPT-2 ties its
              head: dropped); feed_forward_length is always 4 x hidden (llama.cpp ignores n_inner):
              the size comes from ffn_up's shape
  gptneox     GPT-NeoX / Pythia: its own names throughout (attn_qkv, attn_output, ffn_up / ffn_down,
              attn_norm / ffn_norm LayerNorms, output_norm, output), all with biases; attn_qkv
              holds q, k, v as three blocks (the converter reorders HF's per-head interleave:
              interleaved again here); use_parallel_residual, partial rotary as rope.dimension_count
  starcoder2  Llama's attention names with biases, LayerNorms (weight and bias; their epsilon as
              attention.layer_norm_epsilon), the ungated MLP as ffn_up / ffn_down (HF's c_fc /
              c_proj), output_norm.bias; rope pairs rotate-half (nothing permuted); no window
              stored (llama.cpp runs none; transformers' GGUF reader neither)

`ARCH_FIELDS[arch](cfg, g, tensor, names)`: `cfg` is the generic part already read (sizes,
rope_theta, rope_scaling, partial_rotary_factor), `g(key)` reads `{arch}.key`, `tensor(name)` is a
float32 F32 tensor of the file or None, `names` maps the file's tensor names to their numpy shapes; the result
updates `cfg`.
"""
from __future__ import annotations

from typing import Callable

_LLAMA_FFN_NORM = r"blk\.(\d+)\.ffn_norm\.weight"
GEMMA_RULES = [
    (_LLAMA_FFN_NORM, r"model.layers.\1.pre_feedforward_layernorm.weight"),
    (r"blk\.(\d+)\.post_attention_norm\.weight", r"model.layers.\1.post_attention_layernorm.weight"),
    (r"blk\.(\d+)\.post_ffw_norm\.weight", r"model.layers.\1.post_feedforward_layernorm.weight"),
]
PHI3_RULES = [
    (r"blk\.(\d+)\.attn_qkv\.weight", r"model.layers.\1.self_attn.qkv_proj.weight"),
    (r"blk\.(\d+)\.ffn_up\.weight", r"model.layers.\1.mlp.gate_up_proj.weight"),
    (r"rope_factors_(long|short)\.weight", None),  # read into the config (phi3_fields)
]
STARCODER2_RULES = [
    (r"output_norm\.bias", "model.norm.bias"),
    (r"blk\.(\d+)\.attn_output\.bias", r"model.layers.\1.self_attn.o_proj.bias"),
    (r"blk\.(\d+)\.attn_norm\.bias", r"model.layers.\1.input_layernorm.bias"),
    (r"blk\.(\d+)\.ffn_norm\.bias", r"model.layers.\1.post_attention_layernorm.bias"),
    (r"blk\.(\d+)\.ffn_up\.(weight|bias)", r"model.layers.\1.mlp.c_fc.\2"),
    (r"blk\.(\d+)\.ffn_down\.(weight|bias)", r"model.layers.\1.mlp.c_proj.\2"),
]
GLM4_RULES = [
    (r"blk\.(\d+)\.post_attention_norm\.weight", r"model.layers.\1.post_self_attn_layernorm.weight"),
    (r"blk\.(\d+)\.post_ffw_norm\.weight", r"model.layers.\1.post_mlp_layernorm.weight"),
    (r"blk\.(\d+)\.ffn_up\.weight", r"model.layers.\1.mlp.gate_up_proj.weight"),
]
# "{qkv}" in a target: the tensor holds q, k and v rows in that order ([H*hd], [KV*hd], [KV*hd]),
# streamed as three HF tensors (gguf.gguf_tensor_stream)
PHI2_RULES = [
    (r"output_norm\.(weight|bias)", r"model.final_layernorm.\1"),
    (r"output\.bias", "lm_head.bias"),
    (r"blk\.(\d+)\.attn_norm\.(weight|bias)", r"model.layers.\1.input_layernorm.\2"),
    (r"blk\.(\d+)\.attn_qkv\.(weight|bias)", r"model.layers.\1.self_attn.{qkv}_proj.\2"),
    (r"blk\.(\d+)\.attn_output\.(weight|bias)", r"model.layers.\1.self_attn.dense.\2"),
    (r"blk\.(\d+)\.ffn_up\.(weight|bias)", r"model.layers.\1.mlp.fc1.\2"),
    (r"blk\.(\d+)\.ffn_down\.(weight|bias)", r"model.layers.\1.mlp.fc2.\2"),
]
_BLK = r"blk\.(\d+)\."
GPTNEOX_RULES = [  # every tensor: nothing of the Llama rules applies
    (r"token_embd\.weight", "gpt_neox.embed_in.weight"),
    (r"output_norm\.(weight|bias)", r"gpt_neox.final_layer_norm.\1"),
    (r"output\.weight", "embed_out.weight"),
    (_BLK + r"attn_norm\.(weight|bias)", r"gpt_neox.layers.\1.input_layernorm.\2"),
    (_BLK + r"ffn_norm\.(weight|bias)", r"gpt_neox.layers.\1.post_attention_layernorm.\2"),
    (_BLK + r"attn_qkv\.(weight|bias)", r"gpt_neox.layers.\1.attention.query_key_value.\2"),
    (_BLK + r"attn_output\.(weight|bias)", r"gpt_neox.layers.\1.attention.dense.\2"),
    (_BLK + r"ffn_up\.(weight|bias)", r"gpt_neox.layers.\1.mlp.dense_h_to_4h.\2"),
    (_BLK + r"ffn_down\.(weight|bias)", r"gpt_neox.layers.\1.mlp.dense_4h_to_h.\2"),
]
GPT2_RULES = [  # every tensor; the weights of `GPT2_TRANSPOSED` are transposed back on load
    (r"token_embd\.weight", "transformer.wte.weight"),
    (r"position_embd\.weight", "transformer.wpe.weight"),
    (r"output_norm\.(weight|bias)", r"transformer.ln_f.\1"),
    (r"output\.weight", None),  # the converter's copy of token_embd
    (_BLK + r"attn_norm\.(weight|bias)", r"transformer.h.\1.ln_1.\2"),
    (_BLK + r"ffn_norm\.(weight|bias)", r"transformer.h.\1.ln_2.\2"),
    (_BLK + r"attn_qkv\.(weight|bias)", r"transformer.h.\1.attn.c_attn.\2"),
    (_BLK + r"attn_output\.(weight|bias)", r"transformer.h.\1.attn.c_proj.\2"),
    (_BLK + r"ffn_up\.(weight|bias)", r"transformer.h.\1.mlp.c_fc.\2"),
    (_BLK + r"ffn_down\.(weight|bias)", r"transformer.h.\1.mlp.c_proj.\2"),
]
GPT2_TRANSPOSED = (".c_attn.weight", ".c_proj.weight", ".c_fc.weight")  # Conv1D: HF keeps [in, out]


def neox_qkv_per_head(a, n_head: int):
    """llama.cpp's [q; k; v] blocks of a GPT-NeoX query_key_value (rows 3 * H * hd) back into
    HF's per-head interleave ([H, 3, hd] rows)."""
    return a.reshape(3, n_head, a.shape[0] // (3 * n_head), *a.shape[1:]).swapaxes(0, 1).reshape(a.shape)


# llama.cpp stores Gemma's norm weights as 1 + w (its converter adds 1; transformers' GGUF reader
# subtracts it again): the checkpoint's w is the stored value minus 1
NORM_PLUS_ONE_ARCHS = ("gemma", "gemma2", "gemma3")


def _opt_float(v):
    return None if v is None else float(v)


def gemma_fields(cfg: dict, g, tensor, names) -> dict:
    """Gemma 1: GeGLU, the only thing llama.cpp fixes rather than stores."""
    return {"hidden_act": "gelu_pytorch_tanh"}


def gemma2_fields(cfg: dict, g, tensor, names) -> dict:
    """Even layers sliding, odd global; query_pre_attn_scalar = head_dim (hidden/heads for the
    46-layer 27B, as llama.cpp's attention scale), GeGLU. A checkpoint whose query_pre_attn_scalar
    differs from that rule cannot be written to GGUF faithfully (llama.cpp drops the field). The
    soft-caps are stored."""
    n, hd = cfg["num_hidden_layers"], cfg["head_dim"]
    return {
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": int(g("attention.sliding_window", 4096)),
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)],
        "query_pre_attn_scalar": cfg["hidden_size"] // cfg["num_attention_heads"] if n == 46 else hd,
        "attn_logit_softcapping": _opt_float(g("attn_logit_softcapping")),
        "final_logit_softcapping": _opt_float(g("final_logit_softcapping")),
    }


def gemma3_fields(cfg: dict, g, tensor, names) -> dict:
    """Every 6th layer global (the rest sliding), the sliding layers' rope base 10000,
    query_pre_attn_scalar = head_dim (hidden/heads for the 62-layer 27B), GeGLU; a stored rope
    scaling (the 4B and larger: linear, factor 8) applies to the global layers only."""
    n, hd = cfg["num_hidden_layers"], cfg["head_dim"]
    full = {"rope_type": "default", "rope_theta": cfg.pop("rope_theta")}
    full.update(cfg.pop("rope_scaling", None) or {})
    return {
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": int(g("attention.sliding_window", 4096)),
        "layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(n)],
        "rope_parameters": {"full_attention": full, "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
        "query_pre_attn_scalar": cfg["hidden_size"] // cfg["num_attention_heads"] if n == 62 else hd,
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
    }


def phi3_fields(cfg: dict, g, tensor, names) -> dict:
    """Phi-3 / Phi-3.5 / Phi-4-mini: the window (0 = none), and longrope from the factor tensors
    (a 4k model has none: plain rope). ValueError naming the tensor when only one of the two
    factor tensors is present or their lengths differ from rotary_dim / 2."""
    out = {"sliding_window": int(g("attention.sliding_window", 0) or 0) or None}
    orig = g("rope.scaling.original_context_length")
    if orig:
        out["original_max_position_embeddings"] = int(orig)
    short, long = tensor("rope_factors_short.weight"), tensor("rope_factors_long.weight")
    if short is None and long is None:
        return out
    if short is None or long is None:
        raise ValueError(f"GGUF phi3 has {'rope_factors_long' if short is None else 'rope_factors_short'}.weight "
                         f"but not the other: longrope needs both")
    half = round(cfg["head_dim"] * cfg.get("partial_rotary_factor", 1.0)) // 2
    for name, f in (("short", short), ("long", long)):
        if f.shape != (half,):
            raise ValueError(f"GGUF phi3 rope_factors_{name}.weight has shape {f.shape}; longrope needs "
                             f"({half},) (rotary_dim / 2)")
    if cfg.get("rope_scaling"):
        raise ValueError(f"GGUF phi3 has rope factor tensors and rope.scaling.type "
                         f"{cfg['rope_scaling'].get('rope_type')!r}: not implemented together")
    rope = {"rope_type": "longrope", "short_factor": [float(x) for x in short], "long_factor": [float(x) for x in long],
            "original_max_position_embeddings": int(orig or cfg["max_position_embeddings"])}
    att = g("rope.scaling.attn_factor")
    if att is not None:
        rope["attention_factor"] = float(att)
    out["rope_scaling"] = rope
    return out


def smollm3_fields(cfg: dict, g, tensor, names) -> dict:
    """No rotary embedding on every 4th layer (llama.cpp's fixed n_no_rope_layer_step), no window."""
    n = cfg["num_hidden_layers"]
    return {"no_rope_layers": [int((i + 1) % 4 != 0) for i in range(n)], "use_sliding_window": False}


def granite_fields(cfg: dict, g, tensor, names) -> dict:
    """Granite's four multipliers under llama.cpp's *_scale names (absent: no scaling)."""
    return {"embedding_multiplier": _opt_float(g("embedding_scale")),
            "residual_multiplier": float(g("residual_scale", 1.0) or 1.0),
            "attention_multiplier": _opt_float(g("attention.scale")),
            "logits_scaling": _opt_float(g("logit_scale"))}


def command_r_fields(cfg: dict, g, tensor, names) -> dict:
    """Command R / Cohere 2: the LayerNorms' epsilon, logit_scale, and Command R+'s q/k norms when
    the file has them."""
    out = {"layer_norm_eps": float(g("attention.layer_norm_epsilon", 1e-5)),
           "logit_scale": float(g("logit_scale", 1.0)),
           "use_qk_norm": "blk.0.attn_q_norm.weight" in names}
    if g("attention.sliding_window") is not None:  # Cohere 2: 3 sliding layers, then a global one
        n = cfg["num_hidden_layers"]
        out["sliding_window"] = int(g("attention.sliding_window"))
        out["layer_types"] = ["full_attention" if (i + 1) % 4 == 0 else "sliding_attention" for i in range(n)]
    return out


def phi2_fields(cfg: dict, g, tensor, names) -> dict:
    """Phi-1 / 1.5 / 2: the LayerNorm's epsilon, gelu_new; no q/k LayerNorms (llama.cpp's phi2
    has no tensors for them: a file carrying attn_q_norm fails as an unexpected tensor)."""
    return {"layer_norm_eps": float(g("attention.layer_norm_epsilon", 1e-5)), "hidden_act": "gelu_new",
            "qk_layernorm": False}


def glm4_fields(cfg: dict, g, tensor, names) -> dict:
    """GLM-4-0414: q/k/v biases when the file has them (partial rotary: the generic rope fields)."""
    return {"attention_bias": "blk.0.attn_q.bias" in names}


def gpt2_fields(cfg: dict, g, tensor, names) -> dict:
    """GPT-2: the LayerNorms' epsilon, gelu_new, a tied head, learned positions up to
    context_length, the MLP size from ffn_up (llama.cpp writes feed_forward_length 4 x hidden
    whatever n_inner was)."""
    up = names.get("blk.0.ffn_up.weight")
    return {"layer_norm_epsilon": float(g("attention.layer_norm_epsilon", 1e-5)), "activation_function": "gelu_new",
            "tie_word_embeddings": True, "n_positions": cfg["max_position_embeddings"],
            **({"intermediate_size": int(up[0])} if up else {})}


def gptneox_fields(cfg: dict, g, tensor, names) -> dict:
    """GPT-NeoX: the LayerNorms' epsilon, the parallel residual flag (llama.cpp's default true),
    exact GELU, attention biases when the file has them."""
    return {"layer_norm_eps": float(g("attention.layer_norm_epsilon", 1e-5)), "hidden_act": "gelu",
            "use_parallel_residual": bool(g("use_parallel_residual", True)),
            "attention_bias": "blk.0.attn_qkv.bias" in names}


def starcoder2_fields(cfg: dict, g, tensor, names) -> dict:
    """StarCoder2: the LayerNorms' epsilon, GELU (tanh), biases when the file has them; no window
    (GGUF stores none)."""
    return {"norm_epsilon": float(g("attention.layer_norm_epsilon", 1e-5)), "hidden_act": "gelu_pytorch_tanh",
            "use_bias": "blk.0.attn_q.bias" in names, "sliding_window": None}


ARCH_FIELDS: dict[str, Callable] = {"starcoder2": starcoder2_fields, "phi2": phi2_fields, "gptneox": gptneox_fields,
                                    "gpt2": gpt2_fields, "glm4": glm4_fields, "smollm3": smollm3_fields, "granite": granite_fields,
                                    "command-r": command_r_fields, "cohere2": command_r_fields,
                                    "gemma": gemma_fields, "gemma2": gemma2_fields, "gemma3": gemma3_fields, "phi3": phi3_fields}
