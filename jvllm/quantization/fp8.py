"""float8_e4m3fn weights: per-output-channel scales with fp8 activations (`Fp8Channel`, the
engine's `quantization="fp8"` and compressed-tensors FP8-dynamic checkpoints), and block / group
scales, weight-only (`Fp8Block`, HF FP8 `weight_scale_inv` checkpoints; `Fp8Group`,
`quantization_group_size`).

Fp8Channel is weight-only by default; W8A8 with dynamic per-token activation scales is opt-in
(`fp8_activations=True`, only where the device has fp8 matmuls: `fp8_matmul_supported`; decided
once by `apply_quantization`, which says why it is not the default). W8A8's dot reads fp8
operands on both sides, which is the pattern XLA's GPU GEMM rewriter turns into one cuBLASLt fp8
GEMM on Hopper (`__cublas$lt$matmul$f8`; benchmarks/probes/fp8_gemm_hlo.py checks
the optimized HLO of both formulations): x is scaled per token to the fp8 range (a max over the
contracted dims: under tensor parallelism over heads, o_proj's needs an all-reduce of T floats),
cast, multiplied as fp8 x fp8 with float32 accumulation, and both scales are applied to the
float32 result (exact: neither varies along the contracted dims). Hazard: float8_e4m3fn has no
infinity, a value past 448 converts to NaN, so every cast to fp8 is preceded by a clip.

Weight-only Fp8Channel is the "xla" backend (`QuantConfig.matmul`): the einsum with the convert
inside, which XLA fuses into its dot. The "pallas" backend is its subclass
`jvllm.quantization.fp8_pallas.Fp8Pallas` (its own weight layout and decode kernel).

Fp8Block keeps a checkpoint's block-scaled values without requantizing them: one float32 scale
per (block of `block_in` rows of the last contracted dim, output channel), the checkpoint's
[out_block, in_block] scales repeated over each output block (the layout and the dequantizing dot
are `schemes.GroupScaled`'s). Fp8Group is the same layout for `quantization="fp8"` with
`quantization_group_size`, each group's scale searched over a few clipping ratios. Neither
quantizes activations nor runs on the pallas backend.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jvllm.quantization.schemes import ChannelScaled, GroupScaled, split_spec

FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def quantize_tokens(x, xs: str, out: str):
    """(fp8 x, float32 per-token scale shaped to broadcast over the output) for an activation
    whose dims are `xs` and whose free dims lead the output `out`."""
    contract = tuple(i for i, c in enumerate(xs) if c not in out)
    free = "".join(c for c in xs if c in out)
    if out[:len(free)] != free:
        raise ValueError(f"projection {xs}->{out}: the activation's free dims must lead the output")
    xf = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(xf), axis=contract, keepdims=True)
    sx = jnp.maximum(amax, 1e-12) / FP8_MAX
    xq = jnp.clip(xf / sx, -FP8_MAX, FP8_MAX).astype(FP8)
    per_token = sx.reshape(tuple(x.shape[i] for i in range(x.ndim) if i not in contract) + (1,) * (len(out) - len(free)))
    return xq, per_token


def fp8_matmul_supported(device=None) -> bool:
    """Whether `device` (default: the first) multiplies fp8 x fp8 natively: NVIDIA GPUs of
    compute capability 8.9 and later (Ada, Hopper, Blackwell)."""
    import jax

    d = device or jax.devices()[0]
    try:
        return d.platform == "gpu" and float(getattr(d, "compute_capability", "0")) >= 8.9
    except (TypeError, ValueError):
        return False


@dataclasses.dataclass(frozen=True)
class Fp8Channel(ChannelScaled):
    """activations=True: W8A8 (per-token fp8 activations, an fp8 x fp8 dot); False: weight-only
    (the fp8 weight converted to the activation dtype inside the dot). Both apply the scales to
    the float32 result."""

    activations: bool = True
    name = "fp8"
    weight_dtype = FP8
    qmax = FP8_MAX

    def __call__(self, spec, x, w, scale):
        if not self.activations:
            y = jnp.einsum(spec, x, w[...].astype(x.dtype), preferred_element_type=jnp.float32)
            return (y * scale[...]).astype(x.dtype)
        xs, _, out = split_spec(spec)
        xq, sx = quantize_tokens(x, xs, out)
        y = jnp.einsum(spec, xq, w[...], preferred_element_type=jnp.float32)
        return (y * sx * scale[...]).astype(x.dtype)


@dataclasses.dataclass(frozen=True)
class Fp8Block(GroupScaled):
    """A checkpoint's block-scaled fp8 values (the module docstring); `group` is its block_in.
    A full-precision update is quantized with plain absmax per block."""

    name = "fp8_block"
    weight_dtype = FP8
    qmax = FP8_MAX


FP8_BLOCK = Fp8Block
GROUP_RATIOS = (1.0, 0.95, 0.9, 0.85, 0.8)  # Fp8Group's clipping ratios (GroupScaled.quantize)


@dataclasses.dataclass(frozen=True)
class Fp8Group(Fp8Block):
    """`quantization="fp8"` with group scales (`QuantConfig.group_size`): Fp8Block's layout, each
    group's scale searched over GROUP_RATIOS (e4m3's grid is coarse near its top, so a slightly
    smaller scale often puts a group's values on it with less error than absmax)."""

    name = "fp8_group"
    ratios = GROUP_RATIOS
