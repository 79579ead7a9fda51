"""A weight-streaming matmul for decode-sized steps: one Pallas kernel (Triton lowering on NVIDIA
GPUs; `interpret=True` runs the same kernel on CPU for tests), one input through a group of
weights in one launch (q/k/v, gate/up).

    matmuls(x [M, K], [w_1 [N_1, K], ...], [scale_1 [N_1] | None, ...]) -> [[M, N_1], ...]
    y_i = (x @ w_i.T) * scale_i

The weights are stored [N, K] (output rows, the contracted dim contiguous: HF's [out, in]), the
layout `jvllm.quantization.fp8_pallas.Fp8Pallas` keeps. w is x's dtype or float8_e4m3fn.
Products accumulate in float32, the scale multiplies the float32 result, the output is x's dtype:
the XLA path's arithmetic (`reference`) up to the order of the float32 sums. For fp8 weights with
a bfloat16 / float16 x, x is scaled per row by a power of two into float16 (exact: a bfloat16
value's 8 significant bits fit float16's 11, and |x / r| <= 256) and each fp8 tile is cast to
float16 in registers (exact: e4m3 fits float16); the row scale r multiplies the float32 result.
Why float16 rather than bfloat16: Triton's fp8 -> bfloat16 cast is the slower one on Hopper
(benchmarks/README.md, "fp8 B1: the decode kernel's layout").

Grid: (row tiles, column tiles of the group laid end to end, K splits). Each program walks its
K range in bk steps over [bn, bk] weight tiles (row-contiguous: wide coalesced loads) and stores
its float32 partial into the group's one [S, M, sum N_i] buffer; one XLA reduction sums the
splits, applies the scales and casts, and the outputs are its column slices. The split count S
(`tiles`) is the smallest power of two giving >= TARGET_PROGRAMS programs at one row tile, as far
as each split keeps >= MIN_SPLIT_STEPS K steps: a decode grid is otherwise sum N_i / bn programs,
each streaming all of K, too few to fill a GPU. Rows past M are neither loaded (masked) nor stored.

Tiles: bn and bk are the largest powers of two up to BN and BK dividing every N_i and K (BN and BK
themselves for real models); shapes no power of two >= 16 divides take `reference`.
Hazards (Triton): int32 offsets, so S * M * sum N_i and N_i * K stay below 2**31; float8_e4m3fn
casts need compute capability >= 8.9. benchmarks/probes/fp8_decode_probe.py measures tile choices.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
from jax import lax

from jvllm.ops.pallas_grouped_matmul import _pow2_divisor

FP8 = jnp.float8_e4m3fn
BN, BK = 128, 128  # column tile and K step at most (fp8_decode_probe.py's pick for 1-8 rows)
NUM_WARPS, NUM_STAGES = 4, 4
TARGET_PROGRAMS = 256  # about two waves of an H200's 132 SMs at one row tile
MIN_SPLIT_STEPS = 4  # K steps each split walks at least


@dataclasses.dataclass(frozen=True)
class Tiles:
    bm: int  # rows a program covers (16, 32 or 64)
    bn: int  # columns a program covers: the largest power of two <= BN dividing every N_i
    bk: int  # K step: the largest power of two <= BK dividing K
    splits: int  # S: contiguous K ranges, one program each


def row_tile(M: int) -> int:
    """The smallest of 16, 32, 64 holding M (64 above: M is at most a decode bucket)."""
    return 16 if M <= 16 else 32 if M <= 32 else 64


def tiles(M: int, K: int, Ns: Sequence[int]) -> Tiles | None:
    """The launch of x [M, K] through weights [N_i, K], or None where no power of two >= 16
    divides K or every N_i (Triton blocks; the caller computes `reference` instead)."""
    bk = _pow2_divisor(K, BK)
    bns = [_pow2_divisor(N, BN) for N in Ns]
    if bk is None or not Ns or None in bns:
        return None
    bm, bn = row_tile(M), min(bns)
    programs, steps, s = -(-M // bm) * sum(N // bn for N in Ns), K // bk, 1
    while programs * s < TARGET_PROGRAMS and steps % (2 * s) == 0 and steps // (2 * s) >= MIN_SPLIT_STEPS:
        s *= 2
    return Tiles(bm, bn, bk, s)


def reference(x: jax.Array, w: jax.Array, scale: jax.Array | None = None) -> jax.Array:
    """The XLA formulation for w [N, K]: w converted to x's dtype inside the dot, float32
    accumulation, the float32 result scaled, cast to x's dtype."""
    y = lax.dot_general(x, w.astype(x.dtype), (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return (y if scale is None else y * scale.astype(jnp.float32)).astype(x.dtype)


def _kernel(x_ref, *refs, M: int, t: Tiles, Ns: tuple, nk: int, f16: bool):
    """Program (row tile, column tile, split): refs are the g weights then the group's one partial
    output ([M, sum N_i] float32, weight i's columns at offset N_1 + ... + N_{i-1}; the split axis
    squeezed by the out BlockSpec)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    g = len(Ns)
    w_refs, o_ref = refs[:g], refs[g]
    bm, bn, bk = t.bm, t.bn, t.bk
    m0, j, s = pl.program_id(0) * bm, pl.program_id(1), pl.program_id(2)
    xmask = (m0 + lax.broadcasted_iota(jnp.int32, (bm, bk), 0)) < M

    def compute(w_ref, off, j_local):
        n0 = j_local * bn

        def body(kk, acc):
            k0 = pl.multiple_of((s * nk + kk) * bk, bk)
            a = plgpu.load(x_ref.at[pl.ds(m0, bm), pl.ds(k0, bk)], mask=xmask, other=0)
            b = w_ref[pl.ds(n0, bn), pl.ds(k0, bk)]
            b = b.astype(jnp.float16 if f16 else a.dtype)
            return acc + lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)

        acc = lax.fori_loop(0, nk, body, jnp.zeros((bm, bn), jnp.float32))
        rows = m0 + lax.broadcasted_iota(jnp.int32, (bm, bn), 0)
        plgpu.store(o_ref.at[pl.ds(m0, bm), pl.ds(off + n0, bn)], acc, mask=rows < M)

    c0 = off = 0
    for i, N in enumerate(Ns):
        c1 = c0 + N // bn
        if g == 1:
            compute(w_refs[i], 0, j)
        else:
            pl.when((j >= c0) & (j < c1))(functools.partial(compute, w_refs[i], off, j - c0))
        c0, off = c1, off + N


def _check(x, ws, scales):
    if x.ndim != 2 or not ws or len(scales) != len(ws):
        raise ValueError(f"pallas matmul: x must be [M, K] with one scale (or None) per weight; got x "
                         f"{x.shape}, {len(ws)} weights, {len(scales)} scales")
    for w, s in zip(ws, scales):
        if w.ndim != 2 or w.shape[1] != x.shape[1]:
            raise ValueError(f"pallas matmul: x must be [M, K] and each w [N, K]; got x {x.shape}, w {w.shape}")
        if w.dtype not in (x.dtype, FP8):
            raise ValueError(f"pallas matmul: w's dtype {w.dtype} must be x's ({x.dtype}) or float8_e4m3fn")
        if s is not None and s.shape != (w.shape[0],):
            raise ValueError(f"pallas matmul: scale has shape {s.shape}, expected ({w.shape[0]},)")


def _to_f16(x):
    """(x scaled per row by a power of two into float16, the float32 row scales [M, 1])."""
    xf = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(xf), axis=1, keepdims=True)
    r = jnp.exp2(jnp.ceil(jnp.log2(jnp.maximum(amax, 1e-30))) - 8)
    return (xf / r).astype(jnp.float16), r


def matmuls(x: jax.Array, ws: Sequence[jax.Array], scales: Sequence[jax.Array | None] | None = None, *,
            interpret: bool | None = None) -> list[jax.Array]:
    """x [M, K] through each w_i [N_i, K] (times scale_i [N_i], or None) in one launch -> a list of
    [M, N_i] in x's dtype (module docstring). Shapes the tiles do not cover take `reference`, one
    XLA dot each. `interpret` None = interpret unless the default backend is a GPU. ValueError on
    mismatched shapes or dtypes."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    ws = list(ws)
    scales = [None] * len(ws) if scales is None else list(scales)
    _check(x, ws, scales)
    M, K = x.shape
    Ns = tuple(w.shape[0] for w in ws)
    t = tiles(M, K, Ns) if M else None
    if t is None:
        return [reference(x, w, s) for w, s in zip(ws, scales)]
    f16 = x.dtype in (jnp.bfloat16, jnp.float16) and all(w.dtype == FP8 for w in ws)
    xin, rows = _to_f16(x) if f16 else (x, None)
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    S = t.splits
    kernel = functools.partial(_kernel, M=M, t=t, Ns=Ns, nk=K // (t.bk * S), f16=f16)
    parts = pl.pallas_call(
        kernel,
        grid=(-(-M // t.bm), sum(N // t.bn for N in Ns), S),
        in_specs=[pl.BlockSpec((M, K), lambda i, j, s: (0, 0))]
                 + [pl.BlockSpec(tuple(w.shape), lambda i, j, s: (0, 0)) for w in ws],
        out_specs=pl.BlockSpec((pl.squeezed, M, sum(Ns)), lambda i, j, s: (s, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((S, M, sum(Ns)), jnp.float32),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=NUM_STAGES),
        name=f"jvllm_matmul_nk_bm{t.bm}_bn{t.bn}_bk{t.bk}_s{S}{'_f16' if f16 else ''}{f'_g{len(ws)}' if len(ws) > 1 else ''}",
    )(xin, *ws)
    # one reduction for the group (the splits' sum, the row and channel scales, the cast), then
    # the outputs as column slices: one XLA kernel per group rather than one per weight
    y = jnp.sum(parts, axis=0)
    if rows is not None:
        y = y * rows
    if any(sc is not None for sc in scales):
        y = y * jnp.concatenate([jnp.ones((N,), jnp.float32) if sc is None else sc.astype(jnp.float32)
                                 for N, sc in zip(Ns, scales)])
    y = y.astype(x.dtype)
    offs = [sum(Ns[:i]) for i in range(len(Ns))]
    return [y[:, o:o + N] for o, N in zip(offs, Ns)]


def matmul(x: jax.Array, w: jax.Array, scale: jax.Array | None = None, *, interpret: bool | None = None) -> jax.Array:
    """(x [M, K] @ w [N, K].T) * scale [N]: `matmuls` of one weight."""
    return matmuls(x, [w], [scale], interpret=interpret)[0]
