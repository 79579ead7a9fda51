"""GPT-NeoX (GPTNeoXForCausalLM: Pythia, the GPT-NeoX-20B family) in Flax NNX; its parallel layer
also serves Falcon (FalconForCausalLM: no rotary fraction, multi-query or grouped KV heads; a
norm both branches share is loaded into both of the layer's norms; families.py).

Differences from the Llama decoder, each a ModelConfig field set by its registration or read from
the config: LayerNorm with biases (`norm_kind`), a dense (ungated) MLP with biases and the exact
GELU (`mlp_gated`, `hidden_act` gelu), q/k/v/o biases, partial rotary (`rotary_pct`, as
`partial_rotary_factor`), and `use_parallel_residual` (`parallel_residual`: this file's decoder
layer adds attention and MLP outputs, both computed from the layer's input, in one step; without it
the layer is Llama's sequential one). The checkpoint's fused `query_key_value` interleaves q, k and
v per head; the converters' name map splits it.
"""
from __future__ import annotations

from jvllm.config import ModelConfig
from jvllm.models.llama import DecoderLayer, LlamaForCausalLM


class ParallelDecoderLayer(DecoderLayer):
    """Llama's layer's modules, run in parallel: x + attn(input_layernorm(x)) +
    mlp(post_attention_layernorm(x)) (transformers' order: mlp + attn + x)."""

    def __call__(self, x, kv, md, kv_chunk_blocks, attention="xla"):
        a, kv = self.self_attn(self.input_layernorm(x), kv, md, kv_chunk_blocks, attention)
        return self.mlp(self.post_attention_layernorm(x)) + a + x, kv


def neox_layer(cfg: ModelConfig, layer: int, dtype):
    """The decoder layer `cfg.parallel_residual` picks (decided once, at construction)."""
    return (ParallelDecoderLayer if cfg.parallel_residual else DecoderLayer)(cfg, layer, dtype)


class GPTNeoXForCausalLM(LlamaForCausalLM):
    """GPT-NeoX: the Llama model's embedding, stages and forward contract with its decoder layer."""

    layer_cls = staticmethod(neox_layer)
