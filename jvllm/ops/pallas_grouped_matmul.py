"""Grouped matmul for mixture-of-experts FFNs: one Pallas kernel (Triton lowering on NVIDIA GPUs;
`interpret=True` runs the same kernel on CPU for tests). The `moe_backend="pallas"` backend of
`jvllm.ops.grouped_matmul`.

Contract: `grouped_matmul(lhs [M, K], rhs [G, K, N], group_sizes [G]) -> [M, N]` equals
`jax.lax.ragged_dot`: rows are sorted by group, group g owns the next `group_sizes[g]` rows and is
multiplied by `rhs[g]`; rows past `sum(group_sizes)` are 0. Output in `preferred_element_type` (default
lhs's dtype), accumulation in float32.

Why: upstream XLA lowers `ragged_dot` on CUDA by expanding it to a dense product over every group,
so a decode step would read all experts' weights; this kernel reads only the experts that own rows.

Work decomposition (the megablox / tokamax "group metadata" tiling, written here for Triton): row
tiles of `bm` rows are laid out per group (a group of s rows gets ceil(s / bm) tiles, starting at
its first row), so no tile spans two groups' outputs and an empty group gets no tile. The tile table
is built on the device from `group_sizes` with a static length (ceil(M / bm) + min(G, M), an upper
bound on the tile count: a group of s > 0 rows takes fewer than s / bm + 1 tiles, and at most min(G,
M) groups own rows); tiles past the real count do nothing, so the bound is the grid a decode step of
few rows over many experts launches (with G in its place, a 1-token step of a top-8-of-128 layer ran
129 row tiles for 9 possible ones). The grid is (N / bn, tile), column tiles fastest, so the
programs that load one lhs row block run together and all but the first find it in L2 (a prefill
chunk's lhs outgrows the L2; with row tiles fastest each column tile read it from DRAM again). Each
program walks K in `bk` steps, loading a [bm, bk] block of lhs and the [bk, bn] block of its group's
rhs, and stores only its own rows (masked). The lhs window of a tile is shifted to stay inside [0,
M) (rows of neighbouring groups are loaded and computed, never stored), so no load or store is out
of bounds, which keeps the interpreter (which clamps slices) and the GPU equal.

Hazards: Triton blocks are powers of two >= 16; shapes whose K or N no such block divides fall back
to `jax.lax.ragged_dot` (decided at trace time from static shapes, so once per compiled program).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax


def _pow2_divisor(n: int, cap: int) -> int | None:
    """Largest power of two in [16, cap] dividing n, or None."""
    b = cap
    while b >= 16:
        if n % b == 0:
            return b
        b //= 2
    return None


def launch_defaults(M: int, G: int) -> tuple[int, int, int, int, int, bool]:
    """(bm, bn, bk, num_stages, num_warps, swap) by rows per group: decode-sized batches (up to 16 rows
    per expert on average) take 64-row tiles, so nearly every active expert is read once by one
    tile; prefill-sized ones take up to 128. Decode batches with fewer rows than experts (a few
    tokens: few active tiles) keep 64-column tiles, so that more programs stream the weights; from
    one row per expert on, 128 columns and 8 warps. Prefill-sized batches (over 64 rows per expert)
    take 128x256 tiles with 64-deep K steps and 8 warps. The decode and prefill launches are the
    best of H200 sweeps at 1, 256 and 2,048 tokens (benchmarks/README.md); 17-64 rows per expert
    are untuned."""
    per_group = max(1, M // max(G, 1))
    if per_group <= 16:
        return (64, 64, 128, 4, 4, False) if M < G else (64, 128, 128, 3, 8, False)
    if per_group <= 64:
        return 64, 128, 64, 3, 4, False
    return 128, 256, 64, 3, 8, False


def tile_table(group_sizes: jax.Array, M: int, bm: int, rows: int | None = None) -> jax.Array:
    """[ceil(rows / bm) + min(G, rows), 4] int32 rows (group, first row, end row, window start) of
    the row tiles; unused rows have first == end (a no-op tile). `rows` (default M) bounds
    sum(group_sizes); M is the lhs's row count (padded to >= bm). Window start = min(first, M - bm)
    keeps the bm-row load window inside the lhs. No loop in the program (see the search below)."""
    G = group_sizes.shape[0]
    sizes = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    tiles = (sizes + bm - 1) // bm
    tcum = jnp.cumsum(tiles)
    rows = M if rows is None else rows
    n = -(-rows // bm) + min(G, rows)
    t = jnp.arange(n, dtype=jnp.int32)
    # compare_all: jnp.searchsorted's default method is a fori_loop, a while loop that an XLA GPU
    # program runs by copying its predicate to the host each trip (the step call then blocks)
    g = jnp.searchsorted(tcum, t, side="right", method="compare_all").astype(jnp.int32)
    real = g < G
    gc = jnp.minimum(g, G - 1)
    j = t - (tcum[gc] - tiles[gc])
    first = starts[gc] + j * bm
    end = jnp.minimum(first + bm, ends[gc])
    first = jnp.where(real, first, 0)
    end = jnp.where(real, end, 0)
    window = jnp.clip(first, 0, max(M - bm, 0))
    return jnp.stack([gc, first, end, window], axis=1)


def pick(meta, i):
    """Element i of a small int32 vector as a scalar (a masked sum: Triton-safe, no dynamic index)."""
    lane = lax.broadcasted_iota(jnp.int32, meta.shape, 0)
    return jnp.sum(jnp.where(lane == i, meta, 0))


def _kernel(meta_ref, lhs_ref, rhs_ref, out_ref, *, bm: int, bk: int, bn: int, nk: int, swap: bool):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    meta = meta_ref[...]                                   # [4] int32 of this tile
    g, first, end, window = (pick(meta, i) for i in range(4))
    n0 = pl.program_id(0) * bn

    @pl.when(end > first)
    def _():
        def body(kk, acc):
            k0 = pl.multiple_of(kk * bk, bk)
            a = lhs_ref[pl.ds(window, bm), pl.ds(k0, bk)]
            b = rhs_ref[pl.ds(g, 1), pl.ds(k0, bk), pl.ds(n0, bn)].reshape(bk, bn)
            if swap:  # [bn, bm] += b^T a^T: the weight columns fill the MMA's M side
                return acc + jnp.dot(b.T, a.T, preferred_element_type=jnp.float32)
            return acc + jnp.dot(a, b, preferred_element_type=jnp.float32)

        acc = lax.fori_loop(0, nk, body, jnp.zeros((bn, bm) if swap else (bm, bn), jnp.float32))
        if swap:
            acc = acc.T
        rows = window + lax.broadcasted_iota(jnp.int32, (bm, bn), 0)
        mine = (rows >= first) & (rows < end)
        plgpu.store(out_ref.at[pl.ds(window, bm), pl.ds(n0, bn)], acc.astype(out_ref.dtype), mask=mine)


def grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, precision=None,
                   preferred_element_type=None, *, bm: int | None = None, bn: int | None = None,
                   bk: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
                   swap: bool | None = None, interpret: bool | None = None) -> jax.Array:
    """`jax.lax.ragged_dot(lhs, rhs, group_sizes)` (see the module docstring). Launch parameters
    left None take `launch_defaults`; `swap` computes each tile as (rhs^T lhs^T)^T, so that the
    MMA's wide side is `bn` weight columns and its narrow side the tile's `bm` rows (a decode
    tile's few rows then waste no tensor-core work on padding rows); `interpret` None = interpret unless the default backend is a GPU.
    `precision` is in the signature for compatibility with `ragged_dot` and must be None (the kernel's
    dot is the inputs' dtype with float32 accumulation): anything else is a ValueError."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    if precision is not None:
        raise ValueError(f"grouped_matmul: precision={precision!r} is not supported (None only)")
    M, K = lhs.shape
    G, K2, N = rhs.shape
    if K2 != K:
        raise ValueError(f"grouped_matmul: lhs has K={K}, rhs has K={K2}")
    if group_sizes.shape != (G,):
        raise ValueError(f"grouped_matmul: group_sizes has shape {group_sizes.shape}, expected ({G},)")
    out_dtype = jnp.dtype(preferred_element_type or lhs.dtype)
    d_bm, d_bn, d_bk, d_stages, d_warps, d_swap = launch_defaults(M, G)
    swap = d_swap if swap is None else swap
    bm = bm or d_bm
    bn = _pow2_divisor(N, bn or d_bn)
    bk = _pow2_divisor(K, bk or d_bk)
    if bn is None or bk is None or M == 0:
        return lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=out_dtype)
    num_stages = d_stages if num_stages is None else num_stages
    num_warps = d_warps if num_warps is None else num_warps
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    Mp = max(M, bm)
    x = lhs if Mp == M else jnp.pad(lhs, ((0, Mp - M), (0, 0)))
    meta = tile_table(group_sizes, Mp, bm, rows=M)
    kernel = functools.partial(_kernel, bm=bm, bk=bk, bn=bn, nk=K // bk, swap=bool(swap))
    out = pl.pallas_call(
        kernel,
        grid=(N // bn, meta.shape[0]),  # column tiles fastest: see the module docstring
        in_specs=[pl.BlockSpec((None, 4), lambda n, t: (t, 0)),
                  pl.BlockSpec((Mp, K), lambda n, t: (0, 0)),
                  pl.BlockSpec((G, K, N), lambda n, t: (0, 0, 0))],
        out_specs=pl.BlockSpec((Mp, N), lambda n, t: (0, 0)),
        out_shape=jax.ShapeDtypeStruct((Mp, N), out_dtype),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name=f"jvllm_grouped_matmul_bm{bm}_bn{bn}_bk{bk}{'_t' if swap else ''}",
    )(meta, x, rhs)
    total = jnp.sum(group_sizes.astype(jnp.int32))
    return jnp.where((jnp.arange(M) < total)[:, None], out[:M], jnp.zeros((), out_dtype))
