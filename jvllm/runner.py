"""ModelRunner: turns a SchedulerOutput into device inputs, runs the compiled programs, returns ids.

Programs (all compiled ahead of time at start-up, one executable per bucket, see `warmup`):
  step[T]        (state, kv, tokens[T], md) -> (kv, last_hidden[R], hidden[T]); kv donated
  sample[R, ex]  (head_w, last_hidden[R], SamplingBatch, SamplingExtras|None) -> ids, logprobs
  prompt_lp[T]   (head_w, hidden[T], targets[T]) -> prompt logprobs (only when a request asks)
Buckets: `token_buckets` (T); the request bucket is R = min(T, max_num_seqs), so each token bucket
compiles exactly one model program. Inputs are numpy arrays built on the host and transferred
once per step; the host receives sampled ids (and logprobs only when some request wants them).

Hazard: anything here that calls a jnp function eagerly with a new shape compiles a tiny XLA
program at serving time; the compile counter (`jvllm.compile`) catches that in tests.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jvllm.config import ModelConfig, cdiv
from jvllm.ops.attention import AttentionMetadata
from jvllm.sampling import NUM_TOP_LOGPROBS, SamplingBatch, SamplingExtras, logprob_outputs, sample


def _key_data(seed: int) -> tuple[int, int]:
    s = seed & (2**64 - 1)
    return (s >> 32) & 0xFFFFFFFF, s & 0xFFFFFFFF


@dataclasses.dataclass
class StepResult:
    token_ids: np.ndarray                 # [R] sampled ids (rows of scheduled requests, in order)
    logprobs: tuple | None                # (tok_lp [R], rank [R], top_ids [R,N], top_lp [R,N]) or None
    prompt_logprobs: dict                 # row -> (positions, tok_lp, rank, top_ids, top_lp)


class ModelRunner:
    def __init__(self, cfg: ModelConfig, graphdef, state, head_w, *, dtype, block_size: int, num_blocks: int,
                 max_model_len: int, max_num_seqs: int, token_buckets: tuple[int, ...],
                 query_tile: int = 8, kv_chunk_blocks: int = 16, kv_sharding=None):
        self.cfg = cfg
        self.graphdef = graphdef
        self.state = state
        self.head_w = head_w
        self.dtype = jnp.dtype(dtype)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.token_buckets = tuple(sorted(token_buckets))
        self.query_tile = query_tile
        max_blocks = cdiv(max_model_len, block_size)
        self.kv_chunk_blocks = min(kv_chunk_blocks, max_blocks)
        self.table_width = cdiv(max_blocks, self.kv_chunk_blocks) * self.kv_chunk_blocks
        self.kv_sharding = kv_sharding
        self.kv = self._alloc_kv()
        self._step_fn = jax.jit(self._step_impl, donate_argnums=(1,))
        self._sample_fn = jax.jit(functools.partial(self._sample_impl, tied=cfg.tie_word_embeddings))
        self._plp_fn = jax.jit(functools.partial(self._plp_impl, tied=cfg.tie_word_embeddings))
        self._compiled: dict = {}

    # ------------------------------------------------------------------ memory
    def kv_shape(self):
        return (self.num_blocks, self.block_size, self.cfg.num_kv_heads, self.cfg.head_dim)

    def _alloc_kv(self):
        shape = self.kv_shape()
        zeros = jax.jit(lambda: jnp.zeros(shape, self.dtype), out_shardings=self.kv_sharding)
        return [(zeros(), zeros()) for _ in range(self.cfg.num_layers)]

    def release(self):
        """Drop device buffers (weights and KV pool) so their memory returns at once."""
        for arr in jax.tree_util.tree_leaves((self.kv, self.state, self.head_w)):
            if isinstance(arr, jax.Array) and not arr.is_deleted():
                arr.delete()
        self.kv = self.state = self.head_w = None
        self._compiled.clear()

    # ------------------------------------------------------------------ programs
    def _step_impl(self, state, kv, tokens, md):
        model = nnx.merge(self.graphdef, state)
        h, kv = model(tokens, kv, md, self.kv_chunk_blocks)
        return kv, h[md.logits_indices], h

    @staticmethod
    def _logits(w, h, tied):
        return jnp.dot(h, w.T if tied else w, preferred_element_type=jnp.float32)

    def _sample_impl(self, w, h, sb, ex, *, tied):
        return sample(self._logits(w, h, tied), sb, ex)

    def _plp_impl(self, w, h, targets, *, tied):
        return logprob_outputs(self._logits(w, h, tied), targets)

    # ------------------------------------------------------------------ buckets
    def bucket(self, n_tokens: int) -> int:
        for b in self.token_buckets:
            if b >= n_tokens:
                return b
        raise ValueError(f"{n_tokens} tokens exceed the largest token bucket {self.token_buckets[-1]}")

    def seq_bucket(self, t_bucket: int) -> int:
        return min(t_bucket, self.max_num_seqs)

    def _abstract_inputs(self, T: int):
        R = self.seq_bucket(T)
        NT = R + cdiv(T, self.query_tile)
        i32 = jnp.int32
        sds = jax.ShapeDtypeStruct
        md = AttentionMetadata(positions=sds((T,), i32), slot_mapping=sds((T,), i32),
                               block_tables=sds((R, self.table_width), i32),
                               tile_token_idx=sds((NT, self.query_tile), i32), tile_req=sds((NT,), i32),
                               logits_indices=sds((R,), i32))
        return sds((T,), i32), md, R

    def _abstract_sampling(self, R: int, extras: bool):
        sds, f32, i32 = jax.ShapeDtypeStruct, jnp.float32, jnp.int32
        sb = SamplingBatch(temperature=sds((R,), f32), top_k=sds((R,), i32), top_p=sds((R,), f32),
                           min_p=sds((R,), f32), key_data=sds((R, 2), jnp.uint32), counter=sds((R,), i32),
                           want_logprobs=sds((), jnp.bool_))
        ex = None
        if extras:
            from jvllm.sampling_params import MAX_LOGIT_BIAS
            L, B = self.max_model_len, MAX_LOGIT_BIAS + 8
            ex = SamplingExtras(repetition=sds((R,), f32), presence=sds((R,), f32), frequency=sds((R,), f32),
                                hist_ids=sds((R, L), i32), hist_is_out=sds((R, L), jnp.bool_),
                                bias_ids=sds((R, B), i32), bias_vals=sds((R, B), f32))
        return sb, ex

    def programs(self):
        """Every (kind, key) this runner compiles at warm-up."""
        out = []
        for T in self.token_buckets:
            out.append(("step", T))
            out.append(("prompt_lp", T))
        for R in sorted({self.seq_bucket(T) for T in self.token_buckets}):
            out += [("sample", (R, False)), ("sample", (R, True))]
        return out

    def compile(self, kind, key):
        if (kind, key) in self._compiled:
            return self._compiled[(kind, key)]
        sds = jax.ShapeDtypeStruct
        hidden = self.cfg.hidden_size
        if kind == "step":
            tokens, md, R = self._abstract_inputs(key)
            kv_abs = jax.tree_util.tree_map(lambda a: sds(a.shape, a.dtype, sharding=a.sharding), self.kv)
            st_abs = jax.tree_util.tree_map(lambda a: sds(a.shape, a.dtype, sharding=a.sharding), self.state)
            exe = self._step_fn.lower(st_abs, kv_abs, tokens, md).compile()
        elif kind == "sample":
            R, extras = key
            sb, ex = self._abstract_sampling(R, extras)
            exe = self._sample_fn.lower(self.head_w, sds((R, hidden), self.dtype), sb, ex).compile()
        elif kind == "prompt_lp":
            exe = self._plp_fn.lower(self.head_w, sds((key, hidden), self.dtype), sds((key,), jnp.int32)).compile()
        else:
            raise KeyError(kind)
        self._compiled[(kind, key)] = exe
        return exe

    # ------------------------------------------------------------------ host inputs
    def prepare(self, scheduled):
        """numpy inputs for one step from a list of ScheduledRequest."""
        n_tok = sum(s.num_tokens for s in scheduled)
        T = self.bucket(n_tok)
        R = self.seq_bucket(T)
        if len(scheduled) > R:
            raise ValueError(f"{len(scheduled)} requests exceed the request bucket {R}")
        Qt, bs = self.query_tile, self.block_size
        NT = R + cdiv(T, Qt)
        tokens = np.zeros(T, np.int32)
        positions = np.full(T, -1, np.int32)
        slots = np.full(T, self.num_blocks * bs, np.int32)  # out of range: dropped
        tables = np.zeros((R, self.table_width), np.int32)
        tile_idx = np.full((NT, Qt), T, np.int32)
        tile_req = np.zeros(NT, np.int32)
        logits_idx = np.zeros(R, np.int32)
        off = tile = 0
        for r, s in enumerate(scheduled):
            n, start = s.num_tokens, s.start
            pos = np.arange(start, start + n, dtype=np.int32)
            tokens[off:off + n] = s.req.all_token_ids[start:start + n]
            positions[off:off + n] = pos
            bt = np.asarray(s.block_ids, np.int32)
            tables[r, :len(bt)] = bt
            slots[off:off + n] = bt[pos // bs] * bs + pos % bs
            for q0 in range(0, n, Qt):
                q1 = min(n, q0 + Qt)
                tile_idx[tile, :q1 - q0] = np.arange(off + q0, off + q1)
                tile_req[tile] = r
                tile += 1
            logits_idx[r] = off + n - 1
            off += n
        md = AttentionMetadata(positions=positions, slot_mapping=slots, block_tables=tables,
                               tile_token_idx=tile_idx, tile_req=tile_req, logits_indices=logits_idx)
        return T, R, tokens, md

    def _sampling_inputs(self, scheduled, R: int):
        V = self.cfg.vocab_size
        temp = np.zeros(R, np.float32)
        top_k = np.full(R, V, np.int32)
        top_p = np.ones(R, np.float32)
        min_p = np.zeros(R, np.float32)
        keys = np.zeros((R, 2), np.uint32)
        counter = np.zeros(R, np.int32)
        want_lp = False
        extras = any(s.req.params.needs_extras for s in scheduled)
        for r, s in enumerate(scheduled):
            p = s.req.params
            temp[r] = 0.0 if p.greedy else p.temperature
            top_k[r] = V if p.top_k <= 0 else min(p.top_k, V)
            top_p[r], min_p[r] = p.top_p, p.min_p
            keys[r] = _key_data(s.req.seed)
            counter[r] = s.req.num_output_tokens
            want_lp |= p.logprobs is not None
        sb = SamplingBatch(temp, top_k, top_p, min_p, keys, counter, np.bool_(want_lp))
        ex = None
        if extras:
            from jvllm.sampling_params import MAX_LOGIT_BIAS
            L, B = self.max_model_len, MAX_LOGIT_BIAS + 8
            rep = np.ones(R, np.float32)
            pres = np.zeros(R, np.float32)
            freq = np.zeros(R, np.float32)
            hist = np.full((R, L), -1, np.int32)
            is_out = np.zeros((R, L), bool)
            b_ids = np.full((R, B), -1, np.int32)
            b_vals = np.zeros((R, B), np.float32)
            for r, s in enumerate(scheduled):
                req, p = s.req, s.req.params
                if not p.needs_extras:
                    continue
                rep[r], pres[r], freq[r] = p.repetition_penalty, p.presence_penalty, p.frequency_penalty
                toks = req.all_token_ids[:L]
                hist[r, :len(toks)] = toks
                is_out[r, req.num_prompt_tokens:len(toks)] = True
                bias = dict(p.logit_bias or {})
                if req.num_output_tokens < p.min_tokens:  # min_tokens: forbid EOS / stop ids
                    for t in set(p.stop_token_ids) | (set() if p.ignore_eos else set(req.eos_token_ids)):
                        if 0 <= t < V:
                            bias[t] = -np.inf
                items = list(bias.items())[:B]
                if items:
                    b_ids[r, :len(items)] = [k for k, _ in items]
                    b_vals[r, :len(items)] = [v for _, v in items]
            ex = SamplingExtras(rep, pres, freq, hist, is_out, b_ids, b_vals)
        return sb, ex, want_lp

    # ------------------------------------------------------------------ execute
    def execute(self, scheduled) -> StepResult:
        T, R, tokens, md = self.prepare(scheduled)
        step = self.compile("step", T)
        self.kv, last_h, all_h = step(self.state, self.kv, tokens, md)
        sb, ex, want_lp = self._sampling_inputs(scheduled, R)
        tok, lp = self.compile("sample", (R, ex is not None))(self.head_w, last_h, sb, ex)
        plp = {}
        if any(s.req.needs_prompt_logprobs for s in scheduled):
            plp = self._prompt_logprobs(scheduled, T, all_h)
        token_ids = np.asarray(tok)[: len(scheduled)]
        lps = tuple(np.asarray(a)[: len(scheduled)] for a in lp) if want_lp else None
        return StepResult(token_ids, lps, plp)

    def _prompt_logprobs(self, scheduled, T, all_h):
        targets = np.zeros(T, np.int32)
        spans = {}
        off = 0
        for r, s in enumerate(scheduled):
            req = s.req
            if req.needs_prompt_logprobs:
                P = req.num_prompt_tokens
                hi = min(s.start + s.num_tokens, P - 1)
                if hi > s.start:
                    pos = np.arange(s.start, hi)
                    targets[off:off + len(pos)] = np.asarray(req.prompt_token_ids, np.int32)[pos + 1]
                    spans[r] = (off, pos)
            off += s.num_tokens
        if not spans:
            return {}
        out = [np.asarray(a) for a in self.compile("prompt_lp", T)(self.head_w, all_h, targets)]
        return {r: (pos, *(a[o:o + len(pos)] for a in out)) for r, (o, pos) in spans.items()}

    # ------------------------------------------------------------------ one-off forward
    def sequence_logits(self, token_ids) -> np.ndarray:
        """float32 logits [n, vocab] of one whole sequence, computed as one prefill through the
        paged path (blocks 1..k of this runner's pool, which it overwrites: for `jvllm verify` and
        tests, never on a runner that is serving). Compiles for each new length."""
        from types import SimpleNamespace

        ids = [int(t) for t in token_ids]
        n, bs = len(ids), self.block_size
        blocks = list(range(1, cdiv(n, bs) + 1))
        if blocks and blocks[-1] >= self.num_blocks:
            raise ValueError(f"{n} tokens need {len(blocks)} blocks; this runner's pool has {self.num_blocks - 1}")
        req = SimpleNamespace(all_token_ids=ids)
        sched = [SimpleNamespace(req=req, num_tokens=n, start=0, block_ids=blocks)]
        saved = self.token_buckets
        self.token_buckets = (n,)
        try:
            T, R, tokens, md = self.prepare(sched)
        finally:
            self.token_buckets = saved
        self.kv, _, h = self._step_fn(self.state, self.kv, tokens, md)
        return np.asarray(self._logits_fn(self.head_w, h))

    @functools.cached_property
    def _logits_fn(self):
        return jax.jit(functools.partial(self._logits, tied=self.cfg.tie_word_embeddings))
