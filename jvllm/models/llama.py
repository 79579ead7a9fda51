"""The Llama family in Flax NNX: Llama 2/3 (llama3 rope scaling), Mistral (sliding window),
Qwen2 (qkv bias), Qwen3 (q/k RMSNorm), SmolLM2.

Forward contract (what the engine calls, see jvllm.runner):
    hidden, kv = model(tokens[T], kv, md)
`tokens` is the flat ragged batch, `md` an `AttentionMetadata`, `kv` a list (one entry per layer)
of `(k_pages, v_pages)` arrays `[kv_heads, num_blocks, block_size, head_dim]` that comes back
updated (donate it). `hidden [T, hidden_size]` is after the final norm; `model.logits(h)` projects
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

import jax
import jax.numpy as jnp
from flax import nnx

from jvllm.config import ModelConfig
from jvllm.models.layers import RMSNorm, apply_rope, declare, rope_inv_freq
from jvllm.ops.attention import AttentionMetadata, paged_attention, pallas_decode_attention, shard_local
from jvllm.ops.pallas_attention import ragged_paged_attention

_List = getattr(nnx, "List", list)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, dtype):
        D, H, K, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = declare((D, H, hd), ("embed", "heads", "head_dim"), dtype)
        self.k_proj = declare((D, K, hd), ("embed", "kv_heads", "head_dim"), dtype)
        self.v_proj = declare((D, K, hd), ("embed", "kv_heads", "head_dim"), dtype)
        self.o_proj = declare((H, hd, D), ("heads", "head_dim", "embed"), dtype)
        if cfg.attention_bias:
            self.q_bias = declare((H, hd), ("heads", "head_dim"), dtype)
            self.k_bias = declare((K, hd), ("kv_heads", "head_dim"), dtype)
            self.v_bias = declare((K, hd), ("kv_heads", "head_dim"), dtype)
        if cfg.o_bias:
            self.o_bias = declare((D,), ("embed",), dtype)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, dtype, axes=("head_dim",))
            self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, dtype, axes=("head_dim",))
        self.bias = cfg.attention_bias
        self.has_o_bias = cfg.o_bias
        self.qk_norm = cfg.qk_norm
        self.window = cfg.layer_windows[layer]
        self.scale = float(hd) ** -0.5

    def __call__(self, x, kv, md: AttentionMetadata, inv_freq, rope_scale, kv_chunk_blocks, attention="xla"):
        q = jnp.einsum("td,dhk->thk", x, self.q_proj[...])
        k = jnp.einsum("td,dhk->thk", x, self.k_proj[...])
        v = jnp.einsum("td,dhk->thk", x, self.v_proj[...])
        if self.bias:
            q, k, v = q + self.q_bias[...], k + self.k_bias[...], v + self.v_bias[...]
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        pos = jnp.maximum(md.positions, 0)
        q = apply_rope(q, pos, inv_freq, rope_scale)
        k = apply_rope(k, pos, inv_freq, rope_scale)
        k_pages, v_pages = kv
        interpret = attention.endswith("_interpret")

        def attend(q, k_pages, v_pages, md):  # per device under TP (shard_local)
            if attention == "xla":
                return paged_attention(q, k_pages, v_pages, md, scale=self.scale, window=self.window,
                                       kv_chunk_blocks=kv_chunk_blocks)
            if attention.startswith("pallas") and self.window is None:  # decode-only steps
                return pallas_decode_attention(q, k_pages, v_pages, md, scale=self.scale, interpret=interpret)
            return ragged_paged_attention(q, k_pages, v_pages, md, scale=self.scale, window=self.window,
                                          num_splits="auto" if attention.startswith("ragged_split") else None,
                                          interpret=interpret)

        o, k_pages, v_pages = shard_local(attend, q, k, v, k_pages, v_pages, md)
        out = jnp.einsum("thk,hkd->td", o, self.o_proj[...])
        if self.has_o_bias:
            out = out + self.o_bias[...]
        return out, (k_pages, v_pages)


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype):
        D, I = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = declare((D, I), ("embed", "mlp"), dtype)
        self.up_proj = declare((D, I), ("embed", "mlp"), dtype)
        self.down_proj = declare((I, D), ("mlp", "embed"), dtype)
        if cfg.mlp_bias:
            self.gate_bias = declare((I,), ("mlp",), dtype)
            self.up_bias = declare((I,), ("mlp",), dtype)
            self.down_bias = declare((D,), ("embed",), dtype)
        self.has_bias = cfg.mlp_bias

    def __call__(self, x):
        g = x @ self.gate_proj[...]
        u = x @ self.up_proj[...]
        if self.has_bias:
            g, u = g + self.gate_bias[...], u + self.up_bias[...]
        y = (jax.nn.silu(g) * u) @ self.down_proj[...]
        return y + self.down_bias[...] if self.has_bias else y


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, dtype):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = Attention(cfg, layer, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = MLP(cfg, dtype)

    def __call__(self, x, kv, md, inv_freq, rope_scale, kv_chunk_blocks, attention="xla"):
        a, kv = self.self_attn(self.input_layernorm(x), kv, md, inv_freq, rope_scale, kv_chunk_blocks, attention)
        x = x + a
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, kv


class LlamaForCausalLM(nnx.Module):
    """The whole model, or one pipeline stage of it: `layers=(start, end)` builds only those
    decoder layers (named layers.0 .. layers.{end-start-1} here), the embedding when start == 0
    and the final norm (+ untied LM head) when end == num_layers. A stage's input is token ids if
    it is the first, else the previous stage's hidden states."""

    def __init__(self, cfg: ModelConfig, dtype=jnp.float32, layers: tuple[int, int] | None = None):
        start, end = layers or (0, cfg.num_layers)
        self.config = cfg
        self.first, self.last = start == 0, end == cfg.num_layers
        if self.first:
            self.embed = declare((cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), dtype)
        self.layers = _List([DecoderLayer(cfg, i, dtype) for i in range(start, end)])
        if self.last:
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
            if not cfg.tie_word_embeddings:
                self.lm_head = declare((cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), dtype)

    def __call__(self, x, kv, md: AttentionMetadata, kv_chunk_blocks: int = 16, attention: str = "xla",
                 hooks=None):
        """attention: "xla" (the reference, any batch); "ragged" (jvllm's Pallas ragged paged-attention
        kernel, any batch, with its measured launch defaults: split-K for decode grids under 512
        programs); "ragged_split" (split-K for every decode-only batch); "pallas" (decode-only
        batches: JAX's Pallas GPU paged-attention kernel,
        sliding-window layers on the ragged kernel). A "_interpret" suffix runs the Pallas kernels
        in interpret mode (CPU tests). `hooks`: `jvllm.models.hooks` (None: no hook traced)."""
        if self.first:
            x = self.embed[...][x]
            if hooks is not None:
                x = hooks.embedded(x)
        inv_np, rope_scale = rope_inv_freq(self.config)  # trace-time constants
        inv = jnp.asarray(inv_np, jnp.float32)
        new_kv = []
        for layer, layer_kv in zip(self.layers, kv):
            x, layer_kv = layer(x, layer_kv, md, inv, rope_scale, kv_chunk_blocks, attention)
            if hooks is not None:
                x = hooks.after_layer(len(new_kv), x)
            new_kv.append(layer_kv)
        if not self.last:
            return x, new_kv
        h = self.norm(x)
        return (hooks.final(h) if hooks is not None else h), new_kv
