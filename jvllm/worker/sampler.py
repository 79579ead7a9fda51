"""Host side of on-device sampling: a batch's scheduled requests -> a `SamplerPlan`: the
`SamplerVariant` its sampler program computes and ONE int32 array [R, width] holding every per-row
input (one host-to-device transfer), laid out by `RowLayout`, which also unpacks it inside the
program (static slices, float fields bit-cast).

Columns, in order (floats as their int32 bits):
  base (every variant)   temperature, top_k, top_p, min_p, key (2 words), counter, flags,
                         n_bias, n_hist
  extras                 repetition, presence, frequency, bias ids [B], bias values [B],
                         history [L] (token id, + 2**30 for output tokens)
  mask                   the packed vocabulary mask [ceil(V / 32)] (bit j of word i = token 32 i + j)
Only a row's used prefix of bias / history is written (n_bias, n_hist say how much), and only
masked rows' mask words (flags say which): the rest of the array is left as np.empty gave it, and
the program selects it away (it never reaches a result), so a batch pays host work only for the
rows that use a feature.

Variant choice (`choose_variant`, per batch): exact (GPU programs: the smallest variant that covers
the rows) or, with `SamplerImpl.branchy`, the largest for the batch's inputs (conds skip the rest).
Batches with extras always take the largest (they pay [R, V] scatters anyway), which keeps the
variants to compile at 7 per request bucket.
"""
from __future__ import annotations

import dataclasses
import time

import numpy as np

from jvllm.bad_words import bad_word_bans
from jvllm.sampling import SamplerImpl, SamplerVariant, SamplingBatch, SamplingExtras, VocabMask
from jvllm.sampling_params import MAX_LOGIT_BIAS

BIAS_SLOTS = MAX_LOGIT_BIAS + 8  # logit_bias entries + min_tokens' forbidden EOS / stop ids
BASE_COLUMNS = ("temperature", "top_k", "top_p", "min_p", "key_hi", "key_lo", "counter", "flags", "n_bias", "n_hist")
FLAG_MASK = 1          # the row reads its mask words
FLAG_MASK_LOGPROBS = 2  # ... and its logprobs see the mask (grammar rows)
FLAG_LOGPROBS = 4      # the row wants logprobs
OUTPUT_TOKEN = 1 << 30  # history entry of an output token (prompt tokens are the plain id)


def key_data(seed: int) -> tuple[int, int]:
    s = seed & (2**64 - 1)
    return (s >> 32) & 0xFFFFFFFF, s & 0xFFFFFFFF


def mask_words(vocab_size: int) -> int:
    return -(-vocab_size // 32)


@dataclasses.dataclass(frozen=True)
class RowLayout:
    """The columns of one variant's packed per-row array."""
    R: int
    vocab_size: int
    max_model_len: int
    variant: SamplerVariant

    @property
    def extras_at(self) -> int:
        return len(BASE_COLUMNS)

    @property
    def mask_at(self) -> int:
        return self.extras_at + (3 + 2 * BIAS_SLOTS + self.max_model_len if self.variant.extras else 0)

    @property
    def width(self) -> int:
        return self.mask_at + (mask_words(self.vocab_size) if self.variant.mask else 0)

    def abstract(self, sharding=None):
        import jax

        return jax.ShapeDtypeStruct((self.R, self.width), np.int32, sharding=sharding)

    def unpack(self, rows):
        """(SamplingBatch, SamplingExtras | None, VocabMask | None) from the packed array, inside
        a program (jnp; static slices)."""
        import jax
        import jax.numpy as jnp

        if rows.shape != (self.R, self.width):
            raise ValueError(f"sampler rows of shape {rows.shape}; {self.variant} at R={self.R} needs {(self.R, self.width)}")
        f32 = lambda a: jax.lax.bitcast_convert_type(a, jnp.float32)  # noqa: E731
        col = {n: rows[:, i] for i, n in enumerate(BASE_COLUMNS)}
        flags = col["flags"]
        sb = SamplingBatch(f32(col["temperature"]), col["top_k"], f32(col["top_p"]), f32(col["min_p"]),
                           jax.lax.bitcast_convert_type(rows[:, 4:6], jnp.uint32), col["counter"],
                           jnp.any(flags & FLAG_LOGPROBS != 0))
        ex = mask = None
        if self.variant.extras:
            B, L, o = BIAS_SLOTS, self.max_model_len, self.extras_at
            b_ok = jnp.arange(B)[None, :] < col["n_bias"][:, None]
            h_ok = jnp.arange(L)[None, :] < col["n_hist"][:, None]
            hist = rows[:, o + 3 + 2 * B:o + 3 + 2 * B + L]
            ex = SamplingExtras(f32(rows[:, o]), f32(rows[:, o + 1]), f32(rows[:, o + 2]),
                                jnp.where(h_ok, hist & (OUTPUT_TOKEN - 1), -1), h_ok & (hist & OUTPUT_TOKEN != 0),
                                jnp.where(b_ok, rows[:, o + 3:o + 3 + B], -1),
                                jnp.where(b_ok, f32(rows[:, o + 3 + B:o + 3 + 2 * B]), 0.0))
        if self.variant.mask:
            mask = VocabMask(rows[:, self.mask_at:], flags & FLAG_MASK != 0, flags & FLAG_MASK_LOGPROBS != 0)
        return sb, ex, mask


@dataclasses.dataclass(frozen=True)
class SamplerPlan:
    variant: SamplerVariant
    rows: np.ndarray        # [R, RowLayout.width] int32
    want_lp: bool           # some row wants logprobs (the host reads them only then)
    mask_fill_s: float = 0.0  # host seconds spent filling vocabulary masks


def plain_greedy(p) -> bool:
    """Sampling params that the argmax-only program serves (no temperature, logprobs, penalties)."""
    return p.greedy and p.logprobs is None and not p.needs_extras and not p.logits_processors


def _penalized(p) -> bool:
    return p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 or p.repetition_penalty != 1.0


def min_tokens_bans(req, V: int) -> frozenset:
    """The ids a request may not sample yet: inside its min_tokens window, its stop_token_ids and
    the model's EOS ids, ignore_eos or not (vLLM adds the EOS to the ids min_tokens forbids
    regardless); empty past the window."""
    p = req.params
    if req.num_output_tokens >= p.min_tokens:
        return frozenset()
    return frozenset(t for t in (*p.stop_token_ids, *req.eos_token_ids) if 0 <= t < V)


def _bans_overflow(req, banned) -> bool:
    """Whether `banned` does not fit the bias slots beside the request's logit_bias: then the row's
    vocabulary mask bans them instead (any number of ids)."""
    return len(set(req.params.logit_bias or ()) | banned) > BIAS_SLOTS


def _min_tokens_masked(req, V: int) -> frozenset:
    """The request's min_tokens bans when they go through its vocabulary mask this step (too many
    for the bias slots), else empty."""
    banned = min_tokens_bans(req, V) if req.params.min_tokens else frozenset()
    return banned if banned and _bans_overflow(req, banned) else frozenset()


def _mask_row(s, V: int) -> int:
    """FLAG bits of a row's vocabulary mask (0: none)."""
    if not getattr(s, "samples", True):
        return 0
    if s.req.grammar is not None:
        return FLAG_MASK | FLAG_MASK_LOGPROBS
    return FLAG_MASK if s.req.params.needs_mask or _min_tokens_masked(s.req, V) else 0


def choose_variant(scheduled, vocab_size: int, impl: SamplerImpl, full: bool = False) -> SamplerVariant:
    """The variant that serves `scheduled`: the smallest that covers its rows; with `impl.branchy`
    or `full` (batch-invariant mode) the largest for its inputs (extras, mask); with extras every
    search, top_k by the group select unless a row's top_k is past it."""
    k = p = wide = lp = extras = mask = False
    for s in scheduled:
        sp = s.req.params
        if not sp.greedy:
            k, p = k or 0 < sp.top_k < vocab_size, p or sp.top_p < 1.0
            wide |= impl.narrow_top_k < sp.top_k < vocab_size
        lp |= sp.needs_logprobs
        extras |= _penalized(sp) or bool(sp.logit_bias) or sp.min_tokens > 0
        mask |= _mask_row(s, vocab_size) != 0
    if impl.branchy or full:
        return SamplerVariant(3, True, extras, mask)
    if extras or wide:  # extras batches (scatters over [R, V] already) and a top_k past the group
        return SamplerVariant(3, True, extras, mask, wide_top_k=wide)  # select's: every search
    return SamplerVariant((2 if k else 0) | (1 if p else 0), lp, extras, mask, wide_top_k=False)


def plan(scheduled, R: int, vocab_size: int, max_model_len: int, impl: SamplerImpl,
         full: bool = False) -> SamplerPlan | None:
    """The sampler inputs of `scheduled` (rows padded to R), or None when every row is plain greedy
    and unmasked (the argmax-only program serves the batch and needs no inputs). `full`: the
    largest variant for every other batch (batch-invariant mode: one sampler program for every
    batch that samples)."""
    if all(plain_greedy(s.req.params) for s in scheduled) and not any(_mask_row(s, vocab_size) for s in scheduled):
        return None
    V, n = vocab_size, len(scheduled)
    lay = RowLayout(R, V, max_model_len, choose_variant(scheduled, V, impl, full))
    rows = np.empty((R, lay.width), np.int32)
    f = np.zeros((R, 4), np.float32)                 # temperature, top_k (as int below), top_p, min_p
    f[:, 2] = 1.0
    ints = np.zeros((R, len(BASE_COLUMNS)), np.int64)
    ints[:, 1] = V
    for r, s in enumerate(scheduled):
        sp, req = s.req.params, s.req
        f[r, 0] = 0.0 if sp.greedy else sp.temperature
        f[r, 2], f[r, 3] = sp.top_p, sp.min_p
        ints[r, 1] = V if sp.top_k <= 0 else min(sp.top_k, V)
        ints[r, 4:6] = key_data(req.seed)
        ints[r, 6] = req.num_output_tokens + req.num_pending  # index of the token drawn now
        ints[r, 7] = _mask_row(s, V) | (FLAG_LOGPROBS if sp.needs_logprobs else 0)
    rows[:, :len(BASE_COLUMNS)] = ints.astype(np.uint32).view(np.int32)
    fb = f.view(np.int32)
    rows[:, 0], rows[:, 2], rows[:, 3] = fb[:, 0], fb[:, 2], fb[:, 3]
    if lay.variant.extras:
        _fill_extras(rows, lay, scheduled)
    t = time.perf_counter()
    if lay.variant.mask:
        _fill_masks(rows[:n, lay.mask_at:], scheduled, V)
    return SamplerPlan(lay.variant, rows, any(s.req.params.needs_logprobs for s in scheduled), time.perf_counter() - t)


def _fill_extras(rows: np.ndarray, lay: RowLayout, scheduled):
    o, B, L, V = lay.extras_at, BIAS_SLOTS, lay.max_model_len, lay.vocab_size
    pen = np.zeros((rows.shape[0], 3), np.float32)
    pen[:, 0] = 1.0
    for r, s in enumerate(scheduled):
        req, p = s.req, s.req.params
        pen[r] = p.repetition_penalty, p.presence_penalty, p.frequency_penalty
        if _penalized(p):
            toks = np.asarray(req.all_token_ids[:L], np.int32)
            toks[req.num_prompt_tokens:] |= OUTPUT_TOKEN
            rows[r, o + 3 + 2 * B:o + 3 + 2 * B + len(toks)] = toks
            rows[r, 9] = len(toks)
        bias = dict(p.logit_bias or {})
        banned = min_tokens_bans(req, V)
        if banned and not _bans_overflow(req, banned):  # else the row's mask bans them (`_mask_row`)
            bias.update((t, -np.inf) for t in banned)
        items = list(bias.items())
        assert len(items) <= B, (len(items), B)  # SamplingParams caps logit_bias at MAX_LOGIT_BIAS
        if items:
            rows[r, o + 3:o + 3 + len(items)] = [k for k, _ in items]
            rows[r, o + 3 + B:o + 3 + B + len(items)] = np.asarray([v for _, v in items], np.float32).view(np.int32)
            rows[r, 8] = len(items)
    rows[:, o:o + 3] = pen.view(np.int32)


def _fill_masks(words: np.ndarray, scheduled, V: int):
    """Each masked row's words: its grammar's allowed tokens, AND its allowed_token_ids /
    bad_words mask (a row with both gets the intersection)."""
    for r, s in enumerate(scheduled):
        flags = _mask_row(s, V)
        if not flags:
            continue
        if s.req.grammar is not None:
            words[r] = 0
            s.req.grammar.fill(words[r])
            if s.req.params.needs_mask or _min_tokens_masked(s.req, V):
                words[r] &= allow_bits(s.req, V).view(np.int32)
        else:
            words[r] = allow_bits(s.req, V).view(np.int32)


def allow_bits(req, V: int) -> np.ndarray:
    """The row's packed allowed_token_ids / bad_words mask ([ceil(V / 32)] u32): the request's
    allowed_token_ids (all when None) minus the bad-word tokens banned after its output so far."""
    p = req.params
    ok = np.zeros(mask_words(V) * 32, np.bool_)
    ok[p.allowed_token_ids if p.allowed_token_ids is not None else slice(0, V)] = True
    if req.bad_words_ids:
        bans = bad_word_bans(req.bad_words_ids, req.output_token_ids)
        if bans:
            ok[list(bans)] = False
    banned = _min_tokens_masked(req, V)  # too many for the bias slots (`_fill_extras`)
    if banned:
        ok[list(banned)] = False
    return np.packbits(ok, bitorder="little").view("<u4")


# ---------------------------------------------------------------------------- unpacked trees
def batch_layout(R: int) -> dict[str, tuple[tuple[int, ...], type]]:
    return dict(temperature=((R,), np.float32), top_k=((R,), np.int32), top_p=((R,), np.float32),
                min_p=((R,), np.float32), key_data=((R, 2), np.uint32), counter=((R,), np.int32),
                want_logprobs=((), np.bool_))


def abstract_inputs(R: int, max_model_len: int, vocab_size: int, extras: bool, sharding=None):
    """(SamplingBatch, SamplingExtras | None) of ShapeDtypeStructs: the unpacked trees, for programs
    that take them as separate arrays (speculative decoding's verify program)."""
    import jax

    L, B = max_model_len, BIAS_SLOTS
    ex_layout = dict(repetition=((R,), np.float32), presence=((R,), np.float32), frequency=((R,), np.float32),
                     hist_ids=((R, L), np.int32), hist_is_out=((R, L), np.bool_),
                     bias_ids=((R, B), np.int32), bias_vals=((R, B), np.float32))

    def tree(cls, layout):
        return cls(**{k: jax.ShapeDtypeStruct(shape, dt, sharding=sharding) for k, (shape, dt) in layout.items()})

    return tree(SamplingBatch, batch_layout(R)), (tree(SamplingExtras, ex_layout) if extras else None)
