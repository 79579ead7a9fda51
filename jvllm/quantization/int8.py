"""int8 weights with per-output-channel scales, weight-only (for devices without fp8 matmuls).

Symmetric: wq = round(w / s) in [-127, 127], s = max|w| over the input dims / 127 (float32).
The dot converts wq to the activation dtype (XLA fuses the convert into the GEMM's operand read
on GPUs) and accumulates in float32; the per-output-channel scale is applied to the result, which
is exact because it does not vary along the contracted dims. Activations are not quantized.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jvllm.quantization.schemes import ChannelScaled


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
