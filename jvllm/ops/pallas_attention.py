"""Ragged paged attention for mixed prefill + decode batches: one Pallas kernel (Triton lowering on
NVIDIA GPUs; `interpret=True` runs the same kernel on CPU for tests).

Why: the XLA reference (`jvllm.ops.attention.paged_attention`) gathers every tile's whole context
out of the pool into a temporary and walks all tiles to the batch's longest context (a prefill
then costs several times its matmuls: benchmarks/README.md). This kernel reads pages straight from
the pool (no gathered copy), and every query tile stops at its own last position (causal skip per
tile), so a prefill chunk does about half of the dense work and a short request in a long batch
costs only its own context.

Work decomposition (FlashAttention-2 over pages): the grid is (query tile, KV head). A tile holds
up to Qt consecutive tokens of one request (the runner's `tile_token_idx`); with G query heads per
KV head the program's queries are the Qt x G rows of that KV head (M = Qt*G, padded to a power of
two >= 16 for Triton's dot), so a KV block loaded once serves every query head of its group. The
program walks its request's block table `pages_per_block` pages at a time up to
ceil((max position in tile + 1) / chunk) with an online softmax; sliding windows start the walk at
the first chunk any row of the tile can see. Masking is positional, as in the reference: key j is
visible to a row at position q iff q - window < j <= q; padded rows carry position -1 and see
nothing (their output is garbage that the caller never scatters back).

Hazards: the whole per-head page pool is the kernel's input block (Triton indexes it by pointer;
nothing is copied); `block_tables` width must be a multiple of `pages_per_block`.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from jvllm.ops.kv_quant import QuantizedPages
from jvllm.ops.pallas_grouped_matmul import pick

MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _kernel(q_ref, pos_ref, bt_ref, k_ref, v_ref, *refs, pages_per_block: int, scale: float,
            window: int | None, num_splits: int, prefetch_ids: bool = False, softcap: float | None = None,
            quantized: bool = False, direct: tuple[int, int] | None = None):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    # fp8 pages: their scales [pages, block_size] come before the outputs; direct token rows:
    # the tile's (first token, token count) and the zeroed output buffer it is written into
    if direct is not None:
        refs = refs[:-2] + refs[-1:]  # drop the aliased zero buffer's input ref (its output is o_ref)
    ks_ref, vs_ref, *refs = refs if quantized else (None, None, *refs)
    if direct is not None:
        info_ref, o_ref, *split_refs = refs
    else:
        o_ref, *split_refs = refs
    bs = k_ref.shape[-2]
    P = pages_per_block
    chunk = P * bs
    if direct is not None:  # q rows straight from [T, H, D] (see ragged_paged_attention)
        Qt, G = direct
        T, _, D = q_ref.shape
        M = Qt * G
        info = info_ref[...]
        t0, nv = pick(info, 0), pick(info, 1)
        win = jnp.minimum(t0, T - Qt)  # the Qt-row window holding the tile, inside [0, T)
        tok = win + lax.broadcasted_iota(jnp.int32, (Qt,), 0)
        mine = (tok >= t0) & (tok < t0 + nv)
        rows3 = jnp.broadcast_to(mine[:, None, None], (Qt, G, D))
        heads = pl.ds(pl.program_id(1) * G, G)
        q = plgpu.load(q_ref.at[pl.ds(win, Qt), heads, :], mask=rows3, other=0.0).reshape(M, D)
        pos = plgpu.load(pos_ref.at[pl.ds(win, Qt)], mask=mine, other=-1)
        qpos = jnp.broadcast_to(jnp.where(mine, pos, -1)[:, None], (Qt, G)).reshape(M)
    else:
        M, D = q_ref.shape
        # split-K (small decode batches): most programs see no key (padding tiles), so q is loaded
        # inside the loop, by programs that have keys (about one chunk each); else once, up front
        q = None if num_splits > 1 else q_ref[...]
        qpos = pos_ref[...]                                  # [M] int32, -1 = padding row
    max_pos = jnp.max(qpos)
    n_chunks = lax.div(max_pos + chunk, chunk)               # ceil((max_pos + 1) / chunk); 0 for an empty tile
    if window is not None:
        big = jnp.int32(2**30)
        min_pos = jnp.min(jnp.where(qpos >= 0, qpos, big))
        first = lax.div(jnp.maximum(min_pos - window + 1, 0), chunk)
        first = jnp.minimum(first, n_chunks)
    else:
        first = jnp.int32(0)
    if num_splits > 1:  # this program walks its share of the tile's chunks (split-K, flash-decoding)
        split = pl.program_id(2)
        per = lax.div(n_chunks - first + num_splits - 1, num_splits)
        first = jnp.minimum(first + split * per, n_chunks)
        n_chunks = jnp.minimum(first + per, n_chunks)
    log2e = math.log2(math.e)
    qk_scale = scale * log2e

    last_chunk = bt_ref.shape[0] // P - 1

    def body(c, carry):
        if prefetch_ids:  # this chunk's page ids came with the carry; load the next chunk's now
            o, m, l, ids = carry
            nxt = bt_ref[pl.ds(jnp.minimum(c + 1, last_chunk) * P, P)]
        else:
            o, m, l = carry
            ids = bt_ref[pl.ds(c * P, P)]
        k = k_ref[ids].reshape(chunk, D)
        v = v_ref[ids].reshape(chunk, D)
        if quantized:  # fp8 rows widen exactly to q's dtype; the scales multiply scores and probabilities
            k, v = k.astype(q_ref.dtype), v.astype(q_ref.dtype)
        s = plgpu.dot(q_ref[...] if q is None else q, k.T)
        if quantized:
            s = s * ks_ref[ids].reshape((1, chunk)).astype(jnp.float32)
        if softcap is None:
            s = s * qk_scale                                     # [M, chunk] f32, base-2 logits
        else:                                                    # soft-capped natural logits, then base 2
            s = jnp.tanh(s * (scale / softcap)) * (softcap * log2e)
        kpos = c * chunk + jnp.arange(chunk, dtype=jnp.int32)
        mask = kpos[None, :] <= qpos[:, None]
        if window is not None:
            mask = jnp.logical_and(mask, kpos[None, :] > qpos[:, None] - window)
        s = jnp.where(mask, s, MASK_VALUE)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        corr = jnp.exp2(m - m_new)
        p = jnp.exp2(s - m_new[:, None])
        l = l * corr + jnp.sum(p, axis=-1)
        if quantized:
            p = p * vs_ref[ids].reshape((1, chunk)).astype(jnp.float32)
        o = o * corr[:, None] + plgpu.dot(p.astype(v.dtype), v)
        return (o, m_new, l, nxt) if prefetch_ids else (o, m_new, l)

    o = jnp.zeros((M, D), jnp.float32)
    m = jnp.full((M,), MASK_VALUE, jnp.float32)
    l = jnp.zeros((M,), jnp.float32)
    if prefetch_ids:
        ids0 = bt_ref[pl.ds(jnp.minimum(first, last_chunk) * P, P)]
        o, m, l, _ = lax.fori_loop(first, n_chunks, body, (o, m, l, ids0))
    else:
        o, m, l = lax.fori_loop(first, n_chunks, body, (o, m, l))
    if num_splits > 1:  # unnormalized partials; the caller merges the splits
        m_ref, l_ref = split_refs
        m_ref[...] = m
        l_ref[...] = l

        # a split that saw no key (padding tiles: most programs of a small decode batch in its
        # bucket) leaves its o block unwritten; the merges drop partials whose l is 0
        @pl.when(n_chunks > first)
        def _():
            o_ref[...] = o
    elif direct is not None:  # the tile's own token rows of its G heads; other rows stay 0
        o = (o / jnp.where(l == 0.0, 1.0, l)[:, None]).astype(o_ref.dtype).reshape(Qt, G, D)
        plgpu.store(o_ref.at[pl.ds(win, Qt), heads, :], o, mask=rows3)
    else:
        o_ref[...] = (o / jnp.where(l == 0.0, 1.0, l)[:, None]).astype(o_ref.dtype)


def decode_splits(num_tiles: int, kv_heads: int, target_programs: int = 2048, max_splits: int = 16) -> int:
    """Splits per tile so that a small decode batch still launches about `target_programs`
    programs (batch 1 with 8 KV heads: 8 programs unsplit, 128 with 16 splits); 1 for big batches."""
    s = 1
    while s < max_splits and num_tiles * kv_heads * s * 2 <= target_programs:
        s *= 2
    return s


def launch_defaults(num_tiles: int, kv_heads: int, tile_queries: int, block_size: int) -> tuple[int, int, int]:
    """(pages_per_block, num_stages, num_splits) of `ragged_paged_attention`'s default launch for
    a grid of num_tiles x kv_heads programs of `tile_queries` queries each (see its docstring for
    the measurements): decode-only grids of >= 512 programs take 128 keys per inner step and one
    stage; smaller decode grids keep 64 keys and 2 stages and are split-K to about 2048 programs;
    tiles of several queries take 64 keys, 2 stages, no split."""
    decode = tile_queries == 1
    wide = decode and num_tiles * kv_heads >= 512
    pages = max(1, (128 if wide else 64) // block_size)
    splits = decode_splits(num_tiles, kv_heads) if decode and not wide else 1
    return pages, 1 if wide else 2, splits


def ragged_paged_attention(q, k_pages, v_pages, md, *, scale: float, window: int | None = None,
                           softcap: float | None = None, pages_per_block: int | None = None, num_warps: int = 4, num_stages: int | None = None,
                           num_splits: int | str | None = None, prefetch_ids: bool = False,
                           token_rows: bool = True, interpret: bool = False):
    """q [T, H, D] -> [T, H, D]; same contract and result as `attention.paged_attention` (which is
    the test oracle). K/V for this step's tokens must already be in the pages. Launch defaults
    (None = by tile kind) are the best measured on an H200 (bf16, 8 KV heads, head_dim 128; the
    figures are in benchmarks/README.md and results/INDEX.md):
    - tiles of several queries (prefill, mixed steps): 64 keys per inner step (`pages_per_block`
      = max(1, 64 // block size)), 4 warps, 2 stages;
    - one-query tiles (decode-only steps) with at least 512 programs (64 requests x 8 KV heads):
      128 keys per inner step, 4 warps, 1 stage;
    - one-query tiles with fewer than 512 programs (small decode batches, B1) keep the 64-key,
      2-stage launch but are split-K (`decode_splits`): unsplit, so few programs leave the GPU idle.
    `softcap` soft-caps the scores as the reference does (cap * tanh(scale * q.k / cap)).
    `k_pages` / `v_pages` may be fp8 `kv_quant.QuantizedPages`: the kernel then also reads their
    per-token scales (a [pages, block_size] block per inner step) and widens the fp8 rows to q's
    dtype before its dots.
    `prefetch_ids` loads the next inner step's page ids one iteration ahead (experimental; it
    did not beat the defaults in that sweep).
    `token_rows` (tiles of several queries, unsplit, Qt * G a power of two >= 16, a power-of-two
    head_dim, T >= Qt): each program loads its tile's q rows straight from q [T, H, D] and stores
    its output rows straight into the [T, H, D] result (a tile's tokens are consecutive:
    build_metadata's layout), instead of XLA gathering q into padded [tiles, KH, Qt*G, D] tiles
    and scattering the result back (copies of Qt times q's size when tiles hold one token each, as
    decode tokens do in batch-invariant mode). False, or any other shape: the gathered layout.

    `num_splits` > 1 (or "auto": `decode_splits` for one-query tiles, else 1; None: "auto" below
    512 programs, else 1, see `launch_defaults`) splits each tile's
    keys over that many programs and merges their partial softmax states afterwards
    (flash-decoding): for small decode batches, where one program per (tile, KV head) leaves most
    of the GPU idle."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    T, H, D = q.shape
    KH, NB, bs, _ = k_pages.shape
    G = H // KH
    quantized = isinstance(k_pages, QuantizedPages)
    pages_in = (k_pages.data, v_pages.data, k_pages.scale, v_pages.scale) if quantized else (k_pages, v_pages)
    NT, Qt = md.tile_token_idx.shape
    W = md.block_tables.shape[1]
    d_pages, d_stages, d_splits = launch_defaults(NT, KH, Qt, bs)
    pages_per_block = d_pages if pages_per_block is None else pages_per_block
    num_stages = d_stages if num_stages is None else num_stages
    num_splits = d_splits if num_splits is None else num_splits
    P = next(p for p in (pages_per_block, 8, 4, 2, 1) if p <= W and W % p == 0)
    M = Qt * G
    Mp = max(16, _next_pow2(M))
    if num_splits == "auto":
        num_splits = decode_splits(NT, KH) if Qt == 1 else 1
    S = int(num_splits)
    if token_rows and Qt > 1 and S == 1 and M == Mp and T >= Qt and _pow2(D):
        return _token_rows_attention(q, pages_in, md, P=P, scale=scale, window=window, softcap=softcap,
                                     quantized=quantized, prefetch_ids=prefetch_ids, num_warps=num_warps,
                                     num_stages=num_stages, interpret=interpret)

    one_query = Qt == 1  # tile n is token n (build_metadata's layout): no gather, no scatter back
    if one_query:
        n = min(NT, T)
        qt = q[:n].reshape(n, KH, G, D)
        qpos = jnp.broadcast_to(md.positions[:n, None], (n, G))
        if n < NT:  # more tiles than tokens: the extra tiles are padding (position -1)
            qt = jnp.pad(qt, ((0, NT - n), (0, 0), (0, 0), (0, 0)))
            qpos = jnp.pad(qpos, ((0, NT - n), (0, 0)), constant_values=-1)
    else:
        q_ext = jnp.concatenate([q, jnp.zeros((1, H, D), q.dtype)], axis=0)
        qt = q_ext[md.tile_token_idx].reshape(NT, Qt, KH, G, D).transpose(0, 2, 1, 3, 4).reshape(NT, KH, M, D)
        pos_ext = jnp.concatenate([md.positions, jnp.full((1,), -1, md.positions.dtype)])
        qpos = jnp.repeat(pos_ext[md.tile_token_idx], G, axis=1)   # [NT, M], row = token * G + head
    if Mp != M:
        qt = jnp.pad(qt, ((0, 0), (0, 0), (0, Mp - M), (0, 0)))
        qpos = jnp.pad(qpos, ((0, 0), (0, Mp - M)), constant_values=-1)
    bt = md.block_tables[md.tile_req]                           # [NT, W]
    kernel = functools.partial(_kernel, pages_per_block=P, scale=scale, window=window, num_splits=S,
                               prefetch_ids=prefetch_ids, softcap=softcap, quantized=quantized)
    params = plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    if S == 1:
        grid = (NT, KH)
        idx = lambda f: f  # noqa: E731
        out_specs = pl.BlockSpec((None, None, Mp, D), lambda n, h: (n, h, 0, 0))
        out_shape = jax.ShapeDtypeStruct((NT, KH, Mp, D), q.dtype)
    else:
        grid = (NT, KH, S)
        idx = lambda f: (lambda n, h, s_: f(n, h))  # noqa: E731
        out_specs = [pl.BlockSpec((None, None, None, Mp, D), lambda n, h, s_: (s_, n, h, 0, 0)),
                     pl.BlockSpec((None, None, None, Mp), lambda n, h, s_: (s_, n, h, 0)),
                     pl.BlockSpec((None, None, None, Mp), lambda n, h, s_: (s_, n, h, 0))]
        out_shape = [jax.ShapeDtypeStruct((S, NT, KH, Mp, D), jnp.float32),
                     jax.ShapeDtypeStruct((S, NT, KH, Mp), jnp.float32),
                     jax.ShapeDtypeStruct((S, NT, KH, Mp), jnp.float32)]
    out = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[
            pl.BlockSpec((None, None, Mp, D), idx(lambda n, h: (n, h, 0, 0))),
            pl.BlockSpec((None, Mp), idx(lambda n, h: (n, 0))),
            pl.BlockSpec((None, W), idx(lambda n, h: (n, 0))),
            pl.BlockSpec((None, NB, bs, D), idx(lambda n, h: (h, 0, 0, 0))),
            pl.BlockSpec((None, NB, bs, D), idx(lambda n, h: (h, 0, 0, 0))),
        ] + [pl.BlockSpec((None, NB, bs), idx(lambda n, h: (h, 0, 0)))] * (2 if quantized else 0),
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=params,
        name=f"jvllm_ragged_paged_attention_M{Mp}_P{P}_S{S}{'_pf' if prefetch_ids else ''}"
             f"{'_cap' if softcap is not None else ''}{'_fp8' if quantized else ''}",
    )(qt, qpos.astype(jnp.int32), bt, *pages_in)
    if S > 1 and one_query and _pow2(S) and _pow2(G) and _pow2(D):  # Triton blocks: powers of 2
        # one program per (tile, KV head) merges the splits and writes its G heads straight
        # into the [tiles, H, D] output (one launch instead of XLA's five fusions + a copy)
        o_s, m_s, l_s = out
        heads = pl.pallas_call(
            _merge_kernel, grid=(NT, KH),
            in_specs=[pl.BlockSpec((S, None, None, G, D), lambda n, h: (0, n, h, 0, 0)),
                      pl.BlockSpec((S, None, None, G), lambda n, h: (0, n, h, 0)),
                      pl.BlockSpec((S, None, None, G), lambda n, h: (0, n, h, 0))],
            out_specs=pl.BlockSpec((None, G, D), lambda n, h: (n, h, 0)),
            out_shape=jax.ShapeDtypeStruct((NT, H, D), q.dtype),
            interpret=interpret, compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
            name=f"jvllm_split_merge_S{S}_G{G}")(o_s, m_s, l_s)
        return _token_rows(heads, T)
    if S > 1:  # merge the splits' partial softmax states (base-2 logits, as in the kernel)
        o_s, m_s, l_s = out
        m = jnp.max(m_s, axis=0)
        w = jnp.exp2(m_s - m[None])
        l = jnp.sum(w * l_s, axis=0)
        o = jnp.sum(jnp.where(l_s[..., None] > 0, w[..., None] * o_s, 0.0), axis=0)  # unwritten o where l == 0
        out = (o / jnp.where(l == 0.0, 1.0, l)[..., None]).astype(q.dtype)
    if one_query:
        return _token_rows(out[:, :, :G].reshape(NT, H, D), T)
    out = out[:, :, :M].reshape(NT, KH, Qt, G, D).transpose(0, 2, 1, 3, 4).reshape(NT, Qt, H, D)
    flat = jnp.zeros((T + 1, H, D), q.dtype).at[md.tile_token_idx].set(out)
    return flat[:T]


def _token_rows_attention(q, pages_in, md, *, P: int, scale: float, window, softcap, quantized: bool,
                          prefetch_ids: bool, num_warps: int, num_stages: int, interpret: bool):
    """`ragged_paged_attention`'s tiles of several queries with q read and the output written in
    token rows (`token_rows`): grid (tile, KV head); a program's M = Qt * G rows are its tile's
    Qt tokens x its G query heads, loaded from the Qt-row window of q that holds the tile (shifted
    to stay inside [0, T) for a tile at the end); rows outside the tile are padding (position -1)
    and are neither read nor written. Tokens in no tile (the step's padding) come back as zeros."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    T, H, D = q.shape
    KH, NB, bs, _ = pages_in[0].shape
    G = H // KH
    NT, Qt = md.tile_token_idx.shape
    W = md.block_tables.shape[1]
    tt = md.tile_token_idx
    info = jnp.stack([tt[:, 0], jnp.sum(tt < T, axis=1, dtype=jnp.int32)], axis=1).astype(jnp.int32)
    bt = md.block_tables[md.tile_req]                           # [NT, W]
    kernel = functools.partial(_kernel, pages_per_block=P, scale=scale, window=window, num_splits=1,
                               prefetch_ids=prefetch_ids, softcap=softcap, quantized=quantized, direct=(Qt, G))
    whole = lambda *shape: pl.BlockSpec(shape, lambda n, h: (0,) * len(shape))  # noqa: E731
    n_in = 3 + len(pages_in) + 1
    return pl.pallas_call(
        kernel,
        grid=(NT, KH),
        in_specs=[whole(T, H, D), whole(T),
                  pl.BlockSpec((None, W), lambda n, h: (n, 0)),
                  pl.BlockSpec((None, NB, bs, D), lambda n, h: (h, 0, 0, 0)),
                  pl.BlockSpec((None, NB, bs, D), lambda n, h: (h, 0, 0, 0))]
                 + [pl.BlockSpec((None, NB, bs), lambda n, h: (h, 0, 0))] * (2 if quantized else 0)
                 + [pl.BlockSpec((None, 2), lambda n, h: (n, 0)), whole(T, H, D)],
        out_specs=whole(T, H, D),
        out_shape=jax.ShapeDtypeStruct((T, H, D), q.dtype),
        input_output_aliases={n_in: 0},
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name=f"jvllm_ragged_paged_attention_rows_M{Qt * G}_P{P}{'_pf' if prefetch_ids else ''}"
             f"{'_cap' if softcap is not None else ''}{'_fp8' if quantized else ''}",
    )(q, md.positions.astype(jnp.int32), bt, *pages_in, info, jnp.zeros((T, H, D), q.dtype))


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _token_rows(tiles, T: int):
    """[NT, H, D] one-query tile outputs -> [T, H, D] token rows (tile n is token n)."""
    NT = tiles.shape[0]
    return tiles[:T] if NT >= T else jnp.pad(tiles, ((0, T - NT), (0, 0), (0, 0)))


def _merge_kernel(o_ref, m_ref, l_ref, out_ref):
    """Split-K merge of one (tile, KV head): partial states [S, G, D] / [S, G] (base-2 running
    max, sum, unnormalized output) -> normalized [G, D]. A split whose l is 0 saw no key and left
    its o unwritten (any bits, NaN included): a masked load never reads it (nor its memory). Rows that
    saw no key at all give 0."""
    from jax.experimental.pallas import triton as plgpu

    m_s, l_s = m_ref[...], l_ref[...]
    m = jnp.max(m_s, axis=0)
    w = jnp.exp2(m_s - m[None, :])
    l = jnp.sum(w * l_s, axis=0)
    seen = jnp.broadcast_to((l_s > 0)[:, :, None], o_ref.shape)
    o_s = plgpu.load(o_ref, mask=seen, other=0.0)  # masked: unwritten blocks are never read
    o = jnp.sum(w[:, :, None] * o_s, axis=0)
    out_ref[...] = (o / jnp.where(l == 0.0, 1.0, l)[:, None]).astype(out_ref.dtype)

