"""The one interface the model's dense projections go through: declare the weight (and its scale),
multiply an activation by it, and quantize / dequantize a full-precision weight.

    proj = projection_for(cfg.quant)                       # once, in the module's __init__
    self.q_proj, self.q_proj_scale = proj.declare(shape, axes, n_in, dtype)
    q = proj("td,dhk->thk", x, self.q_proj, self.q_proj_scale)

A weight is stored in the model's layout `[in dims..., out dims...]` (the first `n_in` dims are
contracted), unless its format says otherwise (`stored_shape`; `quantize` returns and the call
takes the stored layout, `dequantize` returns the model's). Per-output-channel scales have the
shape and logical axes of the output dims, so the sharding rules shard a scale exactly as its
weight's output axis; `Dense` (no quantization) declares no scale (None). Group scales
(`GroupScaled`: fp8_block, and fp8 / int8 with `QuantConfig.group_size`) keep the weight's rank
and axes instead, the last contracted dim divided by the group. The einsum spec's weight operand
must list the contracted dims first.

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
    out_first = False  # whether the weight is stored output dims first (`stored_shape`)

    def declare(self, shape, axes, n_in: int, dtype) -> tuple[nnx.Param, nnx.Param | None]:
        raise NotImplementedError

    def scale_shape(self, shape, n_in: int) -> tuple[int, ...]:
        return tuple(shape[n_in:])

    def stored_shape(self, shape, n_in: int) -> tuple[int, ...]:
        """The declared (stored) shape of a projection whose model layout is `shape`: the same,
        unless a format keeps another layout (`Fp8Pallas`: output dims first)."""
        return tuple(shape)

    def model_shape(self, stored, n_in: int) -> tuple[int, ...]:
        """`stored_shape` inverted: the model-layout shape of a weight stored as `stored`."""
        return tuple(stored)

    def n_in_of(self, shape, scale_shape) -> int:
        """The number of contracted dims of a weight of `shape` whose scale has `scale_shape`."""
        return len(shape) - len(scale_shape)

    def __call__(self, spec: str, x, w, scale):
        raise NotImplementedError

    def many(self, spec: str, x, weights) -> list:
        """The projections of one input through several weights, `weights` a sequence of
        (w, scale) pairs (q/k/v, gate/up): a list in order. One call each here; a format may
        run them as one launch (batch-invariant mode's does)."""
        return [self(spec, x, w, scale) for w, scale in weights]

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


@dataclasses.dataclass(frozen=True)
class GroupScaled(Projection):
    """A quantized weight with one float32 scale per (group of `group` rows of the last contracted
    dim, output channel): w ~= wq * scale, the scale repeated over its group's rows. The scale keeps
    the weight's rank and logical axes (that dim divided by `group`), so it shards with its weight
    and no reshape crosses a sharded dim. Subclasses set the number format (`weight_dtype`, `qmax`,
    `_round`) and `ratios`: the clipping ratios tried per group at quantization (the scale is
    ratio * max|w| / qmax; the ratio with the least squared error over the group is kept;
    (1.0,) is plain absmax).

    The dot dequantizes inside the einsum: the weight reshaped to [..., last / group, group, out...],
    converted and multiplied by its scale in float32, reshaped back and cast to the activation dtype,
    then the einsum with float32 accumulation. Hazard: XLA may materialize the dequantized weight
    (one weight-sized temporary per projection, as on CPU) instead of fusing it into the GEMM; on
    GPUs that makes group scales much slower than per-channel ones (benchmarks/README.md)."""

    group: int = 128
    ratios = (1.0,)
    qmax = 1.0

    def __post_init__(self):
        if not isinstance(self.group, int) or isinstance(self.group, bool) or self.group < 1:
            raise ValueError(f"{type(self).__name__}: the group size must be a positive integer, got {self.group!r}")

    def _round(self, v):
        return v

    def scale_shape(self, shape, n_in):
        last = shape[n_in - 1]
        if last % self.group:
            raise ValueError(f"scales per {self.group} input rows need the projection's last contracted dim "
                             f"to be a multiple of {self.group}; weight shape {tuple(shape)} has {last} "
                             f"(a head_dim below the group size?)")
        return (*shape[:n_in - 1], last // self.group, *shape[n_in:])

    def n_in_of(self, shape, scale_shape):
        return 1 + max(i for i, (a, b) in enumerate(zip(shape, scale_shape)) if a != b)

    def declare(self, shape, axes, n_in, dtype):
        if not 0 < n_in < len(shape):
            raise ValueError(f"projection of shape {tuple(shape)}: n_in {n_in} must leave output dims")
        return (_param(shape, axes, self.weight_dtype),
                _param(self.scale_shape(shape, n_in), axes, jnp.float32, ones=True))

    def _groups(self, w, n_in):  # [..., last, out...] -> [..., last / group, group, out...]
        s = w.shape
        return w.reshape(*s[:n_in - 1], s[n_in - 1] // self.group, self.group, *s[n_in:])

    def dequantize(self, wq, scale, n_in, dtype=jnp.float32):
        g = self._groups(wq.astype(jnp.float32), n_in) * jnp.expand_dims(scale.astype(jnp.float32), n_in)
        return g.reshape(wq.shape).astype(dtype)

    def _quantize_with(self, g, scale, n_in):
        return jnp.clip(self._round(g / jnp.expand_dims(scale, n_in)), -self.qmax, self.qmax)

    def quantize(self, w, n_in):
        self.scale_shape(w.shape, n_in)  # the divisibility check
        g = self._groups(w.astype(jnp.float32), n_in)
        amax = jnp.maximum(jnp.max(jnp.abs(g), axis=n_in), 1e-12)
        scale = best = None
        for r in self.ratios:  # sequential, so the peak holds one candidate's error, not len(ratios)
            s = amax * (r / self.qmax)
            q = self._quantize_with(g, s, n_in).astype(self.weight_dtype).astype(jnp.float32)
            err = jnp.sum(jnp.square(q * jnp.expand_dims(s, n_in) - g), axis=n_in)
            if scale is None:
                scale, best = s, err
            else:
                scale, best = jnp.where(err < best, s, scale), jnp.minimum(err, best)
        q = self._quantize_with(g, scale, n_in).astype(self.weight_dtype)
        return q.reshape(w.shape), scale

    def __call__(self, spec, x, w, scale):
        wd = self.dequantize(w[...], scale[...], num_contracted(spec), x.dtype)
        return jnp.einsum(spec, x, wd, preferred_element_type=jnp.float32).astype(x.dtype)


def projection_for(quant: QuantConfig | None) -> Projection:
    """The projection format of a model config's `quant` (None: `DENSE`)."""
    if quant is None:
        return DENSE
    from jvllm.quantization.fp8 import FP8_BLOCK, Fp8Channel, Fp8Group
    from jvllm.quantization.int8 import Int8Channel, Int8Group

    if quant.method == "fp8":
        if quant.group_size is not None:
            return Fp8Group(quant.group_size)
        if quant.matmul == "pallas":
            from jvllm.quantization.fp8_pallas import Fp8Pallas

            return Fp8Pallas()
        return Fp8Channel(activations=quant.fp8_activations)
    if quant.method == "int8":
        return Int8Channel() if quant.group_size is None else Int8Group(quant.group_size)
    return FP8_BLOCK(quant.block_in)
