"""Paged attention over a ragged batch, in plain XLA (the reference path and the test oracle).

The batch is flat: T scheduled tokens from R requests, each token with its position in its own
sequence. KV lives in per-layer page pools `[kv_heads, num_blocks, block_size, head_dim]` (KV-head
major: the layout of JAX's Pallas paged-attention kernels, and the dimension TP shards); block 0
is the null block (never handed to a request; padded writes land there and are never read
unmasked). An fp8 cache (`kv_cache_dtype="fp8"`) holds `kv_quant.QuantizedPages` instead of arrays:
the same pages in float8_e4m3fn plus per-(KV head, slot) scales; every reader takes either.

Queries are grouped into *query tiles*: every tile holds up to `Qt` consecutive tokens of one
request (`tile_token_idx [NT, Qt]`, padded with T, which points at a zero row). A tile reads its
request's pages once, so a decode token costs one read of its context and a prefill chunk of n
tokens costs ceil(n / Qt) reads (not n). Keys are walked in chunks of `kv_chunk_blocks` blocks with
an online softmax and a *dynamic* trip count (the batch's longest context), so no context-length
bucket is compiled and memory stays O(NT x chunk). Masking is purely positional: key j of a request
is visible to a query at position q iff q - window < j <= q; keys past the context are therefore
masked without a separate length array, and padded query slots (position -1) see nothing.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools

import jax
import jax.numpy as jnp

from jvllm.ops import kv_quant
from jvllm.ops.kv_quant import QuantizedPages

# The device mesh ("tensor" axis) of the stage being traced; set by the runner around the model call.
_TP_MESH = contextvars.ContextVar("jvllm_tensor_parallel_mesh", default=None)


@contextlib.contextmanager
def tensor_parallel_mesh(mesh):
    """Trace a stage's model under its mesh, so that the Pallas attention kernels run per device
    on the local KV heads (`shard_local`) instead of being replicated by GSPMD."""
    token = _TP_MESH.set(mesh)
    try:
        yield
    finally:
        _TP_MESH.reset(token)


def tensor_parallel_size() -> int:
    m = _TP_MESH.get()
    return 1 if m is None else int(dict(m.shape).get("tensor", 1))


def shard_local(attend, q, k, v, k_pages, v_pages, md):
    """Write this step's k, v [T, K, D] into the pools [K, blocks, bs, D] and run
    `attend(q, k_pages, v_pages, md) -> o` [T, H, D], once per tensor-parallel device on its own
    heads (jax.shard_map over the traced stage's "tensor" axis), or directly without tensor
    parallelism. Returns (o, k_pages, v_pages).

    Why: XLA's SPMD partitioner cannot split a custom call such as a Pallas/Triton kernel, so under
    plain GSPMD it gathers the kernel's operands onto every device, here the whole sharded KV pool
    of the layer, on every layer of every step. It gathers for the XLA reference too (the page
    gathers and scatters index a sharded pool); tests/test_sharding.py checks the HLO. Inside
    shard_map each device writes and reads only its own KV-head shard; the only collectives of a
    layer stay the row-parallel all-reduces after attention and MLP.

    Layouts (heads sharded Megatron-style, `sharding.rules`): q split on H; k, v and the pools split
    on K when tp divides K. When KV heads are replicated (K < tp), each device writes the whole
    (replicated) pools and attends over the KV heads its query heads use (needs H/tp and H/K to
    divide one another); that slice is a copy (n_kv/K of the layer's pool each step: the kernels
    would need a per-device head offset to avoid it). Other layouts keep the GSPMD path (correct,
    slow)."""
    def write_and_attend(q, k, v, kp, vp, md, kv_heads=None):
        kp, vp = write_kv(kp, k, md.slot_mapping), write_kv(vp, v, md.slot_mapping)
        o = attend(q, kp, vp, md) if kv_heads is None else attend(q, kv_heads(kp), kv_heads(vp), md)
        return o, kp, vp

    tp = tensor_parallel_size()
    H, K = q.shape[1], k_pages.shape[0]
    Hl, G = H // tp, H // K
    if tp == 1 or H % tp or not (K % tp == 0 or Hl % G == 0 or G % Hl == 0):
        return write_and_attend(q, k, v, k_pages, v_pages, md)
    from jax.sharding import PartitionSpec as P

    heads = P(None, "tensor", None)
    if K % tp == 0:
        body, kv_in, kv_io = write_and_attend, heads, P("tensor")
    else:
        n_kv = max(1, Hl // G)

        def body(q, k, v, kp, vp, md):
            first = jax.lax.axis_index("tensor") * Hl // G
            return write_and_attend(q, k, v, kp, vp, md, kv_heads=lambda pages: jax.tree_util.tree_map(
                lambda a: jax.lax.dynamic_slice_in_dim(a, first, n_kv, axis=0), pages))

        kv_in, kv_io = P(), P()
    mapped = jax.shard_map(body, mesh=_TP_MESH.get(), in_specs=(heads, kv_in, kv_in, kv_io, kv_io, P()),
                           out_specs=(heads, kv_io, kv_io), check_vma=False)
    return mapped(q, k, v, k_pages, v_pages, md)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    positions: jax.Array        # [T] int32, -1 for padding tokens
    slot_mapping: jax.Array     # [T] int32, flat slot (block * block_size + offset); >= num_slots = drop
    block_tables: jax.Array     # [R, W] int32, W a multiple of kv_chunk_blocks, padded with 0
    tile_token_idx: jax.Array   # [NT, Qt] int32 indices into the T tokens, T = padding. build_metadata's
                                # layout, which the ragged kernel relies on to read q and write o without
                                # gathers: a tile's tokens are consecutive (first, first + 1, ..., then
                                # padding), and with one-query tiles (Qt == 1) tile n is token n
    tile_req: jax.Array         # [NT] int32 request row of each tile
    logits_indices: jax.Array   # [R] int32 token whose hidden state feeds sampling


def write_kv(pages, new: jax.Array, slot_mapping: jax.Array):
    """Scatter new K or V rows [T, kv_heads, head_dim] into `pages` at `slot_mapping` (in place
    when `pages` is donated). Out-of-range slots (padding) are dropped. `pages` is an array (rows
    cast to its dtype) or `kv_quant.QuantizedPages` (rows quantized to fp8 with their scales).
    (One Pallas kernel writing K and V together did not beat these two scatters:
    benchmarks/README.md, Negative results.)"""
    if isinstance(pages, QuantizedPages):
        return kv_quant.write(pages, new, slot_mapping)
    kh, nb, bs, d = pages.shape
    flat = pages.reshape(kh, nb * bs, d)
    flat = flat.at[:, slot_mapping].set(new.astype(pages.dtype).transpose(1, 0, 2), mode="drop")
    return flat.reshape(kh, nb, bs, d)


def pallas_decode_attention(q, k_pages, v_pages, md: AttentionMetadata, *, scale: float, interpret: bool = False):
    """Decode-only steps (one query per request, row r = request r) through JAX's Pallas GPU
    paged-attention kernel (reads each request's pages once, split over the sequence). fp8 pages
    (`QuantizedPages`) go in as the kernel's fp8 pages with per-token scales."""
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention as pallas_pa

    R = md.block_tables.shape[0]
    W = md.block_tables.shape[1]
    lengths = jnp.maximum(md.positions[:R] + 1, 1).astype(jnp.int32)
    k_splits = next(k for k in (16, 8, 4, 2, 1) if W % k == 0)
    scales = {}
    if isinstance(k_pages, QuantizedPages):
        scales = dict(k_scales_pages=k_pages.scale, v_scales_pages=v_pages.scale)
        k_pages, v_pages = k_pages.data, v_pages.data
    out = pallas_pa((q[:R] * scale).astype(q.dtype), k_pages, v_pages, md.block_tables, lengths,
                    k_splits=k_splits, pages_per_compute_block=min(8, W // k_splits), interpret=interpret,
                    **scales)
    return jnp.zeros_like(q).at[:R].set(out.astype(q.dtype))


# jitted so that a model's layers share one trace of it per program (XLA inlines the call): the
# per-layer traces of this op were about half of a CPU step program's trace time
@functools.partial(jax.jit, static_argnames=("scale", "window", "softcap", "kv_chunk_blocks"))
def paged_attention(q, k_pages, v_pages, md: AttentionMetadata, *, scale: float,
                    window: int | None = None, softcap: float | None = None, kv_chunk_blocks: int = 16):
    """q [T, H, D] -> [T, H, D]. Reads K/V (including this step's tokens) from the pages (arrays,
    or fp8 `QuantizedPages`: their scales multiply the scores and the probabilities, see kv_quant).
    `softcap`: scores s = scale * q.k become softcap * tanh(s / softcap) before masking (Gemma 2)."""
    T, H, D = q.shape
    KH, _, bs, _ = k_pages.shape
    quantized = isinstance(k_pages, QuantizedPages)
    G = H // KH
    NT, Qt = md.tile_token_idx.shape
    W = md.block_tables.shape[1]
    cb = min(kv_chunk_blocks, W)
    assert W % cb == 0, (W, cb)
    chunk = cb * bs

    q_ext = jnp.concatenate([q, jnp.zeros((1, H, D), q.dtype)], axis=0)
    qt = q_ext[md.tile_token_idx].reshape(NT, Qt, KH, G, D)
    pos_ext = jnp.concatenate([md.positions, jnp.full((1,), -1, md.positions.dtype)])
    qpos = pos_ext[md.tile_token_idx]  # [NT, Qt]
    bt = md.block_tables[md.tile_req]  # [NT, W]

    max_pos = jnp.max(qpos)
    n_chunks = jnp.minimum((max_pos + chunk) // chunk, W // cb)  # ceil((max_pos + 1) / chunk)
    if window is not None:
        valid_min = jnp.min(jnp.where(qpos >= 0, qpos, jnp.iinfo(jnp.int32).max))
        first = jnp.clip((valid_min - window + 1) // chunk, 0, n_chunks)
    else:
        first = jnp.int32(0)

    def body(c, carry):
        m, l, acc = carry
        blocks = jax.lax.dynamic_slice_in_dim(bt, c * cb, cb, axis=1)  # [NT, cb]
        if quantized:  # fp8 rows widen exactly to q's dtype; scales [KH, NT, chunk] -> [NT, KH, 1, 1, chunk]
            (kc, ks), (vc, vs) = k_pages.block_rows(blocks), v_pages.block_rows(blocks)
            kc, vc = kc.reshape(KH, NT, chunk, D).astype(q.dtype), vc.reshape(KH, NT, chunk, D).astype(q.dtype)
            ks, vs = (a.reshape(KH, NT, chunk).transpose(1, 0, 2)[:, :, None, None, :].astype(jnp.float32)
                      for a in (ks, vs))
        else:
            kc = k_pages[:, blocks].reshape(KH, NT, chunk, D)
            vc = v_pages[:, blocks].reshape(KH, NT, chunk, D)
        s = jnp.einsum("nqhgd,hnkd->nhgqk", qt, kc, preferred_element_type=jnp.float32) * scale
        if quantized:
            s = s * ks
        if softcap is not None:
            s = softcap * jnp.tanh(s / softcap)
        kpos = c * chunk + jnp.arange(chunk, dtype=jnp.int32)
        mask = kpos[None, None, :] <= qpos[:, :, None]
        if window is not None:
            mask &= kpos[None, None, :] > qpos[:, :, None] - window
        s = jnp.where(mask[:, None, None, :, :], s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        m_safe = jnp.where(jnp.isneginf(m_new), 0.0, m_new)
        p = jnp.exp(s - m_safe[..., None])
        corr = jnp.exp(m - m_safe)
        l = l * corr + jnp.sum(p, axis=-1)
        pv = jnp.einsum("nhgqk,hnkd->nhgqd", (p * vs if quantized else p).astype(vc.dtype), vc,
                        preferred_element_type=jnp.float32)
        acc = acc * corr[..., None] + pv
        return m_new, l, acc

    init = (jnp.full((NT, KH, G, Qt), -jnp.inf, jnp.float32),
            jnp.zeros((NT, KH, G, Qt), jnp.float32),
            jnp.zeros((NT, KH, G, Qt, D), jnp.float32))
    _, l, acc = jax.lax.fori_loop(first, n_chunks, body, init)
    out = acc / jnp.where(l == 0, 1.0, l)[..., None]  # fully masked (padding) rows -> 0
    out = out.transpose(0, 3, 1, 2, 4).reshape(NT, Qt, H, D).astype(q.dtype)
    flat = jnp.zeros((T + 1, H, D), q.dtype).at[md.tile_token_idx].set(out)
    return flat[:T]


def build_metadata(starts, ns, tables, *, T: int, query_tile: int, num_tiles: int, block_size: int,
                   num_blocks: int) -> AttentionMetadata:
    """AttentionMetadata (numpy) of a ragged batch: request r computes ns[r] tokens at positions
    starts[r] .. starts[r]+ns[r]-1, laid out one request after another in the flat batch of T
    slots; `tables` [R, W] holds each request's block table. Query tiles hold up to `query_tile`
    consecutive tokens of one request (`num_tiles` rows, padded with T). Vectorized: the runner
    builds every step's metadata here."""
    import numpy as np

    starts, ns = np.asarray(starts, np.int64), np.asarray(ns, np.int64)
    R = tables.shape[0]
    nr, Qt, bs = len(ns), query_tile, block_size
    positions = np.full(T, -1, np.int32)
    slots = np.full(T, num_blocks * bs, np.int32)  # out of range: dropped
    tile_idx = np.full((num_tiles, Qt), T, np.int32)
    tile_req = np.zeros(num_tiles, np.int32)
    logits_idx = np.zeros(R, np.int32)
    if nr:
        off = int(ns.sum())
        offs = np.concatenate([[0], np.cumsum(ns)[:-1]])
        req_of_tok = np.repeat(np.arange(nr), ns)
        pos = (np.arange(off) - offs[req_of_tok] + starts[req_of_tok]).astype(np.int32)
        positions[:off] = pos
        slots[:off] = tables[req_of_tok, pos // bs] * bs + pos % bs
        logits_idx[:nr] = offs + ns - 1
        nt = -(-ns // Qt)                                        # tiles per request
        n_tiles = int(nt.sum())
        tile_req[:n_tiles] = np.repeat(np.arange(nr), nt)
        tile_first = np.concatenate([[0], np.cumsum(nt)[:-1]])
        k = np.arange(n_tiles) - tile_first[tile_req[:n_tiles]]  # tile index within its request
        t0 = offs[tile_req[:n_tiles]] + k * Qt                   # first token of each tile
        t_end = (offs + ns)[tile_req[:n_tiles]]
        cols = t0[:, None] + np.arange(Qt)[None, :]
        tile_idx[:n_tiles] = np.where(cols < t_end[:, None], cols, T)
    return AttentionMetadata(positions=positions, slot_mapping=slots, block_tables=tables,
                             tile_token_idx=tile_idx, tile_req=tile_req, logits_indices=logits_idx)


def example_metadata(spans, *, T: int, R: int, query_tile: int, block_size: int, table_width: int,
                     num_blocks: int, seed: int = 0) -> AttentionMetadata:
    """Metadata of a synthetic ragged batch for kernel tests and benchmarks, through the runner's
    own `build_metadata`. `spans` lists (start, n) per request: n new tokens at positions
    start .. start+n-1, so the request's context is start + n tokens. Blocks are drawn at random
    from 1 .. num_blocks-1 (0 is the null block), so the pages of a request are not contiguous."""
    import numpy as np

    if len(spans) > R or sum(n for _, n in spans) > T:
        raise ValueError(f"{len(spans)} requests / {sum(n for _, n in spans)} tokens exceed R={R} / T={T}")
    rng = np.random.default_rng(seed)
    free = list(rng.permutation(np.arange(1, num_blocks)))
    tables = np.zeros((R, table_width), np.int32)
    for r, (start, n) in enumerate(spans):
        nblk = -(-(start + n) // block_size)
        if nblk > table_width or nblk > len(free):
            raise ValueError(f"request {r} needs {nblk} blocks (table width {table_width}, {len(free)} free)")
        tables[r, :nblk] = [free.pop() for _ in range(nblk)]
    return build_metadata([s for s, _ in spans], [n for _, n in spans], tables, T=T, query_tile=query_tile,
                          num_tiles=R + -(-T // query_tile), block_size=block_size, num_blocks=num_blocks)
