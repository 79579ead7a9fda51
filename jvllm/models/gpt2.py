"""GPT-2 (GPT2LMHeadModel), GPTBigCode (GPTBigCodeForCausalLM: StarCoder 1, SantaCoder; one KV
head under multi_query) and OPT (OPTForCausalLM) in Flax NNX: the pre-norm decoder of
`llama.py` with their variants, each a ModelConfig field set by the registration: LayerNorm with
biases (`norm_kind`), a dense (ungated) MLP with biases (`mlp_gated`; GPT-2's tanh GELU, OPT's
ReLU), q/k/v/o biases, tied embeddings, and learned absolute position embeddings added to the
token embeddings instead of a rotary embedding (`learned_positions`: this file; OPT's table starts
`position_offset` = 2 rows in). GPT-2's fused, Conv1D-layout `c_attn` ([in, out]) is split by the
converters' name map.

Positions beyond the table (`n_positions`, ModelConfig.max_position_embeddings) cannot be
embedded: the engine refuses a longer max_model_len (`engine_config.check_options`)."""
from __future__ import annotations

import jax.numpy as jnp

from jvllm.config import ModelConfig
from jvllm.models.layers import declare
from jvllm.models.llama import LlamaForCausalLM
from jvllm.ops.attention import AttentionMetadata


class GPT2LMHeadModel(LlamaForCausalLM):
    """GPT-2 and OPT: the Llama model's stages and forward contract with a position-embedding table."""

    def __init__(self, cfg: ModelConfig, dtype=jnp.float32, layers: tuple[int, int] | None = None):
        super().__init__(cfg, dtype, layers)
        self.position_offset = cfg.position_offset
        if self.first:
            rows = cfg.max_position_embeddings + cfg.position_offset
            self.pos_embed = declare((rows, cfg.hidden_size), ("positions", "embed"), dtype)

    def embed_tokens(self, tokens, md: AttentionMetadata):
        # a padding slot's position is -1: clamp it (its row is never read back)
        return self.embed[...][tokens] + self.pos_embed[...][jnp.maximum(md.positions, 0) + self.position_offset]
