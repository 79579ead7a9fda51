"""On-device sampling: logits never leave the device; the host gets token ids (and logprobs when
asked). One program per request-count bucket and per `extras` variant (penalties / logit bias /
min_tokens need the token history; plain sampling does not ship it).

Per row: raw logits -> [repetition, presence, frequency penalties, logit bias] -> greedy argmax,
or temperature -> min_p -> top_k -> top_p -> Gumbel-max draw with the key
fold_in(key(seed), output_index), so a request's draw depends only on its own seed and position,
never on what else is in the batch. Logprobs are the model's raw log-softmax (vLLM's default).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

NUM_TOP_LOGPROBS = 20


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingBatch:
    temperature: jax.Array   # [R] f32, 0 = greedy
    top_k: jax.Array         # [R] i32, >= vocab = off
    top_p: jax.Array         # [R] f32
    min_p: jax.Array         # [R] f32
    key_data: jax.Array      # [R, 2] u32 threefry key of the request's seed
    counter: jax.Array       # [R] i32 output index being sampled
    want_logprobs: jax.Array  # [] bool: any row asked for logprobs


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingExtras:
    repetition: jax.Array    # [R] f32 (1 = off)
    presence: jax.Array      # [R] f32
    frequency: jax.Array     # [R] f32
    hist_ids: jax.Array      # [R, L] i32 prompt + output ids, -1 pad
    hist_is_out: jax.Array   # [R, L] bool
    bias_ids: jax.Array      # [R, B] i32, -1 pad
    bias_vals: jax.Array     # [R, B] f32


def apply_extras(logits, ex: SamplingExtras):
    R, V = logits.shape
    rows = jnp.arange(R)[:, None]
    hist = jnp.where(ex.hist_ids >= 0, ex.hist_ids, V)
    seen = jnp.zeros((R, V), bool).at[rows, hist].set(True, mode="drop")
    out_counts = jnp.zeros((R, V), jnp.float32).at[rows, hist].add(ex.hist_is_out.astype(jnp.float32), mode="drop")
    rep = ex.repetition[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - ex.frequency[:, None] * out_counts - ex.presence[:, None] * (out_counts > 0)
    bias_ids = jnp.where(ex.bias_ids >= 0, ex.bias_ids, V)
    return logits.at[rows, bias_ids].add(ex.bias_vals, mode="drop")


TOPK_CANDIDATES = 1024


def _gumbel(sb: SamplingBatch, n: int):
    def one(kd, c):
        key = jax.random.fold_in(jax.random.wrap_key_data(kd, impl="threefry2x32"), c)
        return jax.random.gumbel(key, (n,), jnp.float32)

    return jax.vmap(one)(sb.key_data, sb.counter)


def _sorted_sample(x, sb: SamplingBatch):
    """Exact top_k / top_p over the whole vocabulary with one full sort (slow on CPUs: the
    fallback when the candidates below cannot decide a row)."""
    R, V = x.shape
    iota = jnp.broadcast_to(jnp.arange(V, dtype=jnp.int32), (R, V))
    neg_sorted, idx = jax.lax.sort_key_val(-x, iota, dimension=-1)
    xs = -neg_sorted
    rank = jnp.arange(V, dtype=jnp.int32)[None, :]
    xs = jnp.where(rank >= sb.top_k[:, None], -jnp.inf, xs)
    ps = jax.nn.softmax(xs, axis=-1)
    before = jnp.cumsum(ps, axis=-1) - ps
    xs = jnp.where((before >= sb.top_p[:, None]) & (sb.top_p[:, None] < 1.0) & (rank > 0), -jnp.inf, xs)
    choice = jnp.argmax(xs + _gumbel(sb, V), axis=-1)
    return jnp.take_along_axis(idx, choice[:, None], axis=-1)[:, 0]


def _random_sample(x, sb: SamplingBatch):
    """temperature -> min_p -> top_k -> top_p -> Gumbel-max draw, exactly.

    Fast path: rows without top_k/top_p draw over the whole vocabulary (no sort); rows with them
    draw among the `TOPK_CANDIDATES` best tokens (lax.top_k), which is exact when top_k fits and
    the top_p nucleus lies inside them. If any row's does not, the step takes the full-sort path."""
    R, V = x.shape
    x = x / jnp.maximum(sb.temperature, 1e-5)[:, None]
    probs = jax.nn.softmax(x, axis=-1)
    x = jnp.where(probs < sb.min_p[:, None] * jnp.max(probs, axis=-1, keepdims=True), -jnp.inf, x)
    K = min(TOPK_CANDIDATES, V)
    trunc = (sb.top_k < V) | (sb.top_p < 1.0)
    cand, idx = jax.lax.top_k(x, K)
    rank = jnp.arange(K, dtype=jnp.int32)[None, :]
    cand = jnp.where(rank >= sb.top_k[:, None], -jnp.inf, cand)
    # nucleus inside the candidates: mass relative to the full (top_k-filtered) distribution
    lse_all = jnp.where((sb.top_k < V)[:, None], jax.nn.logsumexp(cand, axis=-1, keepdims=True),
                        jax.nn.logsumexp(x, axis=-1, keepdims=True))
    pc = jnp.exp(cand - lse_all)
    cum = jnp.cumsum(pc, axis=-1)
    before = cum - pc
    cand = jnp.where((before >= sb.top_p[:, None]) & (sb.top_p[:, None] < 1.0) & (rank > 0), -jnp.inf, cand)
    decided = ((sb.top_k <= K) | (sb.top_k >= V)) & ((sb.top_p >= 1.0) | (cum[:, -1] >= sb.top_p))
    need_sort = jnp.any(trunc & ~decided)

    def fast():
        g = _gumbel(sb, V)
        full = jnp.argmax(x + g, axis=-1)
        gi = jnp.take_along_axis(g, idx, axis=-1)
        part = jnp.take_along_axis(idx, jnp.argmax(cand + gi, axis=-1)[:, None], axis=-1)[:, 0]
        return jnp.where(trunc, part, full).astype(jnp.int32)

    return jax.lax.cond(need_sort, lambda: _sorted_sample(x, sb).astype(jnp.int32), fast)


def logprob_outputs(logits, tokens):
    """(logprob of `tokens`, their rank (1 = best), top-N ids, top-N logprobs) from raw logits."""
    lp = jax.nn.log_softmax(logits, axis=-1)
    tok_lp = jnp.take_along_axis(lp, tokens[:, None], axis=-1)[:, 0]
    rank = jnp.sum(lp > tok_lp[:, None], axis=-1).astype(jnp.int32) + 1
    top_lp, top_ids = jax.lax.top_k(lp, NUM_TOP_LOGPROBS)
    return tok_lp, rank, top_ids.astype(jnp.int32), top_lp


def sample(logits, sb: SamplingBatch, ex: SamplingExtras | None):
    """logits [R, V] float32 -> dict of token ids [R] and logprob arrays."""
    raw = logits
    if ex is not None:
        logits = apply_extras(logits, ex)
    greedy_rows = sb.temperature <= 0.0
    greedy_tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    tok = jax.lax.cond(jnp.all(greedy_rows), lambda: greedy_tok,
                       lambda: jnp.where(greedy_rows, greedy_tok, _random_sample(logits, sb).astype(jnp.int32)))
    R = logits.shape[0]

    def no_lp():
        return (jnp.zeros((R,), jnp.float32), jnp.zeros((R,), jnp.int32),
                jnp.zeros((R, NUM_TOP_LOGPROBS), jnp.int32), jnp.zeros((R, NUM_TOP_LOGPROBS), jnp.float32))

    lp = jax.lax.cond(sb.want_logprobs, lambda: logprob_outputs(raw, tok), no_lp)
    return tok, lp
