"""The families' norms: RMSNorm (Llama's, Gemma's (1 + w), OLMo's float32 scaling) and LayerNorm
(GPT-2's, GPT-NeoX's, Cohere's bias-free one, OLMo 1's without weight or bias), each over one or
several trailing axes; `norm` picks a family's from its ModelConfig, once per module."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jvllm.config import ModelConfig
from jvllm.models.params import declare
from jvllm.ops.fixed_order import tree_mean


def _joint(x, n: int):
    """x with its last `n` axes flattened into one (n == 1: x itself)."""
    return x.reshape(*x.shape[:-n], -1) if n > 1 else x


class RMSNorm(nnx.Module):
    """unit_offset=False: transformers' LlamaRMSNorm (normalise in float32, cast back, scale by w in
    the input dtype). unit_offset=True: Gemma's (scale the float32 result by (1 + w), then cast;
    the stored weight is w, initialised to 0 in checkpoints). scale_f32=True: OLMo 2's (scale the
    float32 result by w, then cast). fixed_order (batch-invariant mode): the mean of squares summed
    in a fixed order whatever the number of rows (`jvllm.ops.fixed_order`). The weight has `shape`;
    the last `reduce_dims` axes are normalised jointly (2: OLMo 2's q/k norms over all heads)."""

    def __init__(self, shape: int | tuple[int, ...], eps: float, dtype, axes=("norm",), unit_offset: bool = False,
                 fixed_order: bool = False, scale_f32: bool = False, reduce_dims: int = 1):
        self.eps = eps
        self.unit_offset = unit_offset
        self.scale_f32 = scale_f32 or unit_offset
        self.mean = tree_mean if fixed_order else jnp.mean  # chosen once
        self.reduce_dims = reduce_dims
        self.weight = declare((shape,) if isinstance(shape, int) else tuple(shape), axes, dtype, ones=not unit_offset)

    def __call__(self, x):
        n = self.reduce_dims
        xf = x.astype(jnp.float32)
        flat = _joint(xf, n)
        y = (flat * jax.lax.rsqrt(self.mean(flat * flat, axis=-1, keepdims=True) + self.eps)).reshape(xf.shape)
        if self.scale_f32:
            w = self.weight[...].astype(jnp.float32)
            return (y * (1.0 + w if self.unit_offset else w)).astype(x.dtype)
        return self.weight[...].astype(x.dtype) * y.astype(x.dtype)


class LayerNorm(nnx.Module):
    """torch.nn.LayerNorm (GPT-2, GPT-NeoX; Cohere's has no bias): (x - mean) / sqrt(var + eps) * w
    (+ b), in float32, then cast; unit_offset=True scales by (1 + w) instead (Nemotron's
    LayerNorm1P; the stored weight is w); affine=False has neither weight nor bias (OLMo 1's
    non-parametric LayerNorm). The weight has `shape`; the last `reduce_dims` axes are
    normalised jointly (Command R+'s q/k norms: weights [heads, head_dim], each head over head_dim).
    fixed_order as RMSNorm's."""

    def __init__(self, shape: int | tuple[int, ...], eps: float, dtype, axes=("norm",), fixed_order: bool = False,
                 bias: bool = True, reduce_dims: int = 1, unit_offset: bool = False, affine: bool = True):
        self.eps = eps
        self.mean = tree_mean if fixed_order else jnp.mean  # chosen once
        self.reduce_dims = reduce_dims
        self.unit_offset = unit_offset
        self.affine = affine
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        if affine:
            self.weight = declare(shape, axes, dtype, ones=not unit_offset)
        self.has_bias = bias and affine
        if self.has_bias:
            self.bias = declare(shape, axes, dtype)

    def __call__(self, x):
        xf = x.astype(jnp.float32)
        flat = _joint(xf, self.reduce_dims)
        d = flat - self.mean(flat, axis=-1, keepdims=True)
        y = (d * jax.lax.rsqrt(self.mean(d * d, axis=-1, keepdims=True) + self.eps)).reshape(xf.shape)
        if not self.affine:
            return y.astype(x.dtype)
        w = self.weight[...].astype(jnp.float32)
        y = y * (1.0 + w if self.unit_offset else w)
        return (y + self.bias[...].astype(jnp.float32) if self.has_bias else y).astype(x.dtype)


def norm(cfg: ModelConfig, shape: int | tuple[int, ...], dtype, axes=("norm",),
         reduce_dims: int = 1) -> RMSNorm | LayerNorm:
    """The family's norm (`cfg.norm_kind`) with a weight of `shape`, normalising the last
    `reduce_dims` axes jointly."""
    if cfg.norm_kind == "layer":
        return LayerNorm(shape, cfg.rms_norm_eps, dtype, axes=axes, fixed_order=cfg.batch_invariant,
                         bias=cfg.norm_bias, reduce_dims=reduce_dims, unit_offset=cfg.norm_unit_offset,
                         affine=cfg.norm_affine)
    return RMSNorm(shape, cfg.rms_norm_eps, dtype, axes=axes, unit_offset=cfg.norm_unit_offset,
                   fixed_order=cfg.batch_invariant, scale_f32=cfg.norm_scale_f32, reduce_dims=reduce_dims)
