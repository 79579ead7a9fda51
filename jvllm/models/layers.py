"""Building blocks shared by model families: parameter declaration, RMSNorm, rotary embeddings.

Every parameter is declared once, through `declare`, with its shape, dtype and *logical* axis names
(`("embed", "heads", "head_dim")`...). Nothing else in jvllm states a parameter's shape: the
converters check checkpoints against these declarations and `jvllm.sharding` maps the logical axes
onto a mesh. Params are created as zeros/ones; real values come from a converter or from
`jvllm.converters.random_device_params` (model construction runs under `nnx.eval_shape`, so it allocates
nothing).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jvllm.config import ModelConfig

# Logical axis names used by model code (jvllm.sharding maps them onto mesh axes).
LOGICAL_AXES = ("vocab", "embed", "heads", "kv_heads", "head_dim", "mlp", "norm",
                "expert", "moe_mlp", "router")  # mixture of experts (jvllm.models.moe)


def declare(shape: tuple[int, ...], axes: tuple[str, ...], dtype, *, ones: bool = False) -> nnx.Param:
    """A parameter of `shape` with one logical axis name per dimension (stored as `.axes`)."""
    if len(shape) != len(axes):
        raise ValueError(f"shape {shape} and logical axes {axes} differ in rank")
    for a in axes:
        if a not in LOGICAL_AXES:
            raise ValueError(f"unknown logical axis {a!r}; known: {LOGICAL_AXES}")
    init = jnp.ones if ones else jnp.zeros
    return nnx.Param(init(shape, dtype), axes=tuple(axes))


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype, axes=("norm",)):
        self.eps = eps
        self.weight = declare((dim,), axes, dtype, ones=True)

    def __call__(self, x):
        # transformers' LlamaRMSNorm: normalise in float32, cast back, then scale in the input dtype.
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return self.weight[...].astype(x.dtype) * y.astype(x.dtype)


# ----------------------------------------------------------------------------------- rotary
def rope_inv_freq(cfg: ModelConfig) -> tuple[np.ndarray, float]:
    """(inverse frequencies [head_dim/2] float64, attention scaling) for the config's rope type.

    default / linear / llama3 / yarn follow transformers' definitions exactly. `dynamic` (NTK) is
    position-independent here: for sequences within `max_position_embeddings` it equals the default
    frequencies, which is what transformers computes at those lengths.
    """
    d, base = cfg.head_dim, cfg.rope_theta
    p = cfg.rope_params
    inv = 1.0 / (base ** (np.arange(0, d, 2, dtype=np.float64) / d))
    rtype = cfg.rope_type
    scale = 1.0
    if rtype == "linear":
        inv = inv / float(p["factor"])
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


def apply_rope(x, positions, inv_freq, scale: float):
    """x [T, heads, head_dim]; positions [T] int; rotate-half layout (transformers' convention)."""
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, d/2]
    cos = (jnp.cos(freqs) * scale)[:, None, :]
    sin = (jnp.sin(freqs) * scale)[:, None, :]
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)
