"""The Llama family in Flax NNX: Llama 2/3 (llama3 rope scaling), Mistral (sliding window),
Qwen2 (qkv bias), Qwen3 (q/k RMSNorm), SmolLM2, SmolLM3 (NoPE layers), Gemma 1 ((1 + w) norms, scaled embeddings, GeGLU:
config fields) and Phi-3 (longrope, partial rotary; its fused checkpoint tensors are split by the
converters' name map).

Forward contract (what the engine calls, see jvllm.worker.model_runner):
    hidden, kv = model(tokens[T], kv, md)
`tokens` is the flat ragged batch, `md` an `AttentionMetadata`, `kv` a list (one entry per layer)
of `(k_pages, v_pages)`, each an array `[kv_heads, num_blocks, block_size, head_dim]` or, with
`kv_cache_dtype="fp8"`, a `jvllm.ops.kv_quant.QuantizedPages` (float8 pages and their scales), that
comes back updated (donate it). `hidden [T, hidden_size]` is after the final norm; `model.logits(h)` projects
to the vocabulary in float32. Layers are a Python list, so the layer loop is unrolled in the
traced program (measured: a `lax.scan` over stacked layers ran at 31% of bandwidth on an H200,
unrolled at 69%; ../shared/DESIGN.md principle 6).

Parameter layout (logical axes in brackets) is chosen for sharding, not for checkpoint fidelity;
jvllm.converters owns the mapping from checkpoint tensors:
  embed.weight [vocab, embed]; q_proj [embed, heads, head_dim]; k_proj/v_proj [embed, kv_heads,
  head_dim]; o_proj [heads, head_dim, embed]; gate/up [embed, mlp]; down [mlp, embed];
  lm_head [embed, vocab] (absent when embeddings are tied).
"""
from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from jvllm.config import ModelConfig
from jvllm.models.layers import Attention, List, declare, mlp, norm
from jvllm.ops.attention import AttentionMetadata


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, dtype):
        self.input_layernorm = norm(cfg, cfg.hidden_size, dtype)
        self.self_attn = Attention(cfg, layer, dtype)
        self.post_attention_layernorm = norm(cfg, cfg.hidden_size, dtype)
        self.mlp = mlp(cfg, dtype)

    def __call__(self, x, kv, md, kv_chunk_blocks, attention="xla"):
        a, kv = self.self_attn(self.input_layernorm(x), kv, md, kv_chunk_blocks, attention)
        x = x + a
        x = x + self.ffn(self.post_attention_layernorm(x), md)
        return x, kv

    def ffn(self, h, md):
        """The feed-forward block on the normed hidden states (a MoE layer's routes, step metadata `md`
        in hand)."""
        return self.mlp(h)


class LlamaForCausalLM(nnx.Module):
    """The whole model, or one pipeline stage of it: `layers=(start, end)` builds only those
    decoder layers (named layers.0 .. layers.{end-start-1} here), the embedding when start == 0
    and the final norm (+ untied LM head) when end == num_layers. A stage's input is token ids if
    it is the first, else the previous stage's hidden states."""

    layer_cls = DecoderLayer  # a family with another decoder layer subclasses and replaces this

    def __init__(self, cfg: ModelConfig, dtype=jnp.float32, layers: tuple[int, int] | None = None):
        start, end = layers or (0, cfg.num_layers)
        self.config = cfg
        self.first, self.last = start == 0, end == cfg.num_layers
        if self.first:
            self.embed = declare((cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), dtype)
        self.layers = List([self.layer_cls(cfg, i, dtype) for i in range(start, end)])
        if self.last:
            self.norm = norm(cfg, cfg.hidden_size, dtype)
            if not cfg.tie_word_embeddings:
                self.lm_head = declare((cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), dtype)
            if cfg.lm_head_bias:  # carried with the stage's params; LMHead adds it (HeadParams)
                self.lm_head_bias = declare((cfg.vocab_size,), ("vocab",), dtype)

    def __call__(self, x, kv, md: AttentionMetadata, kv_chunk_blocks: int = 16, attention: str = "xla",
                 hooks=None):
        """attention: "xla" (the reference, any batch); "ragged" (jvllm's Pallas ragged paged-attention
        kernel, any batch, with its measured launch defaults: split-K for decode grids under 512
        programs); "ragged_split" (split-K for every decode-only batch); "pallas" (decode-only
        batches: JAX's Pallas GPU paged-attention kernel,
        sliding-window layers on the ragged kernel). A "_interpret" suffix runs the Pallas kernels
        in interpret mode (CPU tests). `hooks`: `jvllm.models.hooks` (None: no hook traced)."""
        if self.first:
            x = self.embed_tokens(x, md)
            if hooks is not None:
                x = hooks.embedded(x)
        new_kv = []
        for layer, layer_kv in zip(self.layers, kv):
            x, layer_kv = layer(x, layer_kv, md, kv_chunk_blocks, attention)
            if hooks is not None:
                x = hooks.after_layer(len(new_kv), x)
            new_kv.append(layer_kv)
        if not self.last:
            return x, new_kv
        h = self.norm(x)
        return (hooks.final(h) if hooks is not None else h), new_kv

    def embed_tokens(self, tokens, md: AttentionMetadata):
        """The first stage's input: token ids [T] -> embeddings [T, hidden] (a family with
        position embeddings overrides this)."""
        x = self.embed[...][tokens]
        if self.config.embed_scale:  # Gemma: sqrt(hidden) rounded to the model dtype, as transformers
            x = x * jnp.asarray(self.config.hidden_size ** 0.5, x.dtype)
        elif self.config.embedding_multiplier is not None:  # Granite: a float32 product, rounded once
            x = (x.astype(jnp.float32) * self.config.embedding_multiplier).astype(x.dtype)
        return x
