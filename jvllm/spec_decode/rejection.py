"""Rejection sampler (device): verify up to k draft tokens per row against the target's logits.

Inputs per row r: the target's float32 logits at the row's k+1 verified positions (position j
predicts the token after draft j-1; position 0 follows the last real token), the drafts d[r, :k],
their number n_r (0..k; positions past n_r are padding), and the row's sampling parameters.

- Greedy rows (temperature 0): target token t_j = argmax of logits j; the accepted drafts are the
  longest prefix with d_j == t_j; the row emits those, then t_a (the correction, or on full
  acceptance the bonus token). The output is token-identical to decoding without speculation.
- Sampled rows: p_j is the target's distribution after temperature, min_p, top_k and top_p; q_j the
  proposer's (one-hot on d_j for a deterministic proposer such as n-gram). Draft j is accepted
  while u_j < p_j(d_j) / q_j(d_j) (u_j uniform); at the first rejection the row emits a token drawn
  from max(0, p_j - q_j) normalized (the recovered token); on full acceptance, a bonus token drawn
  from p_n. The emitted tokens then follow the target's distribution exactly (Leviathan et al.,
  Chen et al. 2023).

Randomness: position j of row r draws with key fold_in(key(seed), output index + j), split into
the uniform (fold 1) and the Gumbel noise of the recovered / bonus draw (fold 2): a request's draws
depend only on its seed, its position and its drafts, never on the rest of the batch.

Rows that need penalties, logit bias, masks or logits processors never speculate (the engine keeps
them plain), so raw logits are the target's logits here.
Hazard: runs inside jit only (called eagerly with a new shape it would compile at serving time).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jvllm.sampling import logprob_outputs


def processed_probs(logits, temperature, top_k, top_p, min_p):
    """[N, V] float32 probabilities after temperature -> min_p -> top_k -> top_p (the sampler's
    order; tokens tying with a threshold value are all kept, the best token always)."""
    N, V = logits.shape
    x = logits / jnp.maximum(temperature, 1e-5)[:, None]
    probs = jax.nn.softmax(x, axis=-1)
    x = jnp.where(probs < min_p[:, None] * jnp.max(probs, axis=-1, keepdims=True), -jnp.inf, x)
    srt = jnp.sort(x, axis=-1)[:, ::-1]
    k = jnp.clip(jnp.where(top_k <= 0, V, top_k), 1, V)
    kth = jnp.take_along_axis(srt, (k - 1)[:, None], axis=-1)
    x = jnp.where(x >= kth, x, -jnp.inf)
    srt = jnp.where(jnp.arange(V)[None, :] < k[:, None], srt, -jnp.inf)
    ps = jax.nn.softmax(srt, axis=-1)
    before = jnp.cumsum(ps, axis=-1) - ps
    keep = (before < top_p[:, None]) | (jnp.arange(V)[None, :] == 0)
    thr = jnp.min(jnp.where(keep, srt, jnp.inf), axis=-1, keepdims=True)
    x = jnp.where((top_p[:, None] < 1.0) & (x < thr), -jnp.inf, x)
    return jax.nn.softmax(x, axis=-1)


def _keys(key_data, counter, K1):
    """[R, K1] typed keys: fold_in(key(seed), counter + j)."""
    def row(kd, c):
        base = jax.random.wrap_key_data(kd, impl="threefry2x32")
        return jax.vmap(lambda j: jax.random.fold_in(base, c + j))(jnp.arange(K1))
    return jax.vmap(row)(key_data, counter)


def _draw(keys, w):
    """One token per [R, K1] key from unnormalized non-negative weights w [R, K1, V] (Gumbel-max)."""
    V = w.shape[-1]
    g = jax.vmap(jax.vmap(lambda k: jax.random.gumbel(jax.random.fold_in(k, 2), (V,), jnp.float32)))(keys)
    return jnp.argmax(jnp.where(w > 0, jnp.log(jnp.maximum(w, 1e-38)) + g, -jnp.inf), axis=-1).astype(jnp.int32)


def _emit(draft, accept, final):
    """(tokens [R, K1]: the accepted prefix of the drafts then final[a], num_accepted a [R])."""
    R, K1 = final.shape
    a = jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=-1), axis=-1).astype(jnp.int32)
    jj = jnp.arange(K1)[None, :]
    dpad = jnp.concatenate([draft, jnp.zeros((R, 1), jnp.int32)], axis=1)
    return jnp.where(jj < a[:, None], dpad, jnp.where(jj == a[:, None], final, 0)).astype(jnp.int32), a


def verify_greedy(logits, draft, num_draft):
    """Every row greedy (a static variant: no probabilities, no sort, no randomness)."""
    K = draft.shape[1]
    t = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return _emit(draft, (draft == t[:, :K]) & (jnp.arange(K)[None, :] < num_draft[:, None]), t)


def verify(logits, draft, num_draft, temperature, top_k, top_p, min_p, key_data, counter, draft_probs=None):
    """logits [R, K1, V] f32, draft [R, K] i32, num_draft [R] i32, sampling fields [R] (SamplingBatch
    layout), draft_probs [R, K, V] f32 or None (one-hot drafts) -> (tokens [R, K1], num_accepted [R]).
    Row r emits tokens[r, :num_accepted[r] + 1]; the rest is padding."""
    R, K1, V = logits.shape
    K = K1 - 1
    j = jnp.arange(K)[None, :]
    valid = j < num_draft[:, None]                                     # [R, K]
    greedy_tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)         # [R, K1]
    flat = logits.reshape(R * K1, V)
    rep = lambda a: jnp.repeat(a, K1, axis=0)  # noqa: E731
    p = processed_probs(flat, rep(temperature), rep(top_k), rep(top_p), rep(min_p)).reshape(R, K1, V)
    dj = jnp.clip(draft, 0, V - 1)
    if draft_probs is None:
        q = jax.nn.one_hot(dj, V, dtype=jnp.float32)                   # [R, K, V]
    else:
        q = draft_probs
    p_d = jnp.take_along_axis(p[:, :K], dj[..., None], axis=-1)[..., 0]
    q_d = jnp.take_along_axis(q, dj[..., None], axis=-1)[..., 0]
    keys = _keys(key_data, counter, K1)
    u = jax.vmap(jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, 1), (), jnp.float32)))(keys)[:, :K]
    greedy = (temperature <= 0.0)[:, None]
    accept = jnp.where(greedy, dj == greedy_tok[:, :K], u * q_d < p_d) & valid
    resid = jnp.maximum(p[:, :K] - q, 0.0)
    resid = jnp.where(jnp.sum(resid, -1, keepdims=True) > 0, resid, p[:, :K])  # p == q: never rejected
    w = jnp.concatenate([resid, p[:, K:]], axis=1)                     # [R, K1, V]
    w = jnp.where(jnp.arange(K1)[None, :, None] < num_draft[:, None, None], w, p)  # past the drafts: bonus from p
    final = jnp.where(greedy, greedy_tok, _draw(keys, w))              # [R, K1]
    return _emit(draft, accept, final)


def verify_body(w, h, idx, draft, num_draft, sb, base_pad, draft_probs, q_rows, *, logits_fn, want_lp,
                all_greedy=False):
    """The spec_verify program: hidden states h [T, hidden] of the step, idx [R, K1] the flat
    positions verified per row -> (tokens [R, K1], num_accepted [R], logprobs of the emitted
    tokens (tok_lp, rank, top ids, top lp) each [R, K1, ...] or None, next_pad). `draft_probs`
    [max_num_seqs, K, V] with `q_rows` [R] (each row's row in it) or both None. `base_pad`
    [max_num_seqs]: the step's sampled ids padded (zeros when no sampler ran); `next_pad` is it
    with each verified row's entry replaced by its last emitted token and accepted count
    (`jvllm.worker.pending_ids.encode`): the next step's prev_tok."""
    from jvllm.worker.pending_ids import encode

    R, K1 = idx.shape
    z = logits_fn(w, h[idx.reshape(-1)])                               # [R*K1, V] f32
    V = z.shape[-1]
    if all_greedy:  # the variant for batches whose speculating rows are all greedy
        tokens, a = verify_greedy(z.reshape(R, K1, V), draft, num_draft)
    else:
        q = None if draft_probs is None else draft_probs[jnp.maximum(q_rows, 0)]
        tokens, a = verify(z.reshape(R, K1, V), draft, num_draft, sb.temperature, sb.top_k, sb.top_p, sb.min_p,
                           sb.key_data, sb.counter, q)
    lp = None
    if want_lp:
        lp = tuple(x.reshape((R, K1) + x.shape[1:]) for x in logprob_outputs(z, tokens.reshape(-1)))
    last = jnp.take_along_axis(tokens, a[:, None], axis=1)[:, 0]
    next_pad = base_pad.at[:R].set(jnp.where(num_draft > 0, encode(last, a), base_pad[:R]))
    return tokens, a, lp, next_pad


def draft_sample_body(w, h, sb, dst, j, acc_p, acc_i, *, logits_fn, all_greedy=False):
    """The draft_sample program (draft model, one proposal round j): logits of h [R, hidden] ->
    each row's draft token (greedy rows: argmax; sampled rows: a draw from the draft's processed
    distribution q, key fold_in(fold_in(key(seed), counter + j), 3)), written with q into the
    accumulators acc_p [S, k, V] / acc_i [S, k] at row dst[r] (-1: not kept), column j.
    Returns (acc_p, acc_i, ids padded [S]: the next round's prev_tok). acc_* are donated."""
    z = logits_fn(w, h)
    R, V = z.shape
    S = acc_p.shape[0]
    rows = jnp.where(dst >= 0, dst, S)
    if all_greedy:  # every row greedy: argmax, one-hot q, no sort
        tok = jnp.argmax(z, axis=-1).astype(jnp.int32)
        acc_p = acc_p.at[rows, j].set(jax.nn.one_hot(tok, V, dtype=jnp.float32), mode="drop")
        acc_i = acc_i.at[rows, j].set(tok, mode="drop")
        return acc_p, acc_i, jnp.zeros((S,), jnp.int32).at[:R].set(tok)
    p = processed_probs(z, sb.temperature, sb.top_k, sb.top_p, sb.min_p)

    def noise(kd, c):
        key = jax.random.fold_in(jax.random.fold_in(jax.random.wrap_key_data(kd, impl="threefry2x32"), c + j), 3)
        return jax.random.gumbel(key, (V,), jnp.float32)

    g = jax.vmap(noise)(sb.key_data, sb.counter)
    greedy = (sb.temperature <= 0.0)[:, None]
    drawn = jnp.argmax(jnp.where(p > 0, jnp.log(jnp.maximum(p, 1e-38)) + g, -jnp.inf), axis=-1)
    tok = jnp.where(greedy[:, 0], jnp.argmax(z, axis=-1), drawn).astype(jnp.int32)
    q = jnp.where(greedy, jax.nn.one_hot(tok, V, dtype=jnp.float32), p)
    acc_p = acc_p.at[rows, j].set(q, mode="drop")
    acc_i = acc_i.at[rows, j].set(tok, mode="drop")
    return acc_p, acc_i, jnp.zeros((S,), jnp.int32).at[:R].set(tok)
