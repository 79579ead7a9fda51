"""Weight-only fp8 on the "pallas" backend (`QuantConfig.matmul == "pallas"`, the engine option
`fp8_matmul_backend`): `Fp8Channel`'s values and per-output-channel scales, stored output dims
first, [out dims..., in dims...] (HF's [out, in]), the layout `jvllm.ops.pallas_matmul` reads
fastest. `stored_shape` / `model_shape` convert between that and the model layout; `quantize`
returns the stored layout and `dequantize` the model's, so `get_weights()` of such an engine
gives the stored layout and `update_weights` requantizes full-precision weights into it.

The kernel runs where it is built for, decided at trace time from static facts: at most
PALLAS_MAX_TOKENS activation rows (decode steps), no tensor parallelism in the traced stage (a
custom call under GSPMD would gather the sharded weight), and a spec whose activation is [free
dims..., contracted dims in the weight's order] (every projection of jvllm.models.layers); `many`
runs a group (q/k/v, gate/up) as one launch. Anything else takes the einsum over the stored
layout, which computes the same values up to the order of the float32 sums.
"""
from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from jvllm.quantization.fp8 import Fp8Channel
from jvllm.quantization.schemes import _param, num_contracted, split_spec

PALLAS_MAX_TOKENS = 64  # activation rows up to which the kernel runs (decode steps); XLA above


def _out_first(ndim: int, n_in: int) -> tuple[int, ...]:
    """The transpose taking [in (n_in dims)..., out...] to [out..., in...]."""
    return (*range(n_in, ndim), *range(n_in))


@dataclasses.dataclass(frozen=True)
class Fp8Pallas(Fp8Channel):
    """Weight-only Fp8Channel stored output dims first (the module docstring)."""

    activations: bool = False
    out_first = True

    def __post_init__(self):
        if self.activations:
            raise ValueError("Fp8Pallas: the pallas backend is weight-only (activations=False); W8A8 runs on "
                             "Fp8Channel (the xla backend)")

    def stored_shape(self, shape, n_in):
        return (*shape[n_in:], *shape[:n_in])

    def model_shape(self, stored, n_in):
        n_out = len(stored) - n_in
        return (*stored[n_out:], *stored[:n_out])

    def declare(self, shape, axes, n_in, dtype):
        if not 0 < n_in < len(shape):
            raise ValueError(f"projection of shape {tuple(shape)}: n_in {n_in} must leave output dims")
        return (_param(self.stored_shape(shape, n_in), (*axes[n_in:], *axes[:n_in]), self.weight_dtype),
                _param(self.scale_shape(shape, n_in), axes[n_in:], jnp.float32, ones=True))

    def quantize(self, w, n_in):
        q, scale = super().quantize(w, n_in)
        return jnp.transpose(q, _out_first(q.ndim, n_in)), scale

    def dequantize(self, wq, scale, n_in, dtype=jnp.float32):
        wq = jnp.transpose(wq, _out_first(wq.ndim, wq.ndim - n_in))  # back to [in..., out...]
        return super().dequantize(wq, scale, n_in, dtype)

    def __call__(self, spec, x, w, scale):
        ys = _kernel_projections(spec, x, [(w[...], scale[...])])
        if ys is not None:
            return ys[0]
        xs, ws, out = split_spec(spec)
        n = num_contracted(spec)
        return super().__call__(f"{xs},{ws[n:]}{ws[:n]}->{out}", x, w, scale)  # the einsum, stored layout

    def many(self, spec, x, weights):
        ys = _kernel_projections(spec, x, [(w[...], s[...]) for w, s in weights])
        return ys if ys is not None else super().many(spec, x, weights)


def _kernel_projections(spec, x, weights):
    """The einsum `spec` of x and each stored [out..., in...] fp8 weight of `weights` ((w, scale)
    pairs) through one pallas launch, or None where it does not apply (the module docstring)."""
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
