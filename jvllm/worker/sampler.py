"""Host side of on-device sampling: per-request parameters -> `SamplingBatch` / `SamplingExtras`
numpy arrays. The field layouts (`batch_layout`, `extras_layout`) are defined once here and used
both for the host arrays and for the sampler programs' abstract signature.
"""
from __future__ import annotations

import numpy as np

from jvllm.sampling import SamplingBatch, SamplingExtras
from jvllm.sampling_params import MAX_LOGIT_BIAS, bad_word_bans

BIAS_SLOTS = MAX_LOGIT_BIAS + 8  # logit_bias entries + min_tokens' forbidden EOS / stop ids


def key_data(seed: int) -> tuple[int, int]:
    s = seed & (2**64 - 1)
    return (s >> 32) & 0xFFFFFFFF, s & 0xFFFFFFFF


def batch_layout(R: int) -> dict[str, tuple[tuple[int, ...], type]]:
    return dict(temperature=((R,), np.float32), top_k=((R,), np.int32), top_p=((R,), np.float32),
                min_p=((R,), np.float32), key_data=((R, 2), np.uint32), counter=((R,), np.int32),
                want_logprobs=((), np.bool_))


def mask_words(vocab_size: int) -> int:
    return -(-vocab_size // 32)


def extras_layout(R: int, max_model_len: int, vocab_size: int) -> dict[str, tuple[tuple[int, ...], type]]:
    L, B = max_model_len, BIAS_SLOTS
    return dict(repetition=((R,), np.float32), presence=((R,), np.float32), frequency=((R,), np.float32),
                hist_ids=((R, L), np.int32), hist_is_out=((R, L), np.bool_),
                bias_ids=((R, B), np.int32), bias_vals=((R, B), np.float32),
                allow_bits=((R, mask_words(vocab_size)), np.uint32))


def abstract_inputs(R: int, max_model_len: int, vocab_size: int, extras: bool, sharding=None):
    """(SamplingBatch, SamplingExtras | None) of ShapeDtypeStructs for the sampler programs."""
    import jax

    def tree(cls, layout):
        return cls(**{k: jax.ShapeDtypeStruct(shape, dt, sharding=sharding) for k, (shape, dt) in layout.items()})

    return tree(SamplingBatch, batch_layout(R)), (tree(SamplingExtras, extras_layout(R, max_model_len, vocab_size))
                                           if extras else None)


def plain_greedy(p) -> bool:
    """Sampling params that the argmax-only program serves (no temperature, logprobs, penalties)."""
    return p.greedy and p.logprobs is None and not p.needs_extras and not p.logits_processors


def sampling_inputs(scheduled, R: int, vocab_size: int, max_model_len: int):
    """(SamplingBatch, SamplingExtras | None, any row wants logprobs) as numpy arrays for the rows of
    `scheduled` (padded to R). Extras are built only when some request needs them (penalties,
    logit bias, min_tokens, allowed_token_ids, bad_words)."""
    V = vocab_size
    temp = np.zeros(R, np.float32)
    top_k = np.full(R, V, np.int32)
    top_p = np.ones(R, np.float32)
    min_p = np.zeros(R, np.float32)
    keys = np.zeros((R, 2), np.uint32)
    counter = np.zeros(R, np.int32)
    want_lp = False
    extras = False
    for r, s in enumerate(scheduled):
        p = s.req.params
        temp[r] = 0.0 if p.greedy else p.temperature
        top_k[r] = V if p.top_k <= 0 else min(p.top_k, V)
        top_p[r], min_p[r] = p.top_p, p.min_p
        keys[r] = key_data(s.req.seed)
        counter[r] = s.req.num_output_tokens + s.req.num_pending  # index of the token drawn now
        want_lp |= p.needs_logprobs
        extras |= p.needs_extras
    sb = SamplingBatch(temp, top_k, top_p, min_p, keys, counter, np.bool_(want_lp))
    return sb, (_extras(scheduled, R, V, max_model_len) if extras else None), want_lp


def _extras(scheduled, R: int, V: int, max_model_len: int) -> SamplingExtras:
    lay = extras_layout(R, max_model_len, V)
    a = {k: np.zeros(shape, dt) for k, (shape, dt) in lay.items()}
    a["repetition"][:] = 1.0
    a["hist_ids"][:] = -1
    a["bias_ids"][:] = -1
    a["allow_bits"][:] = 0xFFFFFFFF
    L, B = lay["hist_ids"][0][1], lay["bias_ids"][0][1]
    for r, s in enumerate(scheduled):
        req, p = s.req, s.req.params
        if not p.needs_extras:
            continue
        a["repetition"][r], a["presence"][r], a["frequency"][r] = p.repetition_penalty, p.presence_penalty, p.frequency_penalty
        toks = req.all_token_ids[:L]
        a["hist_ids"][r, :len(toks)] = toks
        a["hist_is_out"][r, req.num_prompt_tokens:len(toks)] = True
        bias = dict(p.logit_bias or {})
        if req.num_output_tokens < p.min_tokens:  # min_tokens: forbid EOS / stop ids
            for t in set(p.stop_token_ids) | (set() if p.ignore_eos else set(req.eos_token_ids)):
                if 0 <= t < V:
                    bias[t] = -np.inf
        items = list(bias.items())[:B]
        if items:
            a["bias_ids"][r, :len(items)] = [k for k, _ in items]
            a["bias_vals"][r, :len(items)] = [v for _, v in items]
        if p.needs_mask:
            a["allow_bits"][r] = allow_bits(req, V)
    return SamplingExtras(**a)


# ---------------------------------------------------------------------------- structured outputs
def grammar_mask(scheduled, R: int, vocab_size: int) -> np.ndarray | None:
    """The packed token bitmask int32 [R, ceil(V / 32)] of a batch with constrained rows (each
    constrained request's `GrammarState` fills its row; other rows and padding allow every token),
    or None when no row is constrained (the unmasked programs serve the batch)."""
    rows = [(r, s.req.grammar) for r, s in enumerate(scheduled) if s.samples and s.req.grammar is not None]
    if not rows:
        return None
    from jvllm.structured import mask_words

    mask = np.full((R, mask_words(vocab_size)), -1, np.int32)
    for r, g in rows:
        mask[r] = 0
        g.fill(mask[r])
    return mask


def allow_bits(req, V: int) -> np.ndarray:
    """The row's packed vocabulary mask ([ceil(V / 32)] u32, `SamplingExtras.allow_bits`): the
    request's allowed_token_ids (all when None) minus the bad-word tokens banned after its output
    so far."""
    p = req.params
    ok = np.zeros(mask_words(V) * 32, np.bool_)
    ok[p.allowed_token_ids if p.allowed_token_ids is not None else slice(0, V)] = True
    if req.bad_words_ids:
        bans = bad_word_bans(req.bad_words_ids, req.output_token_ids)
        if bans:
            ok[list(bans)] = False
    return np.packbits(ok, bitorder="little").view("<u4")
