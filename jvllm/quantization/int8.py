"""int8 weights with per-output-channel scales (`Int8Channel`) or one scale per group of input
rows per output channel (`Int8Group`, opt-in by `quantization_group_size`: config.py), weight-only.

Symmetric: wq = round(w / s) in [-127, 127], s = max|w| over the input dims (or the group) / 127.
The dot converts wq to the activation dtype (XLA fuses the convert into the GEMM's operand read
on GPUs) and accumulates in float32; a per-output-channel scale is applied to the result, which
is exact because it does not vary along the contracted dims (group scales dequantize inside the
dot instead: `schemes.GroupScaled`). Activations are not quantized.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jvllm.quantization.schemes import ChannelScaled, GroupScaled


@dataclasses.dataclass(frozen=True)
class Int8Channel(ChannelScaled):
    name = "int8"
    weight_dtype = jnp.int8
    qmax = 127.0

    def _round(self, v):
        return jnp.round(v)

    def __call__(self, spec, x, w, scale):
        y = jnp.einsum(spec, x, w[...].astype(x.dtype), preferred_element_type=jnp.float32)
        return (y * scale[...]).astype(x.dtype)


@dataclasses.dataclass(frozen=True)
class Int8Group(GroupScaled):
    """`quantization="int8"` with group scales (`QuantConfig.group_size`): one absmax scale per
    (`group` input rows, output channel), dequantized inside the dot (`GroupScaled`)."""

    name = "int8_group"
    weight_dtype = jnp.int8
    qmax = 127.0

    def _round(self, v):
        return jnp.round(v)
