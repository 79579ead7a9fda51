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
                     drop: tuple = (), extra: dict | None = None):
    """Re-encode a tiny HF Llama checkpoint as GGUF. qtype_for(gguf_name, shape) picks each
    tensor's type; K-quant types get random valid blocks instead of the HF values."""
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
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
