"""IBM Granite 3.x (GraniteForCausalLM, and its mixture-of-experts GraniteMoe / GraniteMoeShared
on jvllm.models.moe's layer) in Flax NNX: the Llama decoder with four scales, each a
ModelConfig field: `embedding_multiplier` (the embeddings, in `LlamaForCausalLM`),
`attention_multiplier` (the attention scale itself, in `layers.Attention`), `logits_scaling` (a
divisor of the logits, in `layers.LMHead`) and `residual_multiplier`, which scales each block's
output before its residual add (this file's decoder layer; a float32 product rounded once to the
model dtype, as torch computes a bf16 tensor times a Python float)."""
from __future__ import annotations

import jax.numpy as jnp

from jvllm.config import ModelConfig
from jvllm.models.llama import DecoderLayer, LlamaForCausalLM
from jvllm.models.moe import MoEDecoderLayer, MoEForCausalLM


class ScaledResiduals:
    """A mixin for a decoder layer (Llama's or the MoE one): each block's output scaled before its
    residual add."""

    def __init__(self, cfg: ModelConfig, layer: int, dtype):
        super().__init__(cfg, layer, dtype)
        self.residual_multiplier = float(cfg.residual_multiplier)

    def _scaled(self, y):
        return (y.astype(jnp.float32) * self.residual_multiplier).astype(y.dtype)

    def __call__(self, x, kv, md, kv_chunk_blocks, attention="xla"):
        a, kv = self.self_attn(self.input_layernorm(x), kv, md, kv_chunk_blocks, attention)
        x = x + self._scaled(a)
        x = x + self._scaled(self.ffn(self.post_attention_layernorm(x), md))
        return x, kv


class GraniteDecoderLayer(ScaledResiduals, DecoderLayer):
    """Llama's layer with Granite's scaled residuals."""


class GraniteForCausalLM(LlamaForCausalLM):
    """Granite: the Llama model's embedding, stages and forward contract with the scaled residuals."""

    layer_cls = GraniteDecoderLayer


class GraniteMoeDecoderLayer(ScaledResiduals, MoEDecoderLayer):
    """The MoE layer (a routed expert MLP on sparse layers) with Granite's scaled residuals."""


class GraniteMoeForCausalLM(MoEForCausalLM):
    """GraniteMoe / GraniteMoeShared: the MoE model with Granite's four scales."""

    layer_cls = GraniteMoeDecoderLayer
