"""On-device sampling: logits never leave the device; the host gets token ids (and logprobs when
asked).

Per row: raw logits -> [vocabulary mask, penalties, logit bias] -> greedy argmax, or temperature ->
min_p -> top_k -> top_p -> Gumbel-max draw with the key fold_in(key(seed), output_index), so a
request's draw depends only on its own seed and position, never on what else is in the batch.
Logprobs are the model's raw log-softmax (vLLM's default); rows constrained by a grammar see the
grammar mask in their logprobs, rows masked by allowed_token_ids / bad_words do not (vLLM's order).

Truncation without a sort. top_k: the kept tokens are those whose value is >= a per-row
threshold, found exactly by a radix search over the order-preserving uint32 key of the values
(`_radix_search`: `radix_bits` bits per pass over [R, V], each pass one variadic reduction of
2**radix_bits - 1 candidate counts, so 32 / radix_bits passes). Tokens that tie with the
threshold value are all kept (a full sort keeps only as many of them as it needs). When every
top_k row has k <= `SamplerImpl.narrow_top_k` (the usual 20-50) the same threshold comes from
group maxima and one small top_k instead (`_top_k_floor`, no pass per bit). top_p (over
what min_p and top_k kept): token j is in the nucleus iff the mass strictly above it,
sum(p where x > x_j), is below top_p (the best token always is). The draw is the Gumbel-max
token of the nucleus, argmax over it of x + g, found without locating the nucleus' edge: take the
best x + g among the tokens above `low` (first -inf); if it is in the nucleus it is the answer
(the nucleus lies above `low`), else every token at or below it is outside, so `low` rises to it
and the round repeats. One round of two reductions settles a row with probability >= top_p, so
most rows finish in the first. The answer is the same token a threshold search would draw with
the same noise; only the order of the float sums differs.

What a program computes is a `SamplerVariant`, decided per batch on the host (no truncation,
top_p, top_k, both; logprobs, extras, a vocabulary mask), so a batch pays only for what its rows
use. `SamplerImpl.branchy` (CPUs, TPUs: `lax.cond` and `while_loop` run on the device) instead
compiles the largest variant, skips unused parts with conds and loops the top-p rounds until
every row is done; on GPUs XLA runs a cond or a while by copying its predicate to the host and
waiting, which would block the dispatcher on every sampled step, so GPU programs have no
data-dependent control flow outside one Pallas kernel (the rows the first top-p round leaves,
looped on the device: `jvllm.ops.pallas_rejection`). Both give the same ids.
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


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class VocabMask:
    """One packed vocabulary mask for structured outputs and allowed_token_ids / bad_words."""
    words: jax.Array         # [R, ceil(V / 32)] i32: bit j of word i set = token 32 i + j may be sampled
    rows: jax.Array          # [R] bool: the row is masked (other rows' words are not read: any bits)
    before_logprobs: jax.Array  # [R] bool: the mask applies to the row's logprobs too (grammar rows)


@dataclasses.dataclass(frozen=True)
class SamplerVariant:
    """What one sampler program computes (part of its program key), decided per batch on the host.

    search: which truncations run, as bits: 1 = some row uses top_p (the rejection rounds), 2 =
    some row uses top_k (its threshold search); 0 = neither (a Gumbel-max over what min_p keeps),
    3 = both (the largest). logprobs: the logprob outputs. extras: penalties / logit
    bias / min_tokens. mask: a `VocabMask` input. wide_top_k: top_k by the radix search, for any k
    (the largest); else by the group select, for rows with top_k <= `SamplerImpl.narrow_top_k`
    only (normalized to False where search has no top_k)."""
    search: int = 3
    logprobs: bool = True
    extras: bool = False
    mask: bool = False
    wide_top_k: bool = True

    def __post_init__(self):
        if self.search not in (0, 1, 2, 3):
            raise ValueError(f"SamplerVariant.search must be 0, 1, 2 or 3, got {self.search!r}")
        if not self.search & 2:
            object.__setattr__(self, "wide_top_k", False)

    def __repr__(self) -> str:
        parts = [f"search={self.search}"] + [n for n in ("logprobs", "extras", "mask", "wide_top_k") if getattr(self, n)]
        return f"SamplerVariant({','.join(parts)})"


@dataclasses.dataclass(frozen=True)
class SamplerImpl:
    """How the sampler runs on a platform, chosen once at construction. radix_bits: bits of the
    threshold found per pass over [R, V] (1, 2 or 4; fewer passes with more candidate sums each:
    4 where passes are memory-bound, 1 on CPUs where compares cost). branchy: `lax.cond` skips the
    parts a batch does not use (only where conds do not block the host: not on GPUs).
    fixed_order_sums: every sum over the vocabulary (top-p mass, the threshold search's sums,
    log-softmax) in a fixed order whatever the number of rows (`jvllm.ops.fixed_order`:
    batch-invariant mode). looped_passes: the search's passes run as one `lax.fori_loop` body
    instead of unrolled (the same arithmetic, so the same ids): on CPUs, where 1-bit passes make 32
    unrolled passes per search that XLA takes seconds to compile (benchmarks/README.md); GPUs keep
    them unrolled (a while loop's trip test would be a device-to-host round trip per pass).
    rejection_rounds: top-p rounds run as XLA reductions over every row before the rows left go to
    the per-row Pallas tail (GPUs only; branchy platforms loop in XLA until every row is done).
    pallas_interpret: the tail kernel in interpret mode (None: unless the default backend is a GPU).
    narrow_top_k / top_k_group: the group select serves top_k <= narrow_top_k, in groups of
    top_k_group tokens (`_top_k_floor`)."""
    radix_bits: int = 4
    branchy: bool = False
    fixed_order_sums: bool = False
    looped_passes: bool = False
    rejection_rounds: int = 1
    pallas_interpret: bool | None = None
    narrow_top_k: int = 64
    top_k_group: int = 32

    def __post_init__(self):
        if self.radix_bits not in (1, 2, 4):
            raise ValueError(f"SamplerImpl.radix_bits must be 1, 2 or 4, got {self.radix_bits!r}")
        if self.narrow_top_k < 1 or self.top_k_group < 1:
            raise ValueError(f"SamplerImpl.narrow_top_k and top_k_group must be >= 1, got {self.narrow_top_k!r}, "
                             f"{self.top_k_group!r}")
        if self.rejection_rounds < 0:
            raise ValueError(f"SamplerImpl.rejection_rounds must be >= 0, got {self.rejection_rounds!r}")

    @staticmethod
    def for_platform(platform: str) -> "SamplerImpl":
        cpu = platform == "cpu"
        return SamplerImpl(radix_bits=1 if cpu else 4, branchy=platform != "gpu", looped_passes=cpu)


def apply_token_mask(logits, words):
    """logits [R, V] with the tokens whose bit is 0 in the packed mask (int32 [R, ceil(V / 32)],
    bit j of word i = token 32 * i + j) set to -inf."""
    return jnp.where(_allowed(words, logits.shape[1]), logits, -jnp.inf)


def _allowed(words, V: int):
    if words.shape[1] * 32 < V:
        raise ValueError(f"the vocabulary mask has {words.shape[1]} words, fewer than the {V} logits need")
    bits = (words[:, :, None] >> jnp.arange(32, dtype=jnp.int32)[None, None, :]) & 1
    return bits.reshape(words.shape[0], -1)[:, :V].astype(bool)


def apply_extras(logits, ex: SamplingExtras):
    """Logit bias (min_tokens' forbidden ids among it, at -inf), then the penalties (repetition
    over prompt + output, presence / frequency over output): vLLM's order (its logit-bias and
    min_tokens processors run before the penalties), and transformers' (SequenceBias before
    RepetitionPenalty). The order matters for repetition: it divides (x + b), not x."""
    R, V = logits.shape
    rows = jnp.arange(R)[:, None]
    bias_ids = jnp.where(ex.bias_ids >= 0, ex.bias_ids, V)
    logits = logits.at[rows, bias_ids].add(ex.bias_vals, mode="drop")
    hist = jnp.where(ex.hist_ids >= 0, ex.hist_ids, V)
    seen = jnp.zeros((R, V), bool).at[rows, hist].set(True, mode="drop")
    out_counts = jnp.zeros((R, V), jnp.float32).at[rows, hist].add(ex.hist_is_out.astype(jnp.float32), mode="drop")
    rep = ex.repetition[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    return logits - ex.frequency[:, None] * out_counts - ex.presence[:, None] * (out_counts > 0)


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


def _row_sum(x, impl: SamplerImpl):
    """Sum over the vocabulary axis (fixed order with `impl.fixed_order_sums`)."""
    if impl.fixed_order_sums:
        from jvllm.ops.fixed_order import tree_sum

        return tree_sum(x)
    return jnp.sum(x, axis=-1)


def _radix_search(u, w, target, bits: int, fixed_order: bool = False, looped: bool = False):
    """Per row, the largest uint32 t with sum(w where u >= t) >= target, for w >= 0 and a target
    the whole row's sum reaches (t = 0 qualifies). `bits` bits of t per pass, from the top: each
    pass sums w above the 2**bits - 1 candidate prefixes in one variadic reduction over [R, V] and
    keeps the number of candidates that reach the target (the sums fall as the candidate rises:
    the same reduction with terms dropped). No data-dependent control flow; `looped`: the passes
    as a fori_loop of a fixed trip count (`SamplerImpl.looped_passes`), unrolled otherwise."""
    n = (1 << bits) - 1

    def one_pass(t, shift):
        cands = [t | (jnp.uint32(j) << shift) for j in range(1, n + 1)]
        ops = tuple(jnp.where(u >= c[:, None], w, 0.0) for c in cands)
        if fixed_order:  # batch-invariant mode: one fixed pairwise tree per sum (jvllm.ops.fixed_order)
            from jvllm.ops.fixed_order import tree_sum

            sums = tuple(tree_sum(o) for o in ops)
        else:
            sums = jax.lax.reduce(ops, (jnp.float32(0),) * n, lambda a, b: tuple(x + y for x, y in zip(a, b)), (1,))
        digit = sum((s >= target).astype(jnp.uint32) for s in sums)
        return t | (digit << shift)

    t = jnp.zeros((u.shape[0],), jnp.uint32)
    if looped:
        shift_of = lambda i: jnp.uint32(32 - bits) - jnp.uint32(bits) * i.astype(jnp.uint32)  # noqa: E731
        return jax.lax.fori_loop(0, 32 // bits, lambda i, t: one_pass(t, shift_of(i)), t)
    for shift in range(32 - bits, -1, -bits):  # Python shifts: constant candidates
        t = one_pass(t, shift)
    return t


def _top_k_floor(x, k, kmax: int, G: int):
    """Per row, the k-th largest value of x [R, V] (with multiplicity; -inf past the finite ones),
    for 1 <= k <= kmax, without a pass per bit: the row's maxima per group of G tokens, the kmax
    groups with the largest maxima, then the k-th largest of their tokens. Exact: every token
    above the k-th largest group maximum m lies in one of those groups (fewer than k groups have
    a maximum above m), and they hold at least k tokens >= m (their maxima)."""
    R, V = x.shape
    n = -(-V // G)
    groups = jnp.pad(x, ((0, 0), (0, n * G - V)), constant_values=-jnp.inf).reshape(R, n, G)
    _, best = jax.lax.top_k(jnp.max(groups, axis=-1), min(kmax, n))
    cand = jnp.take_along_axis(groups, best[:, :, None], axis=1).reshape(R, -1)
    top, _ = jax.lax.top_k(cand, min(kmax, cand.shape[1]))
    return jnp.take_along_axis(top, jnp.clip(k, 1, top.shape[1])[:, None] - 1, axis=-1)[:, 0]


def _maybe(impl: SamplerImpl, pred, fn, other):
    """fn() where it is needed: under a cond when the platform allows (`other()` otherwise), else always."""
    return jax.lax.cond(pred, fn, other) if impl.branchy else fn()


def _top_p_draw(x, e, g, mx, target, use_p, impl: SamplerImpl):
    """Per row, argmax of x + g over the top-p set {j : sum(e where x > x_j) < target} (every row
    where ~use_p): rejection rounds (module docstring). Each round takes the best candidate above
    the row's `low`, keeps it if it is in the set, else raises `low` to it. Branchy platforms loop
    until every row is done; GPUs run `impl.rejection_rounds` rounds in XLA and finish the rows
    left in one Pallas program per row (`jvllm.ops.pallas_rejection`)."""
    R = x.shape[0]

    def round_(state):
        low, tok, done = state
        j = jnp.argmax(jnp.where(x > low[:, None], x + g, -jnp.inf), axis=-1).astype(jnp.int32)
        xj = jnp.take_along_axis(x, j[:, None], axis=-1)[:, 0]
        above = _row_sum(jnp.where(x > xj[:, None], e, 0.0), impl)
        ok = ~done & (~use_p | ~(xj > low) | (above < target))
        return jnp.where(done | ok, low, xj), jnp.where(ok, j, tok), done | ok

    state = (jnp.full((R,), -jnp.inf, jnp.float32), jnp.full((R,), -1, jnp.int32), jnp.zeros((R,), bool))
    if impl.branchy:
        return jax.lax.while_loop(lambda s: ~jnp.all(s[2]), round_, state)[1]
    for _ in range(impl.rejection_rounds):
        state = round_(state)
    from jvllm.ops.pallas_rejection import finish

    low, tok, done = state  # rows without top_p take their first candidate (also with no XLA round)
    return finish(x, g, mx, jnp.where(use_p, target, jnp.inf), low, jnp.where(done, tok, -1),
                  interpret=impl.pallas_interpret)


def _draw(x, sb: SamplingBatch, v: SamplerVariant, impl: SamplerImpl):
    """Token ids [R] from processed logits x [R, V]: greedy rows argmax, the others temperature ->
    min_p -> top_k -> top_p -> Gumbel-max over the kept tokens."""
    R, V = x.shape
    greedy = sb.temperature <= 0.0
    x = x / jnp.where(greedy, 1.0, jnp.maximum(sb.temperature, 1e-5))[:, None]
    x = jnp.where(x == 0.0, 0.0, x)  # -0.0 -> +0.0: float order is then the keys' order (`_ukey`)
    mx = jnp.max(x, axis=-1)
    e = jnp.exp(x - mx[:, None])
    drop = e < sb.min_p[:, None]  # min_p: p < min_p * p_max
    x = jnp.where(drop, -jnp.inf, x)
    e = jnp.where(drop, 0.0, e)
    use_k, use_p = (sb.top_k < V) & ~greedy, (sb.top_p < 1.0) & ~greedy
    if v.search & 2:
        if not v.wide_top_k:  # every top_k row has k <= impl.narrow_top_k
            keep = ~use_k[:, None] | (x >= _top_k_floor(x, sb.top_k, impl.narrow_top_k, impl.top_k_group)[:, None])
        else:  # top_k rows count tokens: the threshold key, then drop what lies below it
            u = _ukey(x)

            def top_k():
                found = _radix_search(u, jnp.ones_like(e), sb.top_k.astype(jnp.float32), impl.radix_bits,
                                      impl.fixed_order_sums, impl.looped_passes)
                return jnp.where(use_k, found, 0)

            keep = u >= _maybe(impl, jnp.any(use_k), top_k, lambda: jnp.zeros((R,), jnp.uint32))[:, None]
        x = jnp.where(keep, x, -jnp.inf)
        e = jnp.where(keep, e, 0.0)
    g = jnp.where(greedy[:, None], 0.0, _gumbel(sb, V))
    if not v.search & 1:
        return jnp.argmax(x + g, axis=-1).astype(jnp.int32)
    # top_p over what min_p and top_k kept (renormalized: the target is p times the kept mass)
    return _top_p_draw(x, e, g, mx, sb.top_p * _row_sum(e, impl), use_p, impl)


def logprob_outputs(logits, tokens, fixed_order: bool = False):
    """(logprob of `tokens`, their rank (1 = best), top-N ids, top-N logprobs) from raw logits.
    `fixed_order`: the log-softmax's sum in a fixed order whatever the number of rows
    (`jvllm.ops.fixed_order`: batch-invariant mode)."""
    if fixed_order:
        from jvllm.ops.fixed_order import log_softmax

        lp = log_softmax(logits)
    else:
        lp = jax.nn.log_softmax(logits, axis=-1)
    tok_lp = jnp.take_along_axis(lp, tokens[:, None], axis=-1)[:, 0]
    rank = jnp.sum(lp > tok_lp[:, None], axis=-1).astype(jnp.int32) + 1
    top_lp, top_ids = jax.lax.top_k(lp, NUM_TOP_LOGPROBS)
    return tok_lp, rank, top_ids.astype(jnp.int32), top_lp


def sample(logits, sb: SamplingBatch, ex: SamplingExtras | None = None, mask: VocabMask | None = None,
           variant: SamplerVariant | None = None, impl: SamplerImpl = SamplerImpl()):
    """logits [R, V] float32 -> (token ids [R] int32, (logprob, rank, top ids, top logprobs) or None).

    `variant` (default: the largest for the given inputs) must cover every row: search >= what
    the rows' top_k / top_p need, logprobs when a row wants them, extras / mask exactly when `ex` /
    `mask` are given (ValueError otherwise). Logprobs are None unless variant.logprobs; in a
    branchy program they are zeros when `sb.want_logprobs` is false."""
    v = variant or SamplerVariant(extras=ex is not None, mask=mask is not None)
    if v.extras != (ex is not None) or v.mask != (mask is not None):
        raise ValueError(f"{v} needs extras={v.extras} and mask={v.mask}; got extras={ex is not None}, "
                         f"mask={mask is not None}")
    raw = logits
    allowed = None
    if mask is not None:
        allowed = _allowed(mask.words, logits.shape[1]) | ~mask.rows[:, None]
        raw = jnp.where(allowed | ~mask.before_logprobs[:, None], logits, -jnp.inf)
    if ex is not None:
        logits = apply_extras(logits, ex)
    if allowed is not None:
        logits = jnp.where(allowed, logits, -jnp.inf)
    greedy_all = jnp.all(sb.temperature <= 0.0)
    tok = _maybe(impl, ~greedy_all, lambda: _draw(logits, sb, v, impl),
                 lambda: jnp.argmax(logits, axis=-1).astype(jnp.int32))
    if not v.logprobs:
        return tok, None
    R = logits.shape[0]

    def no_lp():
        return (jnp.zeros((R,), jnp.float32), jnp.zeros((R,), jnp.int32),
                jnp.zeros((R, NUM_TOP_LOGPROBS), jnp.int32), jnp.zeros((R, NUM_TOP_LOGPROBS), jnp.float32))

    return tok, _maybe(impl, sb.want_logprobs, lambda: logprob_outputs(raw, tok, impl.fixed_order_sums), no_lp)
