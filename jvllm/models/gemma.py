"""Gemma 2 and Gemma 3 (text) in Flax NNX; GLM-4-0414's decoder is this sandwich layer with plain
RMSNorms (its norms renamed by the converters' "glm4" name map).

Differences from the Llama decoder, each a ModelConfig field read by the shared layers
(`jvllm.models.layers`), set for this family by its registration (`families.py`):
  - RMSNorm scales by (1 + w) in float32 (`norm_unit_offset`); q/k norms too (Gemma 3)
  - embeddings multiplied by sqrt(hidden_size) in the model dtype (`embed_scale`)
  - "sandwich" norms: input_layernorm -> attention -> post_attention_layernorm -> residual,
    pre_feedforward_layernorm -> MLP -> post_feedforward_layernorm -> residual (this file)
  - GeGLU MLP (`hidden_act` gelu_pytorch_tanh); attention scale query_pre_attn_scalar ** -0.5
  - attention-logit soft-cap (Gemma 2) in the attention ops; final-logit soft-cap in the logits
    (`jvllm.models.layers.LMHead`, used by every program that computes logits)
  - alternating sliding-window / global layers (`layer_windows`, from the config's layer_types);
    Gemma 3's sliding layers use their own rope base (`local_rope_theta`)
  - head_dim 256, tied embeddings, a 262k vocabulary: nothing special in the code, only sizes.
Parameter names follow the checkpoint's (the extra norms keep transformers' names).
"""
from __future__ import annotations

from flax import nnx

from jvllm.config import ModelConfig
from jvllm.models.layers import MLP, Attention, norm
from jvllm.models.llama import LlamaForCausalLM


class GemmaDecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, dtype):
        D = cfg.hidden_size
        self.input_layernorm = norm(cfg, D, dtype)
        self.self_attn = Attention(cfg, layer, dtype)
        self.post_attention_layernorm = norm(cfg, D, dtype)
        self.pre_feedforward_layernorm = norm(cfg, D, dtype)
        self.mlp = MLP(cfg, dtype)
        self.post_feedforward_layernorm = norm(cfg, D, dtype)

    def __call__(self, x, kv, md, kv_chunk_blocks, attention="xla"):
        a, kv = self.self_attn(self.input_layernorm(x), kv, md, kv_chunk_blocks, attention)
        x = x + self.post_attention_layernorm(a)
        x = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        return x, kv


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma 2 / Gemma 3 text models: the Llama model's embedding, stages and forward contract
    with Gemma's decoder layer (the embedding scale and norm kind come from the config)."""

    layer_cls = GemmaDecoderLayer
