"""Write GGUF files for tests: an HF checkpoint re-encoded the way llama.cpp's converter does it
(q/k rows permuted, tensors quantized), or K-quant blocks with random but valid contents."""
from __future__ import annotations

import numpy as np

# byte offsets of the float16 scale fields inside one 256-value K-quant block (ggml-common.h)
_KQ = {"Q2_K": (84, (80, 82)), "Q3_K": (110, (108,)), "Q4_K": (144, (0, 2)), "Q5_K": (176, (0, 2)),
       "Q6_K": (210, (208,))}


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def random_kquant(qtype: str, rows: int, cols: int, rng) -> np.ndarray:
    nbytes, scale_offs = _KQ[qtype]
    assert cols % 256 == 0
    raw = rng.integers(0, 256, (rows, cols // 256, nbytes), dtype=np.uint8)
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
                   "gemma2": "gemma2"}


def write_hf_as_gguf(hf_dir: str, out: str, qtype_for=lambda name, shape: "F32"):
    """Re-encode a tiny HF checkpoint (llama, mixtral, qwen2_moe, qwen3_moe, gemma2) as
    llama.cpp's converter does: metadata keys of the arch, tensor names from the gguf package's
    own name map (`gguf.get_tensor_name_map`, llama.cpp's table: an independent source of names
    for the reader under test), experts stacked per layer into [E, out, in], q/k rows permuted for
    arch llama, Gemma norms stored as 1 + w, Qwen2-MoE's shared-expert gate as [D]. qtype_for
    picks each 2-D/3-D tensor's type (F32, F16 or a quants.quantize type)."""
    import os

    import gguf
    import transformers
    from safetensors.numpy import load_file

    c = transformers.AutoConfig.from_pretrained(hf_dir)
    arch = HF_TO_GGUF_ARCH[c.model_type]
    # the checkpoint's own (per-expert) tensors, not transformers 5's fused in-memory layout
    sd = load_file(os.path.join(hf_dir, "model.safetensors"))
    tmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], c.num_hidden_layers)
    w = gguf.GGUFWriter(out, arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    rp = getattr(c, "rope_parameters", None) or {}
    w.add_rope_freq_base(float(rp.get("rope_theta", getattr(c, "rope_theta", 10000.0))))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
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
    tensors = {}
    experts: dict[str, dict[int, np.ndarray]] = {}
    for hf_name, arr in sd.items():
        if hf_name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        e = _expert_of(hf_name)
        if e is not None:  # stacked per layer and projection, as the converter does
            merged, j = e
            experts.setdefault(merged, {})[j] = arr
            continue
        tensors[hf_name] = arr
    for merged, by_j in experts.items():
        tensors[merged + ".weight"] = np.stack([by_j[j] for j in range(len(by_j))])
    for hf_name, arr in tensors.items():
        g = tmap.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert g is not None, f"llama.cpp's name map has no GGUF name for {hf_name}"
        if arch == "llama" and g.endswith("attn_q.weight"):
            arr = permute(arr, c.num_attention_heads)
        elif arch == "llama" and g.endswith("attn_k.weight"):
            arr = permute(arr, c.num_key_value_heads)
        if arch == "gemma2" and g.endswith("norm.weight"):
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
