"""Building blocks shared by model families: rotary embeddings (default / linear / llama3 / yarn /
dynamic / longrope / llama.cpp's frequency factors, partial rotary, per-layer local bases, NoPE
layers), attention (q/k norms, biases, soft-capping, sliding windows), the gated MLP (SwiGLU,
GeGLU) and the ungated one (GPT-2, GPT-NeoX), the projections' backend and the LM head. The norms
are in `norms.py`, parameter declaration in `params.py`.

Every parameter is declared once, through `declare`, with its shape, dtype and *logical* axis names
(`("embed", "heads", "head_dim")`...). Nothing else in jvllm states a parameter's shape: the
converters check checkpoints against these declarations and `jvllm.sharding` maps the logical axes
onto a mesh. Params are created as zeros/ones; real values come from a converter or from
`jvllm.converters.random_device_params` (model construction runs under `nnx.eval_shape`, so it allocates
nothing).
"""
from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jvllm.config import ModelConfig
from jvllm.models.norms import norm
from jvllm.models.params import LOGICAL_AXES, declare  # noqa: F401  (LOGICAL_AXES: the models' axis names)
from jvllm.ops.activations import activation
from jvllm.ops.attention import AttentionMetadata, paged_attention, pallas_decode_attention, shard_local
from jvllm.ops.fixed_tile_matmul import fixed_tile_matmul, fixed_tile_matmuls
from jvllm.ops.pallas_attention import ragged_paged_attention
from jvllm.quantization.schemes import Dense, Projection, num_contracted, projection_for, split_spec

List = getattr(nnx, "List", list)  # a module list nnx tracks (older flax: a plain list)

# ----------------------------------------------------------------------------------- projections
@dataclasses.dataclass(frozen=True)
class FixedTileDense(Dense):
    """Batch-invariant mode's projection (`jvllm.worker.batch_invariant`): unquantized weights
    through `jvllm.ops.fixed_tile_matmul`, whose per-element reduction order does not depend on
    the number of tokens; `many` runs a group of weights (q/k/v, gate/up) as one launch. The
    spec's activation must be the token axis followed by the weight's contracted dims in the
    weight's order ("td,dhk->thk", "thk,hkd->td"); the weight and the activation are viewed as 2-D
    (a reshape, no copy)."""

    name = "fixed_tile"

    def __call__(self, spec, x, w, scale):
        return self.many(spec, x, [(w, scale)])[0]

    def many(self, spec, x, weights):
        xs, ws, out = split_spec(spec)
        n = num_contracted(spec)
        if xs != out[0] + ws[:n] or out != out[0] + ws[n:]:
            raise ValueError(f"FixedTileDense: spec {spec!r} is not 'token + contracted, weight -> token + outputs'")
        w_list = [w[...] for w, _ in weights]
        K = int(np.prod(w_list[0].shape[:n]))
        ys = fixed_tile_matmuls(x.reshape(x.shape[0], K), [w.reshape(K, -1) for w in w_list])
        return [y.reshape(x.shape[0], *w.shape[n:]) for y, w in zip(ys, w_list)]


FIXED_TILE_DENSE = FixedTileDense()


def projection(cfg: ModelConfig) -> Projection:
    """The projections' backend, chosen once per module at construction: `FIXED_TILE_DENSE` in
    batch-invariant mode (`cfg.batch_invariant`), else the format of `cfg.quant`
    (`jvllm.quantization`). ValueError for what batch-invariant mode does not implement: quantized
    weights and mixture-of-experts layers (whose expert matmul's order depends on the routing)."""
    if not cfg.batch_invariant:
        return projection_for(cfg.quant)
    if cfg.quant is not None:
        raise ValueError(f"batch_invariant=True with quantization ({cfg.quant.method}) is not implemented: "
                         f"its projections have no fixed-tile matmul")
    if cfg.moe is not None:
        raise ValueError(f"batch_invariant=True with a mixture-of-experts model ({cfg.architecture}) is not "
                         f"implemented: the expert matmul's reduction order depends on the routing")
    return FIXED_TILE_DENSE


# ----------------------------------------------------------------------------------- rotary
@dataclasses.dataclass(frozen=True)
class Rope:
    """Rotary embedding of one layer kind: `inv_freq` [rotary_dim/2] and the cos/sin scale.
    longrope: `long_inv_freq` replaces `inv_freq` at positions >= `long_from` (the original
    context length), per position. transformers switches a whole forward pass to the long factors
    once its longest position passes `long_from`, so the two agree on every sequence within the
    original context. Hazard: vLLM (and llama.cpp) instead pick one set for the whole engine, the
    long one when max_model_len exceeds the original context; and a sequence that crosses
    `long_from` here attends from long-factor queries to short-factor keys."""
    inv_freq: tuple           # floats (hashable: a module attribute is static graph metadata)
    scale: float
    long_inv_freq: tuple | None = None
    long_from: int = 0
    long_scale: float | None = None  # the cos / sin scale at positions >= long_from (else `scale`)
    interleaved: bool = False  # rotate pairs (2i, 2i + 1) (Cohere, GLM) instead of (i, i + rot/2)


def layer_rope(cfg: ModelConfig, local: bool) -> Rope:
    """The rope of a sliding-window layer (local=True: its own base when the config has one) or a
    global layer."""
    if local and cfg.local_rope_theta is not None:
        cfg = dataclasses.replace(cfg, rope_theta=cfg.local_rope_theta, rope_scaling=cfg.local_rope_scaling,
                                  local_rope_theta=None, local_rope_scaling=None)
    if cfg.rope_type == "longrope":
        p = cfg.rope_params
        d, base = cfg.rotary_dim, cfg.rope_theta
        orig = int(p["original_max_position_embeddings"])
        factor = p.get("factor") or int(p.get("max_position_embeddings") or cfg.max_position_embeddings) / orig
        att = p.get("attention_factor")
        if att is None:
            att = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
        long_att = None
        if cfg.longrope_mscale:  # Phi-3.5-MoE: its own short / long scales replace the attention factor
            att, long_att = float(p["short_mscale"]), float(p["long_mscale"])
        shape = np.arange(0, d, 2, dtype=np.float64) / d
        short = 1.0 / (np.asarray(p["short_factor"], np.float64) * base ** shape)
        long = 1.0 / (np.asarray(p["long_factor"], np.float64) * base ** shape)
        return Rope(tuple(short.tolist()), float(att), tuple(long.tolist()), orig, long_scale=long_att,
                    interleaved=cfg.rope_interleaved)
    inv, scale = rope_inv_freq(cfg)
    return Rope(tuple(inv.tolist()), float(scale), interleaved=cfg.rope_interleaved)


def rope_inv_freq(cfg: ModelConfig) -> tuple[np.ndarray, float]:
    """(inverse frequencies [rotary_dim/2] float64, attention scaling) for the config's rope type.

    default / linear / llama3 / yarn follow transformers' definitions exactly; freq_factors divides
    the default frequencies by llama.cpp's per-frequency factors (a GGUF's rope_freqs tensor). `dynamic` (NTK) is
    position-independent here: for sequences within `max_position_embeddings` it equals the default
    frequencies, which is what transformers computes at those lengths (the engine refuses a longer
    max_model_len for it: `engine_config.check_options`). longrope: `layer_rope`.
    """
    d, base = cfg.rotary_dim, cfg.rope_theta
    p = cfg.rope_params
    inv = 1.0 / (base ** (np.arange(0, d, 2, dtype=np.float64) / d))
    rtype = cfg.rope_type
    if rtype == "longrope":
        raise ValueError("longrope frequencies depend on the position: use layer_rope")
    scale = 1.0
    if rtype == "linear":
        inv = inv / float(p["factor"])
    elif rtype == "freq_factors":  # llama.cpp's rope_freqs: one divisor per frequency
        inv = inv / np.asarray(p["factors"], np.float64)
    elif rtype == "llama3":
        factor = float(p["factor"])
        lo, hi = float(p.get("low_freq_factor", 1.0)), float(p.get("high_freq_factor", 4.0))
        old = float(p.get("original_max_position_embeddings", 8192))
        lo_wl, hi_wl = old / lo, old / hi
        wl = 2 * math.pi / inv
        out = np.where(wl > lo_wl, inv / factor, inv)
        smooth = (old / wl - lo) / (hi - lo)
        smoothed = (1 - smooth) * out / factor + smooth * out
        medium = ~(wl < hi_wl) & ~(wl > lo_wl)
        inv = np.where(medium, smoothed, out)
    elif rtype == "yarn":
        factor = float(p["factor"])
        orig = p.get("original_max_position_embeddings") or cfg.max_position_embeddings

        def mscale(s, m=1.0):
            return 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1.0

        att = p.get("attention_factor")
        if att is None:
            ms, msa = p.get("mscale"), p.get("mscale_all_dim")
            att = mscale(factor, ms) / mscale(factor, msa) if (ms and msa) else mscale(factor)
        beta_fast, beta_slow = float(p.get("beta_fast") or 32), float(p.get("beta_slow") or 1)

        def corr_dim(rot):
            return (d * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

        low, high = corr_dim(beta_fast), corr_dim(beta_slow)
        if p.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, d - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(d // 2, dtype=np.float64) - low) / (high - low), 0, 1)
        extrap = 1 - ramp
        pos_freqs = base ** (np.arange(0, d, 2, dtype=np.float64) / d)
        inv = (1.0 / (factor * pos_freqs)) * (1 - extrap) + (1.0 / pos_freqs) * extrap
        scale = float(att)
    return inv, scale


def apply_rope(x, positions, rope: Rope):
    """x [T, heads, head_dim]; positions [T] int; on the first 2 * len(inv_freq) dims (partial
    rotary; the rest passed through), pair i is dims (i, i + rot/2) (rotate-half, transformers'
    Llama convention) or, with `rope.interleaved`, dims (2i, 2i + 1)."""
    inv = jnp.asarray(rope.inv_freq, jnp.float32)[None, :]
    if rope.long_inv_freq is not None:
        inv = jnp.where(positions[:, None] >= rope.long_from, jnp.asarray(rope.long_inv_freq, jnp.float32)[None, :], inv)
    freqs = positions.astype(jnp.float32)[:, None] * inv  # [T, rot/2]
    scale = rope.scale
    if rope.long_scale is not None and rope.long_scale != rope.scale:
        scale = jnp.where(positions[:, None] >= rope.long_from, jnp.float32(rope.long_scale), jnp.float32(rope.scale))
    cos = (jnp.cos(freqs) * scale)[:, None, :]
    sin = (jnp.sin(freqs) * scale)[:, None, :]
    rot = 2 * len(rope.inv_freq)
    xf = x.astype(jnp.float32)
    if rope.interleaved:
        x1, x2 = xf[..., 0:rot:2], xf[..., 1:rot:2]
        pairs = jnp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).reshape(*xf.shape[:-1], rot)
        return jnp.concatenate([pairs, xf[..., rot:]], axis=-1).astype(x.dtype)
    x1, x2 = jnp.split(xf[..., :rot], 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, xf[..., rot:]], axis=-1)
    return out.astype(x.dtype)


# ----------------------------------------------------------------------------------- blocks
class Attention(nnx.Module):
    """q/k/v projections (optional biases, optional clamp, optional q/k norms), rope, paged attention
    over the layer's KV pages (sliding window and soft-cap as configured), o projection. The attention
    backend string is the model's `attention` argument (see `LlamaForCausalLM.__call__`); the
    JAX Pallas decode kernel has neither window nor soft-cap, so such layers use the ragged kernel."""

    def __init__(self, cfg: ModelConfig, layer: int, dtype):
        D, H, K, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.proj = p = projection(cfg)  # the projections' backend, chosen once
        self.q_proj, self.q_proj_scale = p.declare((D, H, hd), ("embed", "heads", "head_dim"), 1, dtype)
        self.k_proj, self.k_proj_scale = p.declare((D, K, hd), ("embed", "kv_heads", "head_dim"), 1, dtype)
        self.v_proj, self.v_proj_scale = p.declare((D, K, hd), ("embed", "kv_heads", "head_dim"), 1, dtype)
        self.o_proj, self.o_proj_scale = p.declare((H, hd, D), ("heads", "head_dim", "embed"), 2, dtype)
        if cfg.attention_bias:
            self.q_bias = declare((H, hd), ("heads", "head_dim"), dtype)
            self.k_bias = declare((K, hd), ("kv_heads", "head_dim"), dtype)
            self.v_bias = declare((K, hd), ("kv_heads", "head_dim"), dtype)
        if cfg.o_bias:
            self.o_bias = declare((D,), ("embed",), dtype)
        if cfg.qk_norm and cfg.qk_norm_layout != "head":  # a weight per head; "all": the heads jointly
            joint = 2 if cfg.qk_norm_layout == "all" else 1
            self.q_norm = norm(cfg, (H, hd), dtype, axes=("heads", "head_dim"), reduce_dims=joint)
            self.k_norm = norm(cfg, (K, hd), dtype, axes=("kv_heads", "head_dim"), reduce_dims=joint)
        elif cfg.qk_norm:
            self.q_norm = norm(cfg, hd, dtype, axes=("head_dim",))
            self.k_norm = norm(cfg, hd, dtype, axes=("head_dim",))
        self.bias = cfg.attention_bias
        self.has_o_bias = cfg.o_bias
        self.qk_norm = cfg.qk_norm
        self.qk_norm_after_rope = cfg.qk_norm_after_rope
        self.clip = None if cfg.clip_qkv is None else float(cfg.clip_qkv)
        self.window = cfg.layer_windows[layer]
        self.softcap = cfg.attn_logit_softcap
        self.scale = (float(cfg.attention_multiplier) if cfg.attention_multiplier is not None
                      else float(cfg.query_pre_attn_scalar or hd) ** -0.5)
        # trace-time constants; None: a NoPE layer (no rotary embedding)
        self.rope = (None if layer in cfg.nope_layers or cfg.learned_positions
                     else layer_rope(cfg, local=self.window is not None))
        self.temperature = ((float(cfg.attn_temperature_beta), int(cfg.attn_temperature_len))
                            if cfg.attn_temperature_beta else None)

    def __call__(self, x, kv, md: AttentionMetadata, kv_chunk_blocks, attention="xla"):
        q, k, v = self.proj.many("td,dhk->thk", x, [(self.q_proj, self.q_proj_scale), (self.k_proj, self.k_proj_scale),
                                                    (self.v_proj, self.v_proj_scale)])
        if self.bias:
            q, k, v = q + self.q_bias[...], k + self.k_bias[...], v + self.v_bias[...]
        if self.clip is not None:  # OLMo 1's clip_qkv
            q, k, v = (jnp.clip(t, -self.clip, self.clip) for t in (q, k, v))
        if self.qk_norm and not self.qk_norm_after_rope:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope is not None:
            pos = jnp.maximum(md.positions, 0)
            q, k = apply_rope(q, pos, self.rope), apply_rope(k, pos, self.rope)
        if self.qk_norm and self.qk_norm_after_rope:  # HunYuan
            q, k = self.q_norm(q), self.k_norm(k)
        if self.temperature is not None:  # Llama 4 / Ministral 3: queries scaled up with the position
            beta, n = self.temperature
            t = 1.0 + beta * jnp.log1p(jnp.floor(jnp.maximum(md.positions, 0).astype(jnp.float32) / n))
            q = q * t.astype(q.dtype)[:, None, None]
        k_pages, v_pages = kv
        interpret = attention.endswith("_interpret")

        def attend(q, k_pages, v_pages, md):  # per device under TP (shard_local)
            if attention == "xla":
                return paged_attention(q, k_pages, v_pages, md, scale=self.scale, window=self.window,
                                       softcap=self.softcap, kv_chunk_blocks=kv_chunk_blocks)
            if attention.startswith("pallas") and self.window is None and self.softcap is None:  # decode-only
                return pallas_decode_attention(q, k_pages, v_pages, md, scale=self.scale, interpret=interpret)
            return ragged_paged_attention(q, k_pages, v_pages, md, scale=self.scale, window=self.window,
                                          softcap=self.softcap,
                                          num_splits="auto" if attention.startswith("ragged_split") else None,
                                          interpret=interpret)

        o, k_pages, v_pages = shard_local(attend, q, k, v, k_pages, v_pages, md)
        out = self.proj("thk,hkd->td", o, self.o_proj, self.o_proj_scale)
        if self.has_o_bias:
            out = out + self.o_bias[...]
        return out, (k_pages, v_pages)


class MLP(nnx.Module):
    """down(act(gate(x)) * up(x)): SwiGLU (silu) or GeGLU (gelu_pytorch_tanh, Gemma). x is [T, D]
    (the flat token batch)."""

    def __init__(self, cfg: ModelConfig, dtype):
        D, I = cfg.hidden_size, cfg.intermediate_size
        self.proj = p = projection(cfg)
        self.gate_proj, self.gate_proj_scale = p.declare((D, I), ("embed", "mlp"), 1, dtype)
        self.up_proj, self.up_proj_scale = p.declare((D, I), ("embed", "mlp"), 1, dtype)
        self.down_proj, self.down_proj_scale = p.declare((I, D), ("mlp", "embed"), 1, dtype)
        if cfg.mlp_bias:
            self.gate_bias = declare((I,), ("mlp",), dtype)
            self.up_bias = declare((I,), ("mlp",), dtype)
            self.down_bias = declare((D,), ("embed",), dtype)
        self.has_bias = cfg.mlp_bias
        self.act = cfg.hidden_act

    def __call__(self, x):
        g, u = self.proj.many("td,di->ti", x, [(self.gate_proj, self.gate_proj_scale), (self.up_proj, self.up_proj_scale)])
        if self.has_bias:
            g, u = g + self.gate_bias[...], u + self.up_bias[...]
        y = self.proj("ti,id->td", activation(self.act)(g) * u, self.down_proj, self.down_proj_scale)
        return y + self.down_bias[...] if self.has_bias else y


class DenseMLP(nnx.Module):
    """down(act(up(x))), no gate (GPT-2, GPT-NeoX), with the optional biases of `mlp_bias`."""

    def __init__(self, cfg: ModelConfig, dtype):
        D, I = cfg.hidden_size, cfg.intermediate_size
        self.proj = p = projection(cfg)
        self.up_proj, self.up_proj_scale = p.declare((D, I), ("embed", "mlp"), 1, dtype)
        self.down_proj, self.down_proj_scale = p.declare((I, D), ("mlp", "embed"), 1, dtype)
        if cfg.mlp_bias:
            self.up_bias = declare((I,), ("mlp",), dtype)
            self.down_bias = declare((D,), ("embed",), dtype)
        self.has_bias = cfg.mlp_bias
        self.act = cfg.hidden_act

    def __call__(self, x):
        u = self.proj("td,di->ti", x, self.up_proj, self.up_proj_scale)
        if self.has_bias:
            u = u + self.up_bias[...]
        y = self.proj("ti,id->td", activation(self.act)(u), self.down_proj, self.down_proj_scale)
        return y + self.down_bias[...] if self.has_bias else y


def mlp(cfg: ModelConfig, dtype) -> MLP | DenseMLP:
    """The family's MLP: gated (`cfg.mlp_gated`) or dense."""
    return MLP(cfg, dtype) if cfg.mlp_gated else DenseMLP(cfg, dtype)


class HeadParams(NamedTuple):
    """The LM head's arrays when it has a bias (Phi): `w` as `LMHead` takes it and the bias [vocab].
    A pytree, so the programs take it where they take a bare weight."""
    w: object
    b: object


def head_of(cfg: ModelConfig, params: dict):
    """The LM head the programs take, from the flat params: the embedding when tied, else
    `lm_head`; with `HeadParams` when the head has a bias."""
    w = params["embed"] if cfg.tie_word_embeddings else params["lm_head"]
    return HeadParams(w, params["lm_head_bias"]) if cfg.lm_head_bias else w


def head_weight(head):
    """The head's weight matrix, whether `head` is a bare array or `HeadParams`."""
    return head.w if isinstance(head, HeadParams) else head


@dataclasses.dataclass(frozen=True)
class LMHead:
    """float32 logits [.., vocab] of hidden states h [.., embed] through the LM head weight `w`
    ([embed, vocab], or the embedding [vocab, embed] when `tied`); `softcap` (Gemma 2's final-logit
    soft-cap) maps z -> softcap * tanh(z / softcap); `fixed_tile` (batch-invariant mode) computes
    the product with `jvllm.ops.fixed_tile_matmul`, whose rows do not depend on how many there are;
    `divisor` (Granite's logits_scaling) divides the logits first, `scale` (Cohere's logit_scale)
    multiplies them. `w` may be `HeadParams`: its bias is added to the product first.
    The one place logits are computed: samplers, greedy, prompt logprobs, speculative verification
    and `sequence_logits` all call it. Frozen and hashable: a static argument of those programs."""
    tied: bool
    softcap: float | None = None
    fixed_tile: bool = False
    divisor: float | None = None
    scale: float | None = None

    @classmethod
    def of(cls, cfg: ModelConfig) -> "LMHead":
        return cls(cfg.tie_word_embeddings, cfg.final_logit_softcap, cfg.batch_invariant, cfg.logits_scaling,
                   cfg.logit_scale)

    def __call__(self, w, h):
        bias = None
        if isinstance(w, HeadParams):
            w, bias = w
        if self.fixed_tile:
            lead = h.shape[:-1]
            z = fixed_tile_matmul(h.reshape(-1, h.shape[-1]), w, w_transposed=self.tied, out_dtype=jnp.float32)
            z = z.reshape(*lead, z.shape[-1])
        else:
            z = jnp.dot(h, w.T if self.tied else w, preferred_element_type=jnp.float32)
        if bias is not None:
            z = z + bias.astype(jnp.float32)
        if self.divisor is not None:
            z = z / self.divisor
        if self.scale is not None:
            z = z * self.scale
        return z if self.softcap is None else self.softcap * jnp.tanh(z / self.softcap)
