"""The one interface the model's dense projections go through: declare the weight (and its scale),
multiply an activation by it, and quantize / dequantize a full-precision weight.

    proj = projection_for(cfg.quant)                       # once, in the module's __init__
    self.q_proj, self.q_proj_scale = proj.declare(shape, axes, n_in, dtype)
    q = proj("td,dhk->thk", x, self.q_proj, self.q_proj_scale)

A weight is stored in the model's layout `[in dims..., out dims...]` (the first `n_in` dims are
contracted). Per-output-channel scales have the shape and logical axes of the output dims, so
the sharding rules shard a scale exactly as its weight's output axis; `Dense` (no quantization)
declares no scale (None). The einsum spec's weight operand must list the contracted dims first.

Why not qwix (google's JAX quantization library, tried at 0.1.8): its model-level API
(`quantize_model` + providers) intercepts jnp/lax calls at trace time by module-path rules, while
jvllm declares every parameter once with logical axes, streams checkpoints into those names and
shardings and decides each variant at construction; its `QArray` (a pytree of qvalue + keepdims
scale) would have to be threaded through the converters, the sharding rules and
`update_weights`. The arithmetic needed here is a few lines per format, and keeping it here keeps
the exact HLO pattern (an fp8 x fp8 dot, scales after it) that XLA rewrites into cuBLASLt fp8
GEMMs under our control. tests/test_quant_roundtrip.py checks our quantizer against qwix's.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax import nnx

from jvllm.quantization.config import QuantConfig


def split_spec(spec: str) -> tuple[str, str, str]:
    """"td,dhk->thk" -> ("td", "dhk", "thk"); ValueError for any other form."""
    try:
        ins, out = spec.split("->")
        xs, ws = ins.split(",")
    except ValueError:
        raise ValueError(f"projection spec {spec!r} must be 'x,w->out'") from None
    return xs, ws, out


def num_contracted(spec: str) -> int:
    """How many leading dims of the weight operand the spec contracts (checked to be leading)."""
    xs, ws, out = split_spec(spec)
    n = sum(c not in out for c in ws)
    if any(c in out for c in ws[:n]) or any(c not in out for c in ws[n:]):
        raise ValueError(f"projection spec {spec!r}: the weight's contracted dims must come first")
    return n


def _param(shape, axes, dtype, ones=False):
    from jvllm.models.layers import declare

    return declare(tuple(shape), tuple(axes), dtype, ones=ones)


@dataclasses.dataclass(frozen=True)
class Projection:
    """Base of the projection formats (frozen and hashable: a static module attribute)."""

    name = "base"
    weight_dtype = None  # None: the model dtype

    def declare(self, shape, axes, n_in: int, dtype) -> tuple[nnx.Param, nnx.Param | None]:
        raise NotImplementedError

    def scale_shape(self, shape, n_in: int) -> tuple[int, ...]:
        return tuple(shape[n_in:])

    def n_in_of(self, shape, scale_shape) -> int:
        """The number of contracted dims of a weight of `shape` whose scale has `scale_shape`."""
        return len(shape) - len(scale_shape)

    def __call__(self, spec: str, x, w, scale):
        raise NotImplementedError

    def quantize(self, w, n_in: int):
        """(quantized weight, float32 scale) of the full-precision weight `w` (jittable)."""
        raise NotImplementedError

    def dequantize(self, wq, scale, n_in: int, dtype=jnp.float32):
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class Dense(Projection):
    """No quantization: the weight in the model dtype, a plain einsum."""

    name = "none"

    def declare(self, shape, axes, n_in, dtype):
        return _param(shape, axes, dtype), None

    def __call__(self, spec, x, w, scale):
        return jnp.einsum(spec, x, w[...])


DENSE = Dense()


@dataclasses.dataclass(frozen=True)
class ChannelScaled(Projection):
    """A quantized weight with one float32 scale per output channel: w ~= wq * scale."""

    qmax = 1.0

    def declare(self, shape, axes, n_in, dtype):
        if not 0 < n_in < len(shape):
            raise ValueError(f"projection of shape {tuple(shape)}: n_in {n_in} must leave output dims")
        return (_param(shape, axes, self.weight_dtype),
                _param(self.scale_shape(shape, n_in), axes[n_in:], jnp.float32, ones=True))

    def _round(self, v):
        return v

    def quantize(self, w, n_in):
        wf = w.astype(jnp.float32)
        amax = jnp.max(jnp.abs(wf), axis=tuple(range(n_in)))
        scale = jnp.maximum(amax, 1e-12) / self.qmax
        q = jnp.clip(self._round(wf / scale), -self.qmax, self.qmax)
        return q.astype(self.weight_dtype), scale

    def dequantize(self, wq, scale, n_in, dtype=jnp.float32):
        return (wq.astype(jnp.float32) * scale.astype(jnp.float32)).astype(dtype)


def projection_for(quant: QuantConfig | None) -> Projection:
    """The projection format of a model config's `quant` (None: `DENSE`)."""
    if quant is None:
        return DENSE
    from jvllm.quantization.fp8 import FP8_BLOCK, Fp8Channel
    from jvllm.quantization.int8 import Int8Channel

    if quant.method == "fp8":
        return Fp8Channel(activations=quant.fp8_activations, backend=quant.matmul)
    if quant.method == "int8":
        return Int8Channel()
    return FP8_BLOCK(quant.block_in)
