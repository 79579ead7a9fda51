"""On-device sampling: logits never leave the device; the host gets token ids (and logprobs when
asked). One program per request-count bucket and per `extras` variant (penalties / logit bias /
min_tokens need the token history, allowed_token_ids / bad_words a per-row vocabulary mask; plain
sampling ships neither).

Per row: raw logits -> [repetition, presence, frequency penalties, logit bias, mask] -> greedy argmax,
or temperature -> min_p -> top_k -> top_p -> Gumbel-max draw with the key
fold_in(key(seed), output_index), so a request's draw depends only on its own seed and position,
never on what else is in the batch. Logprobs are the model's raw log-softmax (vLLM's default).

`branchless=True` (the runner's choice on GPUs): the program has no data-dependent control flow
(no `lax.cond`, no `while` of unknown trip count). XLA on GPUs runs those by copying the predicate
to the host and waiting for it, which makes every sampled step block the dispatcher on the step
before it.
Greedy rows, logprobs and the exact top_k / top_p of rows the candidates cannot decide are then
computed always and selected per row: about 65 extra passes over [R, V]. `branchless=False`
(CPUs, TPUs: conds run on the device) skips that work with conds; both give the same ids.
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
    want_logprobs: jax.Array  # [] bool: any row asked for logprobs (the host reads them only then)


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
    allow_bits: jax.Array    # [R, ceil(V / 32)] u32: bit v % 32 of word v // 32 set = token v may be sampled


def unpack_mask(bits, V: int):
    """[R, W] u32 packed bits (little-endian within each word) -> [R, V] bool."""
    if bits.shape[1] * 32 < V:
        raise ValueError(f"allow_bits has {bits.shape[1]} words, fewer than the {V} logits need")
    v = jnp.arange(V, dtype=jnp.uint32)
    return ((bits[:, v // 32] >> (v % 32)) & 1).astype(bool)


def apply_extras(logits, ex: SamplingExtras):
    """Penalties, logit bias, then the vocabulary mask (a masked token's logit is -inf)."""
    R, V = logits.shape
    rows = jnp.arange(R)[:, None]
    hist = jnp.where(ex.hist_ids >= 0, ex.hist_ids, V)
    seen = jnp.zeros((R, V), bool).at[rows, hist].set(True, mode="drop")
    out_counts = jnp.zeros((R, V), jnp.float32).at[rows, hist].add(ex.hist_is_out.astype(jnp.float32), mode="drop")
    rep = ex.repetition[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - ex.frequency[:, None] * out_counts - ex.presence[:, None] * (out_counts > 0)
    bias_ids = jnp.where(ex.bias_ids >= 0, ex.bias_ids, V)
    logits = logits.at[rows, bias_ids].add(ex.bias_vals, mode="drop")
    return jnp.where(unpack_mask(ex.allow_bits, V), logits, -jnp.inf)


TOPK_CANDIDATES = 1024


def _gumbel(sb: SamplingBatch, n: int):
    def one(kd, c):
        key = jax.random.fold_in(jax.random.wrap_key_data(kd, impl="threefry2x32"), c)
        return jax.random.gumbel(key, (n,), jnp.float32)

    return jax.vmap(one)(sb.key_data, sb.counter)


def _ukey(x):
    """float32 -> uint32 whose unsigned order is the float order (-inf lowest, -0.0 just below
    +0.0): the sign-magnitude bits with the magnitude flipped for negatives, then offset."""
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return jax.lax.bitcast_convert_type(key, jnp.uint32) ^ jnp.uint32(0x80000000)


def _bisect(pred, R):
    """The largest uint32 t with pred(t) true, for a predicate [R] -> [R] bool that is monotone
    (true up to some t, false above) and true at 0: one bit per step from the top, 32 steps
    unrolled in Python (no `while` in the program)."""
    t = jnp.zeros((R,), jnp.uint32)
    for b in range(31, -1, -1):
        c = t | jnp.uint32(1 << b)
        t = jnp.where(pred(c), c, t)
    return t


def _threshold_sample(x, sb: SamplingBatch, g):
    """Exact top_k / top_p over the whole vocabulary without a sort or any data-dependent control
    flow: each threshold is found by bisection over the order-preserving uint32 key of the values
    (32 passes over [R, V] each, a count for top_k and a probability mass for top_p).

    top_k keeps keys >= the k-th largest key; top_p (over the top_k-filtered distribution) keeps
    keys >= the largest threshold whose mass reaches top_p * the filtered mass, i.e. the smallest
    prefix by value whose mass reaches top_p (a full sort's nucleus). Tokens whose value ties with
    a threshold value are all kept (a sort keeps only as many of them as it needs); the best token
    is always kept. The draw is the Gumbel-max over the kept tokens with the noise `g` [R, V]."""
    R, V = x.shape
    u = _ukey(x)
    mx = jnp.max(x, axis=-1, keepdims=True)
    umax = _ukey(mx[:, 0])
    k = jnp.minimum(sb.top_k, V)
    tk = _bisect(lambda c: jnp.sum(u >= c[:, None], axis=-1, dtype=jnp.int32) >= k, R)
    tk = jnp.where(sb.top_k >= V, jnp.uint32(0), jnp.minimum(tk, umax))
    e = jnp.exp(x - mx)

    def mass(c):
        return jnp.sum(jnp.where(u >= c[:, None], e, 0.0), axis=-1)

    # mass(c) is monotone in c (the same reduction with terms dropped); below tk it only grows,
    # so the search over all keys lands at or above tk.
    want = sb.top_p * mass(tk)
    tp = _bisect(lambda c: mass(c) >= want, R)
    t = jnp.where(sb.top_p < 1.0, jnp.minimum(tp, umax), tk)
    return jnp.argmax(jnp.where(u >= t[:, None], x, -jnp.inf) + g, axis=-1)


def _random_sample(x, sb: SamplingBatch, branchless: bool = True):
    """temperature -> min_p -> top_k -> top_p -> Gumbel-max draw, exactly, with no data-dependent
    control flow (XLA on GPUs runs `lax.cond` by copying the predicate to the host and waiting).

    Rows with top_k/top_p that the `TOPK_CANDIDATES` best tokens (lax.top_k) decide -- top_k fits
    and the top_p nucleus lies inside them -- draw among the candidates. Every other row (no
    truncation, or a top_k / nucleus wider than the candidates) draws over the whole vocabulary
    with thresholds found by bisection (`_threshold_sample`); both use the same Gumbel noise."""
    V = x.shape[1]
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
    g = _gumbel(sb, V)
    gi = jnp.take_along_axis(g, idx, axis=-1)
    part = jnp.take_along_axis(idx, jnp.argmax(cand + gi, axis=-1)[:, None], axis=-1)[:, 0]
    if branchless:
        full = _threshold_sample(x, sb, g)
    else:  # the exact path only when some truncating row needs it; else plain Gumbel-max
        full = jax.lax.cond(jnp.any(trunc & ~decided), lambda: _threshold_sample(x, sb, g),
                            lambda: jnp.argmax(x + g, axis=-1))
    return jnp.where(trunc & decided, part, full).astype(jnp.int32)


def apply_token_mask(logits, mask):
    """Structured outputs: logits [R, V] with the tokens whose bit is 0 in the packed mask
    (int32 [R, ceil(V / 32)], bit j of word i = token 32 * i + j) set to -inf."""
    V = logits.shape[1]
    bits = (mask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)[None, None, :]) & 1
    allowed = bits.reshape(mask.shape[0], -1)[:, :V].astype(bool)
    return jnp.where(allowed, logits, -jnp.inf)


def logprob_outputs(logits, tokens):
    """(logprob of `tokens`, their rank (1 = best), top-N ids, top-N logprobs) from raw logits."""
    lp = jax.nn.log_softmax(logits, axis=-1)
    tok_lp = jnp.take_along_axis(lp, tokens[:, None], axis=-1)[:, 0]
    rank = jnp.sum(lp > tok_lp[:, None], axis=-1).astype(jnp.int32) + 1
    top_lp, top_ids = jax.lax.top_k(lp, NUM_TOP_LOGPROBS)
    return tok_lp, rank, top_ids.astype(jnp.int32), top_lp


def sample(logits, sb: SamplingBatch, ex: SamplingExtras | None, branchless: bool = True):
    """logits [R, V] float32 -> (token ids [R], (logprob, rank, top ids, top logprobs)).
    `branchless`: no data-dependent control flow (see the module docstring); the ids are the same
    either way, and the logprob arrays are zeros without branches only when no row wants them."""
    raw = logits
    if ex is not None:
        logits = apply_extras(logits, ex)
    greedy_rows = sb.temperature <= 0.0
    greedy_tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if branchless:  # greedy rows and logprobs computed always, selected per row / read when asked
        tok = jnp.where(greedy_rows, greedy_tok, _random_sample(logits, sb, True))
        return tok, logprob_outputs(raw, tok)
    tok = jax.lax.cond(jnp.all(greedy_rows), lambda: greedy_tok,
                       lambda: jnp.where(greedy_rows, greedy_tok, _random_sample(logits, sb, False)))
    R = logits.shape[0]

    def no_lp():
        return (jnp.zeros((R,), jnp.float32), jnp.zeros((R,), jnp.int32),
                jnp.zeros((R, NUM_TOP_LOGPROBS), jnp.int32), jnp.zeros((R, NUM_TOP_LOGPROBS), jnp.float32))

    return tok, jax.lax.cond(sb.want_logprobs, lambda: logprob_outputs(raw, tok), no_lp)
