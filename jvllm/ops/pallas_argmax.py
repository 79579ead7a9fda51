"""Row argmax as a Pallas kernel (Triton lowering on NVIDIA GPUs; `interpret=True` runs it on CPU
for tests): jnp.argmax(x, axis=-1) for x [R, V] float32, ties to the lowest index.

Why: XLA compiles the argmax as a variadic (value, index) reduction that reads the logits far
below the memory's rate (`probes/sampler_speed.py --parts` times both; benchmarks/README.md).
Here each program keeps an elementwise running (best, index) pair over C-wide chunks and
reduces it once at its end.

Grid (R, S) as in `jvllm.ops.pallas_radix` (`splits`): program (r, s) walks its range of the row
and stores its (best value, lowest index of it); one XLA reduction picks each row's best split
(the lowest index among equal values: splits cover ascending columns). Hazards: rows holding NaN
give an unspecified index (XLA returns the first NaN's); int32 offsets, so R * V < 2**31.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jvllm.ops.pallas_radix import C, NUM_STAGES, NUM_WARPS, splits


def _kernel(x_ref, v_ref, i_ref, *, V: int, chunk: int, steps: int):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    r, s = pl.program_id(0), pl.program_id(1)
    cols = lax.broadcasted_iota(jnp.int32, (1, chunk), 1)

    def body(i, carry):
        best, idx = carry
        v0 = pl.multiple_of((s * steps + i) * chunk, chunk)
        c = v0 + cols
        x = plgpu.load(x_ref.at[pl.ds(r, 1), pl.ds(v0, chunk)], mask=c < V, other=-jnp.inf)
        better = x > best  # strict: an earlier chunk keeps its tie
        return jnp.where(better, x, best), jnp.where(better, c, idx)

    init = (jnp.full((1, chunk), -jnp.inf, jnp.float32), jnp.full((1, chunk), V, jnp.int32))
    best, idx = lax.fori_loop(0, steps, body, init)
    m = jnp.max(best)
    first = jnp.min(jnp.where(best == m, idx, V))
    lane = lax.broadcasted_iota(jnp.int32, (1, 2), 1)
    v_ref[...] = jnp.where(lane == 0, m, -jnp.inf)
    i_ref[...] = jnp.where(lane == 0, first, V)


def argmax(x: jax.Array, *, chunk: int = C, num_warps: int = NUM_WARPS, num_stages: int = NUM_STAGES,
           interpret: bool | None = None) -> jax.Array:
    """[R] int32 argmax of x [R, V] float32 over its last axis (module docstring)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    if x.ndim != 2 or x.dtype != jnp.float32:
        raise ValueError(f"pallas argmax: x must be [R, V] float32, got {x.shape} {x.dtype}")
    R, V = x.shape
    if R * V >= 2 ** 31:
        raise ValueError(f"pallas argmax: R * V = {R * V} must stay below 2**31 (int32 offsets)")
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    S = splits(R, V, chunk)
    steps = -(-V // (chunk * S))
    vals, idx = pl.pallas_call(
        functools.partial(_kernel, V=V, chunk=chunk, steps=steps),
        grid=(R, S),
        in_specs=[pl.BlockSpec((R, V), lambda r, s: (0, 0))],
        out_specs=[pl.BlockSpec((1, 2), lambda r, s: (r * S + s, 0))] * 2,
        out_shape=[jax.ShapeDtypeStruct((R * S, 2), jnp.float32), jax.ShapeDtypeStruct((R * S, 2), jnp.int32)],
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name=f"jvllm_argmax_c{chunk}_s{S}",
    )(x)
    vals, idx = vals[:, 0].reshape(R, S), idx[:, 0].reshape(R, S)
    m = jnp.max(vals, axis=1, keepdims=True)
    first = jnp.min(jnp.where(vals == m, idx, V), axis=1)
    return jnp.where(first >= V, 0, first).astype(jnp.int32)  # a row of -inf: index 0, as jnp.argmax
