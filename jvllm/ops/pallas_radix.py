"""One pass of the sampler's threshold search (`jvllm.sampling._radix_search`) as a Pallas kernel
(Triton lowering on NVIDIA GPUs; `interpret=True` runs the same kernel on CPU for tests).

    pass_sums(k [R, V] int32, w [R, V] float32, cands [R, n] int32) -> [R, n] float32
    sums[r, j] = sum of w[r, v] over the v with k[r, v] >= cands[r, j]

k is the signed form of the sampler's order-preserving key (`signed_key`); w >= 0. XLA compiles
the same pass as one variadic reduction of n outputs; here each program keeps n elementwise
float32 accumulators over C-wide column chunks and reduces them once at its end. Unlike the
one-program-per-row kernel measured and dropped before (benchmarks/README.md, "The sampler's
truncation search as a Pallas kernel"), each pass is its own launch over R x S programs reading
the keys and weights XLA materialized once, so no program recomputes them and a wave holds
enough loads in flight.

Grid (R, S): program (r, s) walks S's s-th contiguous range of the row in C-wide chunks (the
tail masked: columns >= V load w = 0) and stores its n partial sums; one XLA reduction adds the S
partials. S (`splits`) is the smallest power of two giving >= TARGET_PROGRAMS programs, as far as
each program keeps >= MIN_STEPS chunks: one program per row would leave too few loads in flight
to stream [R, V] at the memory's rate. The partials' order depends on S, so on R: not for
batch-invariant mode (which keeps XLA's fixed-order sums).

Hazards (Triton): int32 offsets, so R * V < 2**31; register pressure grows with n * C / (32 *
NUM_WARPS) accumulators per thread (15 * 512 / 128 = 60 at the defaults).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

C = 512  # columns per chunk (one load of k and of w per chunk)
NUM_WARPS, NUM_STAGES = 4, 4
TARGET_PROGRAMS = 1024  # about eight programs per SM on an H100 / H200 (132 SMs)
MIN_STEPS = 8  # chunks each program walks at least


def splits(R: int, V: int, chunk: int = C) -> int:
    """S: the smallest power of two with R * S >= TARGET_PROGRAMS while each of the S ranges
    keeps >= MIN_STEPS chunks (1 at least)."""
    chunks, s = -(-V // chunk), 1
    while R * s < TARGET_PROGRAMS and chunks // (2 * s) >= MIN_STEPS:
        s *= 2
    return s


def signed_key(u: jax.Array) -> jax.Array:
    """The sampler's uint32 key (unsigned order = float order) as int32 with the same order
    under signed comparison (the top bit flipped): Triton compares int32 natively."""
    return lax.bitcast_convert_type(u ^ jnp.uint32(0x80000000), jnp.int32)


def reference(k: jax.Array, w: jax.Array, cands: jax.Array) -> jax.Array:
    """The XLA formulation of `pass_sums`."""
    return jnp.stack([jnp.sum(jnp.where(k >= cands[:, j:j + 1], w, 0.0), axis=-1)
                      for j in range(cands.shape[1])], axis=-1)


def _kernel(c_ref, k_ref, w_ref, o_ref, *, V: int, n: int, npad: int, chunk: int, steps: int):
    """Program (r, s): o_ref is its [1, npad] row of the [R * S, npad] partials."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    r, s = pl.program_id(0), pl.program_id(1)
    crow = c_ref[pl.ds(r, 1), :]  # [1, npad] int32 candidates (padding columns unused)
    lane = lax.broadcasted_iota(jnp.int32, (1, npad), 1)
    cands = [jnp.sum(jnp.where(lane == j, crow, 0)) for j in range(n)]
    cols = lax.broadcasted_iota(jnp.int32, (1, chunk), 1)

    def body(i, accs):
        v0 = pl.multiple_of((s * steps + i) * chunk, chunk)
        m = (v0 + cols) < V
        kk = plgpu.load(k_ref.at[pl.ds(r, 1), pl.ds(v0, chunk)], mask=m, other=0)
        ww = plgpu.load(w_ref.at[pl.ds(r, 1), pl.ds(v0, chunk)], mask=m, other=0.0)
        return tuple(a + jnp.where(kk >= c, ww, 0.0) for a, c in zip(accs, cands))

    accs = lax.fori_loop(0, steps, body, tuple(jnp.zeros((1, chunk), jnp.float32) for _ in range(n)))
    out = jnp.zeros((1, npad), jnp.float32)
    for j, a in enumerate(accs):
        out = jnp.where(lane == j, jnp.sum(a), out)
    o_ref[...] = out


def pass_sums(k: jax.Array, w: jax.Array, cands: jax.Array, *, chunk: int = C, num_warps: int = NUM_WARPS,
              num_stages: int = NUM_STAGES, interpret: bool | None = None) -> jax.Array:
    """[R, n] float32 sums (module docstring). `interpret` None = interpret unless the default
    backend is a GPU. ValueError on shapes or dtypes the kernel does not take."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    if k.ndim != 2 or w.shape != k.shape or cands.ndim != 2 or cands.shape[0] != k.shape[0]:
        raise ValueError(f"pallas radix pass: k and w must be [R, V] and cands [R, n]; got k {k.shape}, "
                         f"w {w.shape}, cands {cands.shape}")
    if k.dtype != jnp.int32 or w.dtype != jnp.float32 or cands.dtype != jnp.int32:
        raise ValueError(f"pallas radix pass: k and cands must be int32 and w float32; got {k.dtype}, "
                         f"{cands.dtype}, {w.dtype}")
    if chunk & (chunk - 1):
        raise ValueError(f"pallas radix pass: chunk must be a power of two, got {chunk}")
    R, V = k.shape
    n = cands.shape[1]
    if R * V >= 2 ** 31:
        raise ValueError(f"pallas radix pass: R * V = {R * V} must stay below 2**31 (int32 offsets)")
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    npad = max(2, 1 << (n - 1).bit_length())
    S = splits(R, V, chunk)
    steps = -(-V // (chunk * S))
    cpad = jnp.pad(cands, ((0, 0), (0, npad - n)))
    parts = pl.pallas_call(
        functools.partial(_kernel, V=V, n=n, npad=npad, chunk=chunk, steps=steps),
        grid=(R, S),
        in_specs=[pl.BlockSpec((R, npad), lambda r, s: (0, 0)),
                  pl.BlockSpec((R, V), lambda r, s: (0, 0)),
                  pl.BlockSpec((R, V), lambda r, s: (0, 0))],
        out_specs=pl.BlockSpec((1, npad), lambda r, s: (r * S + s, 0)),
        out_shape=jax.ShapeDtypeStruct((R * S, npad), jnp.float32),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name=f"jvllm_radix_pass_n{n}_c{chunk}_s{S}",
    )(cpad, k, w)
    return jnp.sum(parts.reshape(R, S, npad), axis=1)[:, :n]
