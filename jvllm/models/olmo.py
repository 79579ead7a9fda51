"""OLMo 2 and OLMo 3 (AI2's fully open models) in Flax NNX; EXAONE 4.0's decoder is this post-norm
layer with per-head q/k norms (`qk_norm_layout` "head"), Llama's RMSNorm and NoPE global layers
(its registration in `families.py`).

Differences from the Llama decoder, each a ModelConfig field or this file's decoder layer:
  - post-norm blocks: no norm before attention or the MLP; `post_attention_layernorm` and
    `post_feedforward_layernorm` normalise each block's output before its residual add (this file)
  - q/k RMSNorms over the whole projection, all heads jointly (`qk_norm_layout` "all"), before rope
  - RMSNorm scales by w in float32 before casting back (`norm_scale_f32`)
  - OLMo 3: sliding-window layers (`layer_types`) and a rope per layer type (its global layers'
    own scaling), both read by the shared config code
Parameter names follow the checkpoint's.
"""
from __future__ import annotations

from flax import nnx

from jvllm.config import ModelConfig
from jvllm.models.layers import MLP, Attention, norm
from jvllm.models.llama import LlamaForCausalLM


class Olmo2DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, dtype):
        D = cfg.hidden_size
        self.self_attn = Attention(cfg, layer, dtype)
        self.post_attention_layernorm = norm(cfg, D, dtype)
        self.mlp = MLP(cfg, dtype)
        self.post_feedforward_layernorm = norm(cfg, D, dtype)

    def __call__(self, x, kv, md, kv_chunk_blocks, attention="xla"):
        a, kv = self.self_attn(x, kv, md, kv_chunk_blocks, attention)
        x = x + self.post_attention_layernorm(a)
        x = x + self.post_feedforward_layernorm(self.mlp(x))
        return x, kv


class Olmo2ForCausalLM(LlamaForCausalLM):
    """OLMo 2 / OLMo 3: the Llama model's embedding, stages, final norm and forward contract with
    the post-norm decoder layer."""

    layer_cls = Olmo2DecoderLayer
