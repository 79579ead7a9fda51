"""Matmuls whose every output element is reduced in one fixed order, whatever the number of rows:
the projections and the LM head of batch-invariant mode (`jvllm.worker.batch_invariant`). One
Pallas kernel (Triton lowering on NVIDIA GPUs; `interpret=True` runs the same kernel on CPU).

Contract: `fixed_tile_matmuls(x [M, K], [w_1 [K, N_1], ..., w_g [K, N_g]]) -> [[M, N_1], ...]`
(one input through a group of weights in one launch: q/k/v, gate/up), and `fixed_tile_matmul(x,
w)` for one weight (or w [N, K] with `w_transposed`, the tied embedding as LM head); float32
accumulation, outputs in `out_dtype` (default x's dtype). Output element (r, c) of weight i depends
only on row r of x, column c of w_i and the group's shapes (K, N_1..N_g): never on M, nor on the
other rows. Why: XLA hands a dot to a library (cuBLAS, Eigen) that picks its algorithm, tiling and
split-K from the whole shape, M included, so the same row summed in a batch of 8 and in a batch of
512 may round differently.

How: the tiles (bm, bn, bk) and the split count S come from the group's shapes only (`tiles`),
never from M. K is cut into S contiguous ranges; each range is walked in bk steps, adding the
float32 product of a [bm, bk] block of x and a [bk, bn] block of w to an accumulator started at
zero, and the S range sums are added left to right: p_0 + p_1 + ... + p_{S-1}, then cast once.
Two launches compute exactly that sequence of float operations, chosen from M at trace time
(`launch_splits`):
- split (few row tiles: decode): grid (row tiles, column tiles, S); program (i, j, s) stores its
  range's float32 partial into an [S, M, N] buffer and the partials are added in Python, written
  out term by term (XLA does not reassociate float adds, where a reduce over the split axis would
  leave the order to the emitter). At decode the grid is otherwise N / bn programs, each
  streaming all of K: a [4096, 4096] weight is 32 programs on 132 SMs, far below HBM bandwidth.
- walk (enough row x column tiles to fill the GPU: prefill): grid (row tiles, column tiles);
  each program walks the S ranges itself, adding each range's sum to a running total in
  registers, and stores the result: no partial buffer (at S = 8 that buffer would move 64 bytes
  per output element).
The group's column tiles are laid end to end (weight 1's, then weight 2's, ...); a program
branches on its column index to its weight. When no power of two >= 16 divides N_i, its last
column tile's window is shifted left to end at N_i (columns of its neighbour are computed again,
never stored). Rows past M are neither loaded (masked loads, zeros) nor stored: no padding. A walk
launch over more than ROW_TILE rows takes the first of WALK_LAUNCHES (program shapes for prefill:
rows, column cap, warps, stages) whose programs still reach WALK_MIN_PROGRAMS, else the split
launch's shape (`launch_shape`): the shape decides which program computes an element, not the order
of its sum. S always comes from the default column tile (`tiles`), never from the launch's.

S is the smallest power of two giving >= TARGET_PROGRAMS split-launch programs at one row tile
(about two waves), as far as each range keeps >= MIN_SPLIT_STEPS bk steps; 1 for wide N (the LM
head). Grouping the narrow k/v projections with q is what gives them enough programs.

Hazards: K must have a power-of-two divisor >= 16 and each N_i must be >= 16 (Triton blocks),
else a ValueError naming the shape. Triton addresses with int32 offsets: S * M * N_i (and M * K,
K * N_i) must stay below 2**31. On GPUs the per-element order is fixed by this walk and by the
tensor-core instruction Triton emits for a block with float32 accumulation. The launches' program
shapes differ (32 rows on 4 warps; 64 on 4, 128 on 8 warps), so their bits agree only because that
instruction's per-element rounding does not depend on the block shape or warp count: interpret
mode cannot check that, the GPU probe
`benchmarks/probes/fixed_tile_probe.py` does (bit equality across M, launches and tile shapes;
run it on a new GPU or Triton before trusting the mode there). No atomics (each partial is stored
by one program), so the result is also run-to-run deterministic.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

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
ROW_TILE = 32  # rows a split-launch program (decode) covers
COL_TILE = 128  # the column tile cap that `tiles` (and so S) is computed with


@dataclasses.dataclass(frozen=True)
class Launch:
    """A program's shape: rows, columns (a cap: the group's largest power-of-two column tile up to
    it), warps, software-pipeline stages. Changes the speed, never an element's bits."""
    bm: int
    bn: int
    warps: int = 4
    stages: int = 3


# Walk-launch shapes, the first that still gives WALK_MIN_PROGRAMS programs wins: 128 x 128 tiles
# on 8 warps with 4 pipeline stages (each thread holds two accumulators of 64 float32 registers, a
# range's sum and the running total: 128 x 256 or 256 x 128 tiles spill), else 64 x 128 on 4 warps
# (twice the rows of 32 for each weight block read). Same bits for any shape.
WALK_LAUNCHES: tuple[Launch, ...] = (Launch(128, 128, 8, 4), Launch(64, 128))
WALK_MIN_PROGRAMS = TARGET_PROGRAMS // 2  # about one wave: below it the larger tiles leave SMs idle


def _col_tile(N: int, cap: int = COL_TILE) -> int:
    return _pow2_divisor(N, cap) or min(cap, 1 << (N.bit_length() - 1))


def _col_tiles(Ns: Sequence[int], cap: int) -> tuple[int, int]:
    """(bn, column tiles of the group laid end to end) for a column cap."""
    bn = min(_col_tile(N, cap) for N in Ns)
    return bn, sum(-(-N // bn) for N in Ns)


def tiles(K: int, *Ns: int) -> Tiles:
    """The tiles and the K split count of a group of [K, N_i] weights (a function of K and the
    N_i only: that is the invariance). bn is the smallest of the weights' column tiles; S is the
    smallest power of two with (column tiles of the group) * S >= TARGET_PROGRAMS, as far as
    K // bk stays divisible by S with >= MIN_SPLIT_STEPS steps a range. ValueError when K has no
    power-of-two divisor >= 16 or an N_i < 16."""
    if not Ns:
        raise ValueError("fixed_tile_matmul: no weights")
    bk = _pow2_divisor(K, 64)
    if bk is None:
        raise ValueError(f"fixed_tile_matmul: K={K} has no power-of-two divisor >= 16 (a Triton block)")
    for N in Ns:
        if N < 16:
            raise ValueError(f"fixed_tile_matmul: N={N} is below the smallest Triton block (16)")
    bn, col_tiles = _col_tiles(Ns, COL_TILE)
    nk, s = K // bk, 1
    while col_tiles * s < TARGET_PROGRAMS and nk % (2 * s) == 0 and nk // (2 * s) >= MIN_SPLIT_STEPS:
        s *= 2
    return Tiles(bm=ROW_TILE, bn=bn, bk=bk, splits=s)


def launch_splits(t: Tiles, M: int, col_tiles: int) -> int:
    """The split launch's S when M's row tiles times the column tiles give fewer than
    TARGET_PROGRAMS programs, else 1 (the walk launch). Either computes the same floats."""
    return t.splits if -(-max(M, 1) // t.bm) * col_tiles < TARGET_PROGRAMS else 1


def launch_shape(t: Tiles, Ns: Sequence[int], M: int, S: int, itemsizes: tuple[int, int] = (2, 2)) -> Launch:
    """The program shape of a call: for a walk launch (S == 1) over more than one ROW_TILE, the
    first of WALK_LAUNCHES whose row tiles times column tiles reach WALK_MIN_PROGRAMS and whose
    pipeline fits the device's shared memory (`_smem_limit`; `itemsizes`: bytes of an x and of a w
    element); else the split launch's (t.bm, t.bn, 4 warps, 3 stages). Any choice gives the same
    bits (see the hazards above); this one only decides the speed."""
    if S == 1 and M > t.bm:
        for cand in WALK_LAUNCHES:
            bn, col_tiles = _col_tiles(Ns, cand.bn)
            if (-(-M // cand.bm) * col_tiles >= WALK_MIN_PROGRAMS
                    and _smem_bytes(cand.bm, bn, t.bk, cand.stages, *itemsizes) <= _smem_limit()):
                return dataclasses.replace(cand, bn=bn)
    return Launch(t.bm, t.bn)


def _smem_bytes(bm: int, bn: int, bk: int, stages: int, x_item: int = 2, w_item: int = 2) -> int:
    """Shared memory a program's pipeline holds: `stages` copies of its x and w blocks."""
    return stages * (bm * bk * x_item + bk * bn * w_item)


# Shared memory a block may use, by CUDA compute capability (major, minor): Hopper and A100 hold
# the 128 KB of the 128 x 128, 4-stage walk; Ampere / Ada / consumer Blackwell parts (about
# 99 KB) take the next shape. Unknown capabilities get the smallest.
_SMEM_LIMIT = {(8, 0): 163 * 1024, (8, 7): 163 * 1024, (9, 0): 227 * 1024, (10, 0): 227 * 1024}
_SMEM_DEFAULT = 99 * 1024


@functools.lru_cache(maxsize=None)
def _smem_limit() -> int:
    """The default device's shared memory per block (no limit off GPUs: interpret mode)."""
    d = jax.devices()[0]
    if d.platform != "gpu":
        return 1 << 62
    try:
        major, minor = (int(v) for v in str(getattr(d, "compute_capability", "")).split(".")[:2])
    except ValueError:
        return _SMEM_DEFAULT
    return _SMEM_LIMIT.get((major, minor), _SMEM_DEFAULT)


def _kernel(x_ref, *refs, t: Tiles, M: int, Ns: tuple, nk: int, walk: int, transposed: bool):
    """One (row tile, column tile[, split]) program. refs: the g weights, then the g outputs
    (the [M, N_i] results, or with the split launch this split's [M, N_i] float32 partial: the
    split axis squeezed by the out BlockSpec). nk: bk steps a range; walk: ranges a program walks
    (S in the walk launch, 1 in the split launch)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    g = len(Ns)
    w_refs, o_refs = refs[:g], refs[g:]
    m0 = pl.program_id(0) * t.bm
    j = pl.program_id(1)
    first_range = pl.program_id(2) if walk == 1 else 0
    xmask = (m0 + lax.broadcasted_iota(jnp.int32, (t.bm, t.bk), 0)) < M

    def compute(w_ref, o_ref, N, j_local):
        n0 = j_local * t.bn
        win = jnp.minimum(n0, N - t.bn)  # shifted last tile when bn does not divide N

        def range_sum(r):  # float32 [bm, bn]: the bk steps of K range r, from zero
            kbase = r * (nk * t.bk)

            def body(kk, acc):
                k0 = pl.multiple_of(kbase + kk * t.bk, t.bk)
                a = plgpu.load(x_ref.at[pl.ds(m0, t.bm), pl.ds(k0, t.bk)], mask=xmask, other=0)
                if transposed:
                    b = w_ref[pl.ds(win, t.bn), pl.ds(k0, t.bk)]
                    return acc + lax.dot_general(a, b, (((1,), (1,)), ((), ())),
                                                 preferred_element_type=jnp.float32)
                b = w_ref[pl.ds(k0, t.bk), pl.ds(win, t.bn)]
                return acc + jnp.dot(a, b, preferred_element_type=jnp.float32)

            return lax.fori_loop(0, nk, body, jnp.zeros((t.bm, t.bn), jnp.float32))

        acc = range_sum(first_range)
        if walk > 1:  # p_0 + p_1 + ... in registers: the split launch's sum, float for float
            acc = lax.fori_loop(1, walk, lambda r, tot: tot + range_sum(r), acc)
        cols = win + lax.broadcasted_iota(jnp.int32, (t.bm, t.bn), 1)
        rows = m0 + lax.broadcasted_iota(jnp.int32, (t.bm, t.bn), 0)
        plgpu.store(o_ref.at[pl.ds(m0, t.bm), pl.ds(win, t.bn)], acc.astype(o_ref.dtype),
                    mask=(cols >= n0) & (rows < M))

    c0 = 0
    for i, N in enumerate(Ns):
        c1 = c0 + -(-N // t.bn)
        if g == 1:
            compute(w_refs[i], o_refs[i], N, j)
        else:
            pl.when((j >= c0) & (j < c1))(
                functools.partial(compute, w_refs[i], o_refs[i], N, j - c0))
        c0 = c1


def fixed_tile_matmuls(x: jax.Array, ws: Sequence[jax.Array], *, w_transposed: bool = False, out_dtype=None,
                       num_warps: int | None = None, num_stages: int | None = None, interpret: bool | None = None,
                       launch: str = "auto") -> list[jax.Array]:
    """x [M, K] through each w_i [K, N_i] ([N_i, K] when `w_transposed`) in one launch -> a list
    of [M, N_i] in `out_dtype` (None: x's dtype); see the module docstring for the invariance
    contract. `interpret` None = interpret unless the default backend is a GPU. `launch`: "auto"
    (`launch_splits`), or "split" / "walk" to force one (tests and probes: both give the same
    bits). `num_warps` / `num_stages` None: the launch shape's (`launch_shape`); set, they override
    it (probes). ValueError on mismatched shapes or an unknown launch."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    ws = list(ws)
    if x.ndim != 2 or not ws or any(w.ndim != 2 for w in ws):
        raise ValueError(f"fixed_tile_matmul: x and every w must be 2-D, got {x.shape} and "
                         f"{[tuple(w.shape) for w in ws]}")
    M, K = x.shape
    Ns = []
    for w in ws:
        N, Kw = w.shape if w_transposed else w.shape[::-1]
        if Kw != K:
            raise ValueError(f"fixed_tile_matmul: x has K={K}, w {'[N, K]' if w_transposed else '[K, N]'} "
                             f"{tuple(w.shape)} has K={Kw}")
        Ns.append(N)
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    t = tiles(K, *Ns)
    col_tiles = _col_tiles(Ns, COL_TILE)[1]
    if launch not in ("auto", "split", "walk"):
        raise ValueError(f"fixed_tile_matmul: launch={launch!r}; expected 'auto', 'split' or 'walk'")
    S = launch_splits(t, M, col_tiles) if launch == "auto" else t.splits if launch == "split" else 1
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    shape = launch_shape(t, Ns, M, S, (x.dtype.itemsize, max(w.dtype.itemsize for w in ws)))
    t = dataclasses.replace(t, bm=shape.bm, bn=shape.bn)
    col_tiles = _col_tiles(Ns, shape.bn)[1]
    kernel = functools.partial(_kernel, t=t, M=M, Ns=tuple(Ns), nk=K // (t.splits * t.bk),
                               walk=t.splits // S, transposed=w_transposed)
    if S == 1:  # the kernel stores the outputs themselves
        out_specs = [pl.BlockSpec((M, N), lambda i, j, s: (0, 0)) for N in Ns]
        out_shape = [jax.ShapeDtypeStruct((M, N), out_dtype) for N in Ns]
    else:  # one float32 partial [M, N_i] per split
        out_specs = [pl.BlockSpec((pl.squeezed, M, N), lambda i, j, s: (s, 0, 0)) for N in Ns]
        out_shape = [jax.ShapeDtypeStruct((S, M, N), jnp.float32) for N in Ns]
    warps, stages = num_warps or shape.warps, num_stages or shape.stages
    name = (f"jvllm_fixed_tile_matmul_bm{t.bm}_bn{t.bn}_bk{t.bk}_s{t.splits}_nw{warps}_ns{stages}"
            f"{'_walk' if S == 1 < t.splits else ''}"
            f"{f'_g{len(Ns)}' if len(Ns) > 1 else ''}{'_t' if w_transposed else ''}")
    outs = pl.pallas_call(
        kernel,
        grid=(-(-max(M, 1) // t.bm), col_tiles, S),
        in_specs=[pl.BlockSpec((M, K), lambda i, j, s: (0, 0))]
                 + [pl.BlockSpec(tuple(w.shape), lambda i, j, s: (0, 0)) for w in ws],
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=stages),
        name=name,
    )(x, *ws)
    if S == 1:
        return list(outs)
    # The splits' partials summed left to right, written out term by term: one fixed order for
    # every element whatever M (XLA does not reassociate float adds; a jnp.sum over the split
    # axis would leave the order to the reduction emitter, which may pick it by shape).
    results = []
    for out in outs:
        acc = out[0]
        for s in range(1, S):
            acc = acc + out[s]
        results.append(acc.astype(out_dtype))
    return results


def fixed_tile_matmul(x: jax.Array, w: jax.Array, *, w_transposed: bool = False, out_dtype=None,
                      num_warps: int | None = None, num_stages: int | None = None, interpret: bool | None = None,
                      launch: str = "auto") -> jax.Array:
    """x [M, K] @ w [K, N] (w [N, K] when `w_transposed`) -> [M, N]: `fixed_tile_matmuls` of one
    weight."""
    return fixed_tile_matmuls(x, [w], w_transposed=w_transposed, out_dtype=out_dtype, num_warps=num_warps,
                              num_stages=num_stages, interpret=interpret, launch=launch)[0]
