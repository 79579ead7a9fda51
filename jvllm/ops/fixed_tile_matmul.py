"""A matmul whose every output element is reduced in one fixed order, whatever the number of rows:
the projections and the LM head of batch-invariant mode (`jvllm.worker.batch_invariant`). One
Pallas kernel (Triton lowering on NVIDIA GPUs; `interpret=True` runs the same kernel on CPU).

Contract: `fixed_tile_matmul(x [M, K], w [K, N]) -> [M, N]` (or w [N, K] with `w_transposed`, the
tied embedding as LM head), float32 accumulation, output in `out_dtype` (default x's dtype).
Output element (r, c) depends only on row r of x, column c of w and (K, N): never on M, nor on the
other rows. Why: XLA hands a dot to a library (cuBLAS, Eigen) that picks its algorithm, tiling and
split-K from the whole shape, M included, so the same row summed in a batch of 8 and in a batch of
512 may round differently.

How: the tiles (bm, bn, bk) and the split count S are chosen from (K, N) only (`tiles`), never
from M; M is padded to a multiple of bm. The grid is (M / bm, N / bn, S); program (i, j, s) walks
its K range [s K/S, (s+1) K/S) in bk steps, adding the float32 product of a [bm, bk] block of x
and a [bk, bn] block of w to its accumulator. S == 1: it stores the result in `out_dtype`. S > 1:
it stores a float32 partial into an [S, Mp, N] buffer, and the partials are added in Python as
p[0] + p[1] + ... + p[S-1] (written out: XLA does not reassociate float adds, where a reduce over
the split axis would leave the order to the emitter), then cast. Every element is thus the same
sequence of fixed-shape block products and adds, whatever M. When no power of two >= 16 divides
N, the last column tile's window is shifted left to end at N (columns of its neighbour are
computed again, never stored), so loads stay in bounds and each column is still computed by one
fixed tile; rows past M are not stored either.

Why split: at decode M is one row tile, so the grid is N / bn programs, each streaming all of K:
a [4096, 4096] weight is 32 programs on 132 SMs, far below HBM bandwidth. S is the smallest
power of two giving >= TARGET_PROGRAMS programs (about two waves), as far as each split keeps
>= MIN_SPLIT_STEPS bk steps; 1 for wide N (the LM head). The cost is the partial buffer,
S * Mp * N * 4 bytes, written by the kernel and read back by the sum: negligible at decode (rows
past M are neither stored nor read); for a prefill it is 8 S bytes of traffic per output element
against its 2 K flops (K / S >= 8 bk = 512 at bk = 64: one byte per >= 128 flops) and transient
memory that grows with M (S = 8, M = 512, N = 4096: 64 MiB). S cannot shrink with M (that would
break the contract), so the minimum split length, not M, bounds it.

Hazards: K must have a power-of-two divisor >= 16 and N must be >= 16 (Triton blocks), else a
ValueError naming the shape; rows are padded with zeros up to a multiple of bm (cheap: activations).
Triton addresses with int32 offsets: S * Mp * N (and Mp * K, K * N) must stay below 2**31.
On GPUs the per-element order is fixed by this walk and by the tensor-core instruction Triton
emits for a (bm, bn, bk) block, which the fixed tiles also fix; no atomics (each partial is
stored by one program), so the result is also run-to-run deterministic.
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
    splits: int  # S: K is cut into S contiguous ranges of K // S, each a multiple of bk


TARGET_PROGRAMS = 256  # about two waves of an H200's 132 SMs, at one row tile (decode)
MIN_SPLIT_STEPS = 8  # bk steps each split walks at least: keeps a split's pipeline full and
#                      its float32 partial (4 bytes per element per split) small next to its work


def tiles(K: int, N: int) -> Tiles:
    """The tiles and the K split count of a [K, N] weight (a function of K and N only: that is the
    invariance). S is the smallest power of two with ceil(N / bn) * S >= TARGET_PROGRAMS, as far
    as K // bk stays divisible by S with >= MIN_SPLIT_STEPS steps a split; 1 when the columns
    already give that many programs (wide N: the LM head). ValueError when K has no power-of-two
    divisor >= 16 or N < 16."""
    bk = _pow2_divisor(K, 64)
    if bk is None:
        raise ValueError(f"fixed_tile_matmul: K={K} has no power-of-two divisor >= 16 (a Triton block)")
    if N < 16:
        raise ValueError(f"fixed_tile_matmul: N={N} is below the smallest Triton block (16)")
    bn = _pow2_divisor(N, 128) or min(128, 1 << (N.bit_length() - 1))
    nk, col_tiles, s = K // bk, -(-N // bn), 1
    while col_tiles * s < TARGET_PROGRAMS and nk % (2 * s) == 0 and nk // (2 * s) >= MIN_SPLIT_STEPS:
        s *= 2
    return Tiles(bm=32, bn=bn, bk=bk, splits=s)


def _kernel(x_ref, w_ref, o_ref, *, t: Tiles, M: int, N: int, nk: int, transposed: bool):
    """One (row tile, column tile, K split) program: o_ref is the [Mp, N] output (S == 1) or this
    split's [Mp, N] float32 partial (the split axis squeezed by the out BlockSpec)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    m0 = pl.program_id(0) * t.bm
    n0 = pl.program_id(1) * t.bn
    kbase = pl.program_id(2) * (nk * t.bk)  # this split's first K index
    win = jnp.minimum(n0, N - t.bn)  # shifted last tile when bn does not divide N

    def body(kk, acc):
        k0 = pl.multiple_of(kbase + kk * t.bk, t.bk)
        a = x_ref[pl.ds(m0, t.bm), pl.ds(k0, t.bk)]
        if transposed:
            b = w_ref[pl.ds(win, t.bn), pl.ds(k0, t.bk)]
            return acc + lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        b = w_ref[pl.ds(k0, t.bk), pl.ds(win, t.bn)]
        return acc + jnp.dot(a, b, preferred_element_type=jnp.float32)

    acc = lax.fori_loop(0, nk, body, jnp.zeros((t.bm, t.bn), jnp.float32))
    cols = win + lax.broadcasted_iota(jnp.int32, (t.bm, t.bn), 1)
    rows = m0 + lax.broadcasted_iota(jnp.int32, (t.bm, t.bn), 0)
    plgpu.store(o_ref.at[pl.ds(m0, t.bm), pl.ds(win, t.bn)], acc.astype(o_ref.dtype),
                mask=(cols >= n0) & (rows < M))


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
    S = t.splits
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    Mp = -(-max(M, 1) // t.bm) * t.bm
    xp = x if Mp == M else jnp.pad(x, ((0, Mp - M), (0, 0)))
    kernel = functools.partial(_kernel, t=t, M=M, N=N, nk=K // (S * t.bk), transposed=w_transposed)
    if S == 1:  # the kernel stores the output itself
        out_spec = pl.BlockSpec((Mp, N), lambda i, j, s: (0, 0))
        out_shape = jax.ShapeDtypeStruct((Mp, N), out_dtype)
    else:  # one float32 partial [Mp, N] per split
        out_spec = pl.BlockSpec((pl.squeezed, Mp, N), lambda i, j, s: (s, 0, 0))
        out_shape = jax.ShapeDtypeStruct((S, Mp, N), jnp.float32)
    out = pl.pallas_call(
        kernel,
        grid=(Mp // t.bm, -(-N // t.bn), S),
        in_specs=[pl.BlockSpec((Mp, K), lambda i, j, s: (0, 0)),
                  pl.BlockSpec(tuple(w.shape), lambda i, j, s: (0, 0))],
        out_specs=out_spec,
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name=f"jvllm_fixed_tile_matmul_bm{t.bm}_bn{t.bn}_bk{t.bk}_s{S}{'_t' if w_transposed else ''}",
    )(xp, w)
    if S == 1:
        return out[:M]
    # The splits' partials summed left to right, written out term by term: one fixed order for
    # every element whatever M (XLA does not reassociate float adds; a jnp.sum over the split
    # axis would leave the order to the reduction emitter, which may pick it by shape).
    acc = out[0, :M]
    for s in range(1, S):
        acc = acc + out[s, :M]
    return acc.astype(out_dtype)
