"""A step's host inputs: buckets, the packed input vector's layout, and `prepare` (scheduled
requests -> numpy arrays).

Buckets: `token_buckets` (T); the request bucket is R = min(T, max_num_seqs), so each token bucket
compiles exactly one model program (plus a decode-only variant for the small buckets). A step's
host inputs travel as ONE packed int32 vector (`pack`: tokens, their sources and the attention
metadata), so a step costs one host-to-device transfer per stage.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from jvllm.config import cdiv, smallest_bucket
from jvllm.ops.attention import AttentionMetadata, build_metadata


@dataclasses.dataclass
class PreparedStep:
    T: int                   # token bucket
    R: int                   # request bucket
    decode: bool             # decode-only variant (one query per tile)
    tokens: np.ndarray       # [T] int32 (0 where pending)
    md: AttentionMetadata
    src: np.ndarray          # [T] int32: row of the step in flight whose sampled id is this token, else -1


@dataclasses.dataclass(frozen=True)
class InputLayout:
    token_buckets: tuple[int, ...]
    max_num_seqs: int
    query_tile: int
    block_size: int
    num_blocks: int
    table_width: int         # block-table columns (a multiple of the attention's KV chunk)
    decode_variants: bool = True  # False: no decode-only program (batch-invariant mode)

    def __post_init__(self):
        object.__setattr__(self, "token_buckets", tuple(sorted(self.token_buckets)))

    def bucket(self, n_tokens: int) -> int:
        return smallest_bucket(self.token_buckets, n_tokens)

    def seq_bucket(self, t_bucket: int) -> int:
        return min(t_bucket, self.max_num_seqs)

    def has_decode_variant(self, T: int) -> bool:
        """Decode-only steps (T tokens = T requests <= max_num_seqs) land in buckets up to the first
        one that holds max_num_seqs; those get a one-query-tile program too (none when
        `decode_variants` is False)."""
        return self.decode_variants and T <= self.bucket(min(self.max_num_seqs, self.token_buckets[-1]))

    def tiling(self, T: int, decode: bool) -> tuple[int, int]:
        """(query tile size, number of tiles) of a bucket. A decode-only step uses tiles of one
        query (no padded-query work); a mixed step uses `query_tile` (each tile reads its request's
        pages once)."""
        R = self.seq_bucket(T)
        if decode:
            return 1, R
        return self.query_tile, R + cdiv(T, self.query_tile)

    def input_layout(self, T: int, decode: bool) -> list[tuple[str, tuple[int, ...]]]:
        """(name, shape) of each int32 field of a step's packed input vector, in order."""
        R = self.seq_bucket(T)
        Qt, NT = self.tiling(T, decode)
        return [("tokens", (T,)), ("src", (T,)), ("positions", (T,)), ("slot_mapping", (T,)),
                ("block_tables", (R, self.table_width)), ("tile_token_idx", (NT, Qt)), ("tile_req", (NT,)),
                ("logits_indices", (R,))]

    def packed_size(self, T: int, decode: bool) -> int:
        return sum(int(np.prod(shape)) for _, shape in self.input_layout(T, decode))

    def pack(self, p: PreparedStep) -> np.ndarray:
        """One int32 vector of a step's host inputs (layout `input_layout`), checked field by field."""
        fields = dict(tokens=p.tokens, src=p.src, **{k: getattr(p.md, k) for k in AttentionMetadata.__dataclass_fields__})
        parts = []
        for name, shape in self.input_layout(p.T, p.decode):
            a = np.asarray(fields[name])
            if a.shape != shape:
                raise ValueError(f"step input {name}: shape {a.shape}, bucket (T={p.T}, decode={p.decode}) needs {shape}")
            parts.append(a.reshape(-1).astype(np.int32, copy=False))
        return np.concatenate(parts)

    def unpack(self, packed, T: int, decode: bool):
        """(tokens, src, AttentionMetadata) from a packed vector (static slices, inside programs)."""
        out, off = {}, 0
        for name, shape in self.input_layout(T, decode):
            n = int(np.prod(shape))
            out[name] = packed[off:off + n].reshape(shape)
            off += n
        tokens, src = out.pop("tokens"), out.pop("src")
        return tokens, src, AttentionMetadata(**out)

    def prepare(self, scheduled, allow_decode: bool = True, prev_rows: dict | None = None) -> PreparedStep:
        """numpy inputs for one step from a list of ScheduledRequest. A request whose last token is
        still on the device (sampled by the step in flight, async scheduling) has it taken from that
        step's output: src[t] = its row there (`prev_rows[request_id]`), else -1. Raises
        RuntimeError for a request with more than that one token unknown."""
        n_tok = sum(s.num_tokens for s in scheduled)
        T = self.bucket(n_tok)
        R = self.seq_bucket(T)
        if len(scheduled) > R:
            raise ValueError(f"{len(scheduled)} requests exceed the request bucket {R}")
        decode = allow_decode and n_tok == len(scheduled) and self.has_decode_variant(T)
        Qt, NT = self.tiling(T, decode)
        tokens = np.zeros(T, np.int32)
        src = np.full(T, -1, np.int32)
        tables = np.zeros((R, self.table_width), np.int32)
        # one pass over the requests gathers Python lists (token ids and block tables live in
        # lists); each array is then filled by one numpy call, and the per-token and per-tile
        # arrays are built vectorized by build_metadata
        toks: list[int] = []
        ids: list[int] = []
        lens = []
        pend_at, pend_row = [], []
        for s in scheduled:
            n, start = s.num_tokens, s.start
            spec = getattr(s, "spec_token_ids", None) or []
            n_real = n - len(spec)  # speculative decoding: the drafts follow the request's real tokens
            known = s.req.all_token_ids[start:start + n_real]
            toks += known
            if len(known) < n_real:  # the one pending token (async scheduling), before any drafts
                if len(known) != n_real - 1 or prev_rows is None or s.req.request_id not in prev_rows:
                    raise RuntimeError(f"request {s.req.request_id}: {n_real - len(known)} input tokens are not known")
                pend_at.append(len(toks))
                pend_row.append(prev_rows[s.req.request_id])
                toks.append(0)
            toks += spec
            ids += s.block_ids
            lens.append(len(s.block_ids))
        ns = np.fromiter((s.num_tokens for s in scheduled), np.int64, len(scheduled))
        starts = np.fromiter((s.start for s in scheduled), np.int64, len(scheduled))
        tokens[:len(toks)] = toks
        if pend_at:
            src[pend_at] = pend_row
        if ids:
            lens_a = np.asarray(lens)
            row_of = np.repeat(np.arange(len(lens)), lens_a)
            col = np.arange(len(ids)) - np.repeat(np.cumsum(lens_a) - lens_a, lens_a)
            tables[row_of, col] = ids
        md = build_metadata(starts, ns, tables, T=T, query_tile=Qt, num_tiles=NT, block_size=self.block_size,
                            num_blocks=self.num_blocks)
        return PreparedStep(T, R, decode, tokens, md, src)
