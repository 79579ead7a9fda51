"""Cohere Command R / R+ / Aya Expanse (CohereForCausalLM) and Cohere 2 (Command R7B, Command A:
Cohere2ForCausalLM) in Flax NNX; its parallel single-norm layer also serves Phi-1 / 1.5 / 2
(PhiForCausalLM: a LayerNorm with a bias, the ungated MLP, no interleaving) and GPT-J
(GPTJForCausalLM: the same with interleaved rope on the first rotary_dim dims); families.py.

Differences from the Llama decoder, each a ModelConfig field or this file's decoder layer:
  - one LayerNorm without a bias (`norm_kind` "layer", `norm_bias` False) feeds attention and the
    MLP in parallel: x + attn(h) + mlp(h), h = input_layernorm(x) (this file)
  - rope on interleaved pairs (2i, 2i + 1) (`rope_interleaved`)
  - logits multiplied by `logit_scale`; Command R+'s q/k LayerNorms have a weight per head
    (`qk_norm_layout` "per_head"); Cohere 2's global layers have no rotary embedding (`nope_layers`)
    and its sliding ones a window (`layer_types`)
"""
from __future__ import annotations

from flax import nnx

from jvllm.config import ModelConfig
from jvllm.models.layers import Attention, mlp, norm
from jvllm.models.llama import LlamaForCausalLM


class CohereDecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, dtype):
        self.input_layernorm = norm(cfg, cfg.hidden_size, dtype)
        self.self_attn = Attention(cfg, layer, dtype)
        self.mlp = mlp(cfg, dtype)

    def __call__(self, x, kv, md, kv_chunk_blocks, attention="xla"):
        h = self.input_layernorm(x)
        a, kv = self.self_attn(h, kv, md, kv_chunk_blocks, attention)
        return x + a + self.mlp(h), kv


class CohereForCausalLM(LlamaForCausalLM):
    """Cohere / Cohere 2: the Llama model's embedding, stages and forward contract with the
    parallel, single-norm decoder layer."""

    layer_cls = CohereDecoderLayer
