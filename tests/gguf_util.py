"""Write GGUF files for tests: an HF checkpoint re-encoded the way llama.cpp's converter does it
(q/k rows permuted, tensors quantized), or K-quant blocks with random but valid contents."""
from __future__ import annotations

import numpy as np

# block types written as random but valid blocks (gguf.quants has no quantize for them): type ->
# (values per block, bytes per block, byte offsets of its float16 scale fields), from ggml-common.h.
# IQ1_M packs its scale into the top nibbles of its four 16-bit block scales (bytes 48..55).
_KQ = {"Q2_K": (256, 84, (80, 82)), "Q3_K": (256, 110, (108,)), "Q4_K": (256, 144, (0, 2)),
       "Q5_K": (256, 176, (0, 2)), "Q6_K": (256, 210, (208,)), "IQ2_XXS": (256, 66, (0,)), "IQ2_XS": (256, 74, (0,)),
       "IQ2_S": (256, 82, (0,)), "IQ3_XXS": (256, 98, (0,)), "IQ3_S": (256, 110, (0,)), "IQ1_S": (256, 50, (0,)),
       "IQ1_M": (256, 56, (49, 51, 53, 55)), "IQ4_XS": (256, 136, (0,)), "IQ4_NL": (32, 18, (0,)),
       "TQ1_0": (256, 54, (52,)), "TQ2_0": (256, 66, (64,))}


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def random_kquant(qtype: str, rows: int, cols: int, rng) -> np.ndarray:
    """[rows, bytes] of random blocks of `qtype` (a `_KQ` type) whose scales are small finite
    float16s, so the values they decode to are finite."""
    block, nbytes, scale_offs = _KQ[qtype]
    assert cols % block == 0
    raw = rng.integers(0, 256, (rows, cols // block, nbytes), dtype=np.uint8)
    if qtype == "IQ1_M":  # f16 bits 4i..4i+3 in the high nibble of scale word i
        bits = int(np.float16(rng.uniform(0.001, 0.01)).view(np.uint16))
        for i, off in enumerate(scale_offs):
            raw[..., off] = (raw[..., off] & 0x0F) | (((bits >> (4 * i)) & 0xF) << 4)
        return raw.reshape(rows, -1)
    for off in scale_offs:
        raw[..., off:off + 2] = np.frombuffer(np.float16(rng.uniform(0.001, 0.01)).tobytes(), np.uint8)
    return raw.reshape(rows, -1)


def write_llama_gguf(hf_dir: str, out: str, qtype_for=lambda name, shape: "F32", seed: int = 0,
                     drop: tuple = (), extra: dict | None = None, extra_tensors: dict | None = None):
    """Re-encode a tiny HF Llama checkpoint as GGUF. qtype_for(gguf_name, shape) picks each
    tensor's type; K-quant types get random valid blocks instead of the HF values;
    `extra_tensors` {gguf name: float32 array} are written as they are."""
    import gguf
    import torch
    import transformers

    m = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    c = m.config
    sd = {k: v.numpy() for k, v in m.state_dict().items()}
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(out, "llama")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]) if getattr(c, "rope_parameters", None)
                         else float(c.rope_theta))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    for k, v in (extra or {}).items():
        w.add_uint32(k, v)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    sub = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
           "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
           "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    for hf_name, arr in sd.items():
        if hf_name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        if hf_name in names:
            g = names[hf_name]
        else:
            parts = hf_name.split(".")
            g = f"blk.{parts[2]}.{sub['.'.join(parts[3:-1])]}.{parts[-1]}"
        if g in drop:
            continue
        if g.endswith("attn_q.weight"):
            arr = permute(arr, c.num_attention_heads)
        elif g.endswith("attn_k.weight"):
            arr = permute(arr, c.num_key_value_heads)
        qt = qtype_for(g, arr.shape) if arr.ndim == 2 else "F32"
        Q = gguf.GGMLQuantizationType[qt]
        if qt == "F32":
            w.add_tensor(g, arr.astype(np.float32))
        elif qt == "F16":
            w.add_tensor(g, arr.astype(np.float16))
        elif qt in _KQ:
            w.add_tensor(g, random_kquant(qt, *arr.shape, rng), raw_dtype=Q)  # raw_shape: byte shape
        else:
            w.add_tensor(g, gguf.quants.quantize(arr.astype(np.float32), Q), raw_dtype=Q)
    for g, arr in (extra_tensors or {}).items():
        w.add_tensor(g, np.asarray(arr, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


# HF model_type -> GGUF arch, as llama.cpp's convert_hf_to_gguf.py names them (Mixtral is "llama")
HF_TO_GGUF_ARCH = {"llama": "llama", "mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe",
                   "gemma": "gemma", "gemma2": "gemma2", "qwen2": "qwen2", "smollm3": "smollm3", "granite": "granite",
                   "olmo2": "olmo2", "cohere": "command-r", "cohere2": "cohere2", "qwen3": "qwen3", "gemma3_text": "gemma3", "phi3": "phi3",
                   "starcoder2": "starcoder2", "olmoe": "olmoe", "phi": "phi2", "gpt_neox": "gptneox", "gpt2": "gpt2", "glm4": "glm4"}


def write_hf_as_gguf(hf_dir: str, out: str, qtype_for=lambda name, shape: "F32", fuse_qkv: bool = False):
    """Re-encode a tiny HF checkpoint (`HF_TO_GGUF_ARCH`'s model types) as llama.cpp's converter
    does: metadata keys of the arch, tensor names from the gguf package's own name map
    (`gguf.get_tensor_name_map`, llama.cpp's table: an independent source of names for the reader
    under test), experts stacked per layer into [E, out, in], q/k rows permuted for arch llama,
    Gemma norms stored as 1 + w, Qwen2-MoE's shared-expert gate as [D], a global rope scaling as
    rope.scaling.*, Phi-3's longrope as rope_factors_{short,long} tensors and its partial rotary as
    rope.dimension_count. qtype_for picks each 2-D/3-D tensor's type (F32, F16 or a
    quants.quantize type). fuse_qkv: q, k and v as one attn_qkv per layer (older phi2 files)."""
    import math
    import os

    import gguf
    import transformers
    from safetensors.numpy import load_file

    c = transformers.AutoConfig.from_pretrained(hf_dir)
    arch = HF_TO_GGUF_ARCH[c.model_type]
    # the checkpoint's own (per-expert) tensors, not transformers 5's fused in-memory layout
    sd = load_file(os.path.join(hf_dir, "model.safetensors"))
    by_name = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}
    tmap = gguf.get_tensor_name_map(by_name[arch], c.num_hidden_layers)
    w = gguf.GGUFWriter(out, arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(4 * c.hidden_size if c.model_type == "gpt2" else c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads or c.num_attention_heads)  # GPT-NeoX: None (multi-head)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    rp = getattr(c, "rope_parameters", None) or {}
    rp = rp.get("full_attention", rp)  # Gemma 3: the global layers' rope (the sliding ones' is fixed)
    w.add_rope_freq_base(float(rp.get("rope_theta", getattr(c, "rope_theta", 10000.0))))
    if rp.get("rope_type") in ("linear", "yarn"):
        w.add_rope_scaling_type(gguf.RopeScalingType(rp["rope_type"]))
        w.add_rope_scaling_factor(rp["factor"])
    if arch in ("command-r", "cohere2"):  # LayerNorms: their epsilon under llama.cpp's LayerNorm key
        w.add_layer_norm_eps(c.layer_norm_eps)
        w.add_logit_scale(c.logit_scale)
    elif arch == "starcoder2":
        w.add_layer_norm_eps(c.norm_epsilon)
    elif arch == "gpt2":  # llama.cpp's GPT2Model: 4 x hidden as the MLP size, whatever n_inner is
        w.add_layer_norm_eps(c.layer_norm_epsilon)
    elif arch == "gptneox":  # llama.cpp's GPTNeoXModel
        w.add_layer_norm_eps(c.layer_norm_eps)
        w.add_parallel_residual(c.use_parallel_residual)
        w.add_rope_dimension_count(int(rp.get("partial_rotary_factor", 1.0) * head_dim))
    elif arch == "phi2":  # llama.cpp's Phi2Model: LayerNorm epsilon, rotary dims from the factor
        w.add_layer_norm_eps(c.layer_norm_eps)
        w.add_rope_dimension_count(int(rp.get("partial_rotary_factor", 1.0) * head_dim))
    else:
        w.add_layer_norm_rms_eps(c.rms_norm_eps)
    if arch == "cohere2":
        w.add_sliding_window(c.sliding_window)
    if arch == "granite":  # llama.cpp's names for Granite's multipliers
        w.add_embedding_scale(c.embedding_multiplier)
        w.add_residual_scale(c.residual_multiplier)
        w.add_attention_scale(c.attention_multiplier)
        w.add_logit_scale(c.logits_scaling)
    w.add_vocab_size(c.vocab_size)
    n_experts = getattr(c, "num_local_experts", None) or getattr(c, "num_experts", None)
    if n_experts:
        w.add_expert_count(n_experts)
        w.add_expert_used_count(c.num_experts_per_tok)
    if arch in ("qwen2moe", "qwen3moe"):
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
    if arch == "qwen2moe":
        w.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    if arch == "gemma2":
        w.add_sliding_window(c.sliding_window)
        w.add_attn_logit_softcapping(c.attn_logit_softcapping)
        w.add_final_logit_softcapping(c.final_logit_softcapping)
    if arch == "gemma3":
        w.add_sliding_window(c.sliding_window)
    tensors = {}
    if arch == "glm4":  # llama.cpp's Glm4Model: rotary dims from the factor
        w.add_rope_dimension_count(int(rp.get("partial_rotary_factor", 1.0) * head_dim))
    if arch == "phi3":  # llama.cpp's Phi3MiniModel: rope dims from hidden / heads, window 0 for none
        w.add_rope_dimension_count(int(rp.get("partial_rotary_factor", 1.0) * c.hidden_size) // c.num_attention_heads)
        orig = rp.get("original_max_position_embeddings") or c.original_max_position_embeddings
        w.add_rope_scaling_orig_ctx_len(orig)
        w.add_sliding_window(c.sliding_window or 0)
        if rp.get("long_factor"):
            scale = c.max_position_embeddings / orig
            w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1 else 1.0)
            tensors["rope_factors_long"] = np.asarray(rp["long_factor"], np.float32)
            tensors["rope_factors_short"] = np.asarray(rp["short_factor"], np.float32)
    experts: dict[str, dict[int, np.ndarray]] = {}
    for hf_name, arr in sd.items():
        if hf_name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        if arch == "gpt2" and hf_name.endswith((".attn.bias", ".attn.masked_bias")):
            continue  # causal-mask buffers (the converter drops them)
        e = _expert_of(hf_name)
        if e is not None:  # stacked per layer and projection, as the converter does
            merged, j = e
            experts.setdefault(merged, {})[j] = arr
            continue
        tensors[hf_name] = arr
    if arch == "gpt2":  # the converter writes the tied head as a copy of the embedding
        tensors["lm_head.weight"] = tensors["transformer.wte.weight"]
    for merged, by_j in experts.items():
        tensors[merged + ".weight"] = np.stack([by_j[j] for j in range(len(by_j))])
    if fuse_qkv:  # one attn_qkv per layer (named like the q projection: the name map has no fused HF name)
        for q in [n for n in tensors if ".self_attn.q_proj." in n]:
            k, v = q.replace(".q_proj.", ".k_proj."), q.replace(".q_proj.", ".v_proj.")
            tensors[q] = np.concatenate([tensors[q], tensors.pop(k), tensors.pop(v)])
    for hf_name, arr in tensors.items():
        g = (hf_name + ".weight" if hf_name.startswith("rope_factors")
             else tmap.get_name(hf_name, try_suffixes=(".weight", ".bias")))
        assert g is not None, f"llama.cpp's name map has no GGUF name for {hf_name}"
        if fuse_qkv and ".attn_q." in g:
            g = g.replace(".attn_q.", ".attn_qkv.")
        if arch == "gpt2" and hf_name.endswith((".c_attn.weight", ".c_proj.weight", ".c_fc.weight")):
            arr = arr.T  # the converter transposes GPT-2's Conv1D weights to [out, in]
        if arch == "gptneox" and ".attn_qkv." in g:  # HF's per-head interleave -> [q; k; v] blocks
            arr = arr.reshape(c.num_attention_heads, 3, -1, *arr.shape[1:]).swapaxes(0, 1).reshape(arr.shape)
        if arch in ("llama", "smollm3", "granite") and g.endswith("attn_q.weight"):
            arr = permute(arr, c.num_attention_heads)
        elif arch in ("llama", "smollm3", "granite") and g.endswith("attn_k.weight"):
            arr = permute(arr, c.num_key_value_heads)
        if arch in ("gemma", "gemma2", "gemma3") and g.endswith("norm.weight"):
            arr = arr + np.float32(1.0)
        if g.endswith("ffn_gate_inp_shexp.weight"):
            arr = arr.reshape(-1)
        qt = qtype_for(g, arr.shape) if arr.ndim >= 2 else "F32"
        Q = gguf.GGMLQuantizationType[qt]
        if qt == "F32":
            w.add_tensor(g, np.ascontiguousarray(arr, np.float32))
        elif qt == "F16":
            w.add_tensor(g, arr.astype(np.float16))
        else:
            w.add_tensor(g, gguf.quants.quantize(np.ascontiguousarray(arr, np.float32), Q), raw_dtype=Q)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _expert_of(hf_name: str):
    """(merged name without .weight, expert index) of a per-expert HF tensor, else None."""
    import re

    m = re.fullmatch(r"(model\.layers\.\d+\.(?:block_sparse_moe|mlp)\.experts)\.(\d+)\.(\w+)\.weight", hf_name)
    return None if m is None else (f"{m.group(1)}.{m.group(3)}", int(m.group(2)))


def jvllm_logits(path: str, ids: list[list[int]]) -> list[np.ndarray]:
    """jvllm's float32 logits [len, vocab] of each prompt in `ids`, from checkpoint `path` (a GGUF
    file or an HF folder), one sequence at a time through a ModelRunner."""
    import jax.numpy as jnp

    from jvllm.config import cdiv
    from jvllm.converters import load_checkpoint
    from jvllm.models import bind
    from jvllm.models.layers import head_of
    from jvllm.worker.model_runner import ModelRunner

    ck = load_checkpoint(path, "float32")
    cfg = ck.config
    g, s = bind(cfg, ck.params, jnp.float32)
    head = head_of(cfg, ck.params)
    n = max(len(p) for p in ids)
    r = ModelRunner(cfg, g, s, head, dtype=jnp.float32, block_size=16, num_blocks=cdiv(n, 16) + 1,
                    max_model_len=n, max_num_seqs=1, token_buckets=(n,))
    return [r.sequence_logits(p) for p in ids]
