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

Weight-only Fp8Channel has two backends, chosen once (`QuantConfig.matmul`): "xla" (the einsum
with the convert inside, which XLA fuses into its dot) and "pallas" (`jvllm.ops.pallas_matmul`, a
kernel that streams the 1-byte weights; q/k/v and gate/up each in one launch through `many`). The
pallas backend stores each weight output dims first, [out dims..., in dims...] (HF's [out, in]),
the layout its kernel reads fastest; `stored_shape` says so, `quantize` returns it, `dequantize`
and the XLA einsum take it (get_weights() of such an engine returns that layout). The kernel runs
where it is built for, decided at trace time from static facts: at most PALLAS_MAX_TOKENS
activation rows (decode steps), no tensor parallelism in the traced stage (a custom call under
GSPMD would gather the sharded weight), and a spec whose activation is [free dims..., contracted
dims in the weight's order] (every projection of jvllm.models.layers). Anything else takes the
einsum over the stored layout, which computes the same values up to the order of the float32 sums.

Fp8Block keeps a checkpoint's block-scaled values without requantizing them: one float32 scale
per (block of `block_in` rows of the last contracted dim, output channel), the checkpoint's
[out_block, in_block] scales repeated over each output block (the layout and the dequantizing dot
are `schemes.GroupScaled`'s). Fp8Group is the same layout for `quantization="fp8"` with
`quantization_group_size`, each group's scale searched over a few clipping ratios. Neither
quantizes activations nor runs on the pallas backend.
"""
from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from jvllm.quantization.schemes import ChannelScaled, GroupScaled, _param, num_contracted, split_spec

FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
PALLAS_MAX_TOKENS = 64  # activation rows up to which the pallas backend runs (decode steps); XLA above


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
    the float32 result. backend "pallas" (weight-only) stores the weight output dims first."""

    activations: bool = True
    backend: str = "xla"  # weight-only: "xla" | "pallas" (module docstring)
    name = "fp8"
    weight_dtype = FP8
    qmax = FP8_MAX

    def __post_init__(self):
        if self.backend not in ("xla", "pallas") or (self.backend == "pallas" and self.activations):
            raise ValueError(f"Fp8Channel: backend {self.backend!r} with activations={self.activations}; "
                             f"'pallas' is weight-only (activations=False), 'xla' takes both")

    @property
    def out_first(self) -> bool:
        return self.backend == "pallas"

    def stored_shape(self, shape, n_in):
        return (*shape[n_in:], *shape[:n_in]) if self.out_first else tuple(shape)

    def model_shape(self, stored, n_in):
        n_out = len(stored) - n_in
        return (*stored[n_out:], *stored[:n_out]) if self.out_first else tuple(stored)

    def declare(self, shape, axes, n_in, dtype):
        if not self.out_first:
            return super().declare(shape, axes, n_in, dtype)
        if not 0 < n_in < len(shape):
            raise ValueError(f"projection of shape {tuple(shape)}: n_in {n_in} must leave output dims")
        return (_param((*shape[n_in:], *shape[:n_in]), (*axes[n_in:], *axes[:n_in]), self.weight_dtype),
                _param(self.scale_shape(shape, n_in), axes[n_in:], jnp.float32, ones=True))

    def quantize(self, w, n_in):
        q, scale = super().quantize(w, n_in)
        return (jnp.transpose(q, _out_first(q.ndim, n_in)) if self.out_first else q), scale

    def dequantize(self, wq, scale, n_in, dtype=jnp.float32):
        if self.out_first:
            wq = jnp.transpose(wq, _out_first(wq.ndim, wq.ndim - n_in))  # back to [in..., out...]
        return super().dequantize(wq, scale, n_in, dtype)

    def _stored_spec(self, spec):
        if not self.out_first:
            return spec
        xs, ws, out = split_spec(spec)
        n = num_contracted(spec)
        return f"{xs},{ws[n:]}{ws[:n]}->{out}"

    def __call__(self, spec, x, w, scale):
        if not self.activations:
            if self.backend == "pallas":
                y = _pallas_projections(spec, x, [(w[...], scale[...])])
                if y is not None:
                    return y[0]
            y = jnp.einsum(self._stored_spec(spec), x, w[...].astype(x.dtype), preferred_element_type=jnp.float32)
            return (y * scale[...]).astype(x.dtype)
        xs, _, out = split_spec(spec)
        xq, sx = quantize_tokens(x, xs, out)
        y = jnp.einsum(spec, xq, w[...], preferred_element_type=jnp.float32)
        return (y * sx * scale[...]).astype(x.dtype)

    def many(self, spec, x, weights):
        if self.backend == "pallas":
            ys = _pallas_projections(spec, x, [(w[...], s[...]) for w, s in weights])
            if ys is not None:
                return ys
        return super().many(spec, x, weights)


def _out_first(ndim: int, n_in: int) -> tuple[int, ...]:
    """The transpose taking [in (n_in dims)..., out...] to [out..., in...]."""
    return (*range(n_in, ndim), *range(n_in))


def _pallas_projections(spec, x, weights):
    """The einsum `spec` of x and each stored [out..., in...] fp8 weight of `weights` ((w, scale)
    pairs, one output shape per weight) through one pallas launch, or None where it does not apply
    (the module docstring says where)."""
    from jvllm.ops import pallas_matmul
    from jvllm.ops.attention import tensor_parallel_size

    xs, ws, out = split_spec(spec)
    n_in = num_contracted(spec)
    free = xs[:len(xs) - n_in]
    if xs[len(free):] != ws[:n_in] or out != free + ws[n_in:] or tensor_parallel_size() != 1:
        return None
    M = math.prod(x.shape[:len(free)])
    if not 0 < M <= PALLAS_MAX_TOKENS:
        return None
    n_out = len(ws) - n_in
    K = math.prod(x.shape[len(free):])
    flat = [(w.reshape(math.prod(w.shape[:n_out]), K), s.reshape(-1)) for w, s in weights]
    ys = pallas_matmul.matmuls(x.reshape(M, K), [w for w, _ in flat], [s for _, s in flat])
    return [y.reshape(*x.shape[:len(free)], *w.shape[:n_out]) for y, (w, _) in zip(ys, weights)]


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
