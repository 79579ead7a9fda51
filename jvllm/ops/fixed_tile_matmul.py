"""A matmul whose every output element is reduced in one fixed order, whatever the number of rows:
the projections and the LM head of batch-invariant mode (`jvllm.worker.batch_invariant`). One
Pallas kernel (Triton lowering on NVIDIA GPUs; `interpret=True` runs the same kernel on CPU).

Contract: `fixed_tile_matmul(x [M, K], w [K, N]) -> [M, N]` (or w [N, K] with `w_transposed`, the
tied embedding as LM head), float32 accumulation, output in `out_dtype` (default x's dtype).
Output element (r, c) depends only on row r of x, column c of w and (K, N): never on M, nor on the
other rows. Why: XLA hands a dot to a library (cuBLAS, Eigen) that picks its algorithm, tiling and
split-K from the whole shape, M included, so the same row summed in a batch of 8 and in a batch of
512 may round differently.

How: the tiles (bm, bn, bk) are chosen from (K, N) only (`tiles`), never from M; M is padded to a
multiple of bm. The grid is (M / bm, N / bn); each program walks K from 0 in bk steps, adding the
float32 product of a [bm, bk] block of x and a [bk, bn] block of w to its accumulator: every
element is the same sequence of fixed-shape block products, with no split-K and no second
reduction. When no power of two >= 16 divides N, the last column tile's window is shifted left to
end at N (columns of its neighbour are computed again, never stored), so loads stay in bounds and
each column is still computed by one fixed tile.

Hazards: K must have a power-of-two divisor >= 16 and N must be >= 16 (Triton blocks), else a
ValueError naming the shape; rows are padded with zeros up to a multiple of bm (cheap: activations).
On GPUs the per-element order is fixed by this walk and by the tensor-core instruction Triton
emits for a (bm, bn, bk) block, which the fixed tiles also fix.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from jvllm.ops.pallas_grouped_matmul import _pow2_divisor


@dataclasses.dataclass(frozen=True)
class Tiles:
    bm: int
    bn: int
    bk: int


def tiles(K: int, N: int) -> Tiles:
    """The tiles of a [K, N] weight (a function of K and N only: that is the invariance).
    ValueError when K has no power-of-two divisor >= 16 or N < 16."""
    bk = _pow2_divisor(K, 64)
    if bk is None:
        raise ValueError(f"fixed_tile_matmul: K={K} has no power-of-two divisor >= 16 (a Triton block)")
    if N < 16:
        raise ValueError(f"fixed_tile_matmul: N={N} is below the smallest Triton block (16)")
    bn = _pow2_divisor(N, 128) or min(128, 1 << (N.bit_length() - 1))
    return Tiles(bm=32, bn=bn, bk=bk)


def _kernel(x_ref, w_ref, o_ref, *, t: Tiles, N: int, nk: int, transposed: bool):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    m0 = pl.program_id(0) * t.bm
    n0 = pl.program_id(1) * t.bn
    win = jnp.minimum(n0, N - t.bn)  # shifted last tile when bn does not divide N

    def body(kk, acc):
        k0 = pl.multiple_of(kk * t.bk, t.bk)
        a = x_ref[pl.ds(m0, t.bm), pl.ds(k0, t.bk)]
        if transposed:
            b = w_ref[pl.ds(win, t.bn), pl.ds(k0, t.bk)]
            return acc + lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        b = w_ref[pl.ds(k0, t.bk), pl.ds(win, t.bn)]
        return acc + jnp.dot(a, b, preferred_element_type=jnp.float32)

    acc = lax.fori_loop(0, nk, body, jnp.zeros((t.bm, t.bn), jnp.float32))
    cols = win + lax.broadcasted_iota(jnp.int32, (t.bm, t.bn), 1)
    plgpu.store(o_ref.at[pl.ds(m0, t.bm), pl.ds(win, t.bn)], acc.astype(o_ref.dtype), mask=cols >= n0)


def fixed_tile_matmul(x: jax.Array, w: jax.Array, *, w_transposed: bool = False, out_dtype=None,
                      num_warps: int = 4, num_stages: int = 3, interpret: bool | None = None) -> jax.Array:
    """x [M, K] @ w [K, N] (w [N, K] when `w_transposed`) -> [M, N] in `out_dtype` (None: x's
    dtype); see the module docstring for the invariance contract. `interpret` None = interpret
    unless the default backend is a GPU. ValueError on mismatched shapes."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    if x.ndim != 2 or w.ndim != 2:
        raise ValueError(f"fixed_tile_matmul: x and w must be 2-D, got {x.shape} and {w.shape}")
    M, K = x.shape
    N, Kw = w.shape if w_transposed else w.shape[::-1]
    if Kw != K:
        raise ValueError(f"fixed_tile_matmul: x has K={K}, w {'[N, K]' if w_transposed else '[K, N]'} "
                         f"{tuple(w.shape)} has K={Kw}")
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    t = tiles(K, N)
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    Mp = -(-max(M, 1) // t.bm) * t.bm
    xp = x if Mp == M else jnp.pad(x, ((0, Mp - M), (0, 0)))
    kernel = functools.partial(_kernel, t=t, N=N, nk=K // t.bk, transposed=w_transposed)
    out = pl.pallas_call(
        kernel,
        grid=(Mp // t.bm, -(-N // t.bn)),
        in_specs=[pl.BlockSpec((Mp, K), lambda i, j: (0, 0)),
                  pl.BlockSpec(tuple(w.shape), lambda i, j: (0, 0))],
        out_specs=pl.BlockSpec((Mp, N), lambda i, j: (0, 0)),
        out_shape=jax.ShapeDtypeStruct((Mp, N), out_dtype),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name=f"jvllm_fixed_tile_matmul_bm{t.bm}_bn{t.bn}_bk{t.bk}{'_t' if w_transposed else ''}",
    )(xp, w)
    return out[:M]
