"""The model runner's device programs, each declared once and registered with the program registry
(`jvllm.compilation.registry`):

  step[s, T, decode]  (params, kv, packed, prev_tok | hidden[T]) -> (kv, last_hidden[R], hidden[T])
                      for the last stage, (kv, hidden[T]) for others; kv donated; `packed` is the
                      `InputLayout.pack` vector; the first stage takes prev_tok [max_num_seqs] (token
                      t is prev_tok[src[t]] where src[t] >= 0: the id sampled on the device by the
                      step before, async scheduling), later stages the previous stage's hidden states
  sample[R, variant]  (head_w, last_hidden[R], rows) -> ids, logprobs | None, ids padded; `rows` is the
                      batch's packed sampler inputs (`sampler.RowLayout` of the `SamplerVariant`
                      the host chose for the batch: truncation searches, logprobs, extras, the one
                      vocabulary mask of structured outputs / allowed_token_ids / bad_words).
                      Warm-up compiles the unmasked variants (`sample_variants`); masked ones
                      compile on the first batch that needs one
  greedy[R]           (head_w, last_hidden[R]) -> ids, ids padded: argmax only (no lax.cond: on GPUs
                      XLA runs a cond by copying its predicate to the host and blocking on it)
  prompt_lp[T]        (head_w, hidden[T], targets[T]) -> prompt logprobs (only when a request asks),
                      over row chunks of at most PROMPT_LP_CHUNK_ELEMS logits: a whole 8,192-token
                      step's float32 logits of a 152k vocabulary would be 5 GB, unbounded by the KV
                      pool's sizing (it counts the step and sampler programs)

"ids padded" is [max_num_seqs]: the next step's prev_tok (one shape, so the step programs need no
variant per request bucket). A program of a stage runs on that stage's devices; samplers and
prompt logprobs on the last stage's. A new program kind is one more `register(ProgramKind(...))`.

Hazard: the bodies run inside jit only; anything called eagerly with a new shape compiles a tiny
XLA program at serving time (the compile counter catches that in tests).
"""
from __future__ import annotations

import functools
import threading

import jax
import jax.numpy as jnp
from flax import nnx

from jvllm.compilation.registry import ProgramKind, Signature, register
from jvllm.models.layers import LMHead
from jvllm.ops.attention import tensor_parallel_mesh
from jvllm.sampling import SamplerVariant, logprob_outputs, sample
from jvllm.worker import pending_ids, sampler


def _pad_tok(tok, max_num_seqs: int):
    return jnp.zeros((max_num_seqs,), jnp.int32).at[:tok.shape[0]].set(tok)


def step_body(layout, graphdef, treedef, pack, first, last, attention, mesh, decode, kv_chunk_blocks,
              params, kv, packed, x, steer=None, *, T, capture: bool = False, shifted: bool = False):
    """`params`: the stage's `Stage.params()` (`param_pack.ParamPack` `pack`: the model's leaves,
    its small vectors concatenated). The step_research variant (single stage) adds: `capture`, one more output, every hidden
    state [num_layers + 1, T, hidden] (`jvllm.models.hooks.HiddenTap` numbering); `steer`, a
    (vectors [R, num_layers, hidden], row of each token [T]) input (`jvllm.models.hooks.Steer`).
    `shifted`: prev_tok may carry verified rows' accepted counts (`pending_ids`, n-gram speculation)."""
    from jvllm.models.hooks import Chain, HiddenTap, Steer

    tokens, src, md = layout.unpack(packed, T, decode)
    if first:
        x, md = pending_ids.take_pending(x, src, tokens, md, layout.block_size, shifted, decode)
    model = nnx.merge(graphdef, jax.tree_util.tree_unflatten(treedef, pack.unpack(params)))
    tap = HiddenTap() if capture else None
    hooks = Chain(Steer(*steer) if steer is not None else None, tap) if (tap or steer is not None) else None
    with tensor_parallel_mesh(mesh):  # Pallas kernels run per device on local KV heads
        h, kv = model(x, kv, md, kv_chunk_blocks, attention, hooks=hooks)
    out = (kv, h[md.logits_indices], h) if last else (kv, h)
    return out + (jnp.stack(tap.values),) if capture else out


def sample_body(w, h, rows, *, layout, impl, head, max_num_seqs):
    sb, ex, mask = layout.unpack(rows)
    tok, lp = sample(head(w, h), sb, ex, mask, layout.variant, impl)
    return tok, lp, _pad_tok(tok, max_num_seqs)


def sample_procs_body(w, h, rows, pi, *, layout, procs, impl, head, max_num_seqs):
    """User logits processors first (`jvllm.worker.logits_processors`), then the sampler."""
    from jvllm.worker.logits_processors import apply

    sb, ex, mask = layout.unpack(rows)
    tok, lp = sample(apply(procs, head(w, h), pi), sb, ex, mask, layout.variant, impl)
    return tok, lp, _pad_tok(tok, max_num_seqs)


def greedy_body(w, h, *, head, max_num_seqs):
    tok = jnp.argmax(head(w, h), axis=-1).astype(jnp.int32)
    return tok, _pad_tok(tok, max_num_seqs)


PROMPT_LP_CHUNK_ELEMS = 2**26  # float32 logits of one prompt-logprobs chunk (256 MB)


def prompt_lp_rows(T: int, V: int, budget: int = PROMPT_LP_CHUNK_ELEMS) -> int:
    """Rows of one prompt-logprobs chunk: T when T x V fits `budget` logits, else the largest power
    of two, at least 8, whose rows do (T is padded to a multiple of it)."""
    if T * V <= budget:
        return T
    c = 8
    while 2 * c * V <= budget:
        c *= 2
    return c


def prompt_lp_body(w, h, targets, *, head, budget: int):
    """logprob_outputs of hidden[T] through the head, `prompt_lp_rows` rows at a time (a lax.map:
    one chunk's logits live at once). Each row's figures do not depend on the chunking (the head and
    the log-softmax work row by row; batch-invariant mode sums in a fixed order). Hazard: the map is
    an HLO while loop, which XLA GPU runs with a host round trip a chunk; acceptable only because
    this program runs just for steps where a request asks for prompt logprobs."""
    T = h.shape[0]
    V = jax.eval_shape(head, w, h[:1]).shape[-1]
    c = prompt_lp_rows(T, V, budget)

    def one(h, t):
        return logprob_outputs(head(w, h), t, fixed_order=head.fixed_tile)  # batch-invariant mode

    if c >= T:
        return one(h, targets)
    n = -(-T // c)
    hp = jnp.pad(h, ((0, n * c - T), (0, 0))).reshape(n, c, h.shape[1])
    tp = jnp.pad(targets, (0, n * c - T)).reshape(n, c)
    outs = jax.lax.map(lambda a: one(*a), (hp, tp))
    return tuple(o.reshape(n * c, *o.shape[2:])[:T] for o in outs)


_cache_lock = threading.Lock()


def cached(ctx, k, build):
    """`build()` (a jitted fn, a mesh) under key `k`, built once per runner: the same jitted object
    serves AOT lowering and direct calls (the background warm-up thread asks too)."""
    fn = ctx.jit_cache.get(k)
    if fn is None:
        with _cache_lock:
            fn = ctx.jit_cache.get(k)
            if fn is None:
                fn = ctx.jit_cache[k] = build()
    return fn


def takes_accepted_counts(ctx) -> bool:
    """The step programs read verified rows' accepted counts from prev_tok (`pending_ids`): n-gram
    speculation (`ctx.spec` = (k, False), set before warm-up) on one stage, with token ids that
    leave the count its bits (`pending_ids.MAX_VOCAB`; else the step after a verify step waits)."""
    spec = getattr(ctx, "spec", None)
    return (spec is not None and not spec[1] and len(ctx.stages) == 1
            and ctx.cfg.vocab_size <= pending_ids.MAX_VOCAB)


def step_fn(ctx, s: int, decode: bool):
    st = ctx.stages[s]
    return cached(ctx, ("step", s, decode), lambda: jax.jit(functools.partial(
        step_body, ctx.layout, st.graphdef, st.treedef, st.pack, st.first, st.last, ctx.attention_modes[decode],
        st.mesh, decode, ctx.kv_chunk_blocks, shifted=takes_accepted_counts(ctx)), donate_argnums=(1,),
        static_argnames=("T",)))


def research_step_fn(ctx, decode: bool):
    """The single-stage step with hidden-state capture and / or steering (batches with a request
    that asks: `SamplingParams.return_hidden_states`, `SamplingParams.steering`)."""
    st = ctx.stages[0]
    return cached(ctx, ("step_research", decode), lambda: jax.jit(functools.partial(
        step_body, ctx.layout, st.graphdef, st.treedef, st.pack, st.first, st.last, ctx.attention_modes[decode],
        st.mesh, decode, ctx.kv_chunk_blocks, shifted=takes_accepted_counts(ctx)), donate_argnums=(1,),
        static_argnames=("T", "capture")))


def logits_fn(ctx):
    return cached(ctx, "logits", lambda: jax.jit(LMHead.of(ctx.cfg)))


def _sds(shape, dtype, sharding=None):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


def _like(tree):
    return jax.tree_util.tree_map(lambda a: _sds(a.shape, a.dtype, a.sharding), tree)


# ---------------------------------------------------------------------------- step
def _step_signature(ctx, key) -> Signature:
    s, T, decode = key
    st = ctx.stages[s]
    shard = st.sharding()
    packed = _sds((ctx.layout.packed_size(T, decode),), jnp.int32, shard)
    x = _sds((ctx.max_num_seqs,), jnp.int32, shard) if st.first else _sds((T, ctx.cfg.hidden_size), ctx.dtype, shard)
    return Signature(step_fn(ctx, s, decode), (_like(st.params()), _like(st.kv), packed, x),
                     tuple(st.devices()), dict(T=T))


def _step_keys(ctx) -> list:
    out = []
    for T in ctx.layout.token_buckets:
        for decode in (False, True) if ctx.layout.has_decode_variant(T) else (False,):
            out += [(s, T, decode) for s in range(len(ctx.stages))]
    return out


register(ProgramKind("step", _step_signature, _step_keys, owned=lambda ctx, key: ctx.local(key[0])))


def _research_step_signature(ctx, key) -> Signature:
    T, decode, capture, steer = key
    sig = _step_signature(ctx, (0, T, decode))
    st = ctx.stages[0]
    sv = None
    if steer:
        cfg = ctx.cfg
        sv = (_sds((ctx.layout.seq_bucket(T), cfg.num_layers, cfg.hidden_size), ctx.dtype, st.sharding()),
              _sds((T,), jnp.int32, st.sharding()))
    return Signature(research_step_fn(ctx, decode), sig.args + (sv,), sig.devices, dict(T=T, capture=capture))


# compiled on demand only (no warm-up): research variants that plain serving never pays for
register(ProgramKind("step_research", _research_step_signature, lambda ctx: [], owned=lambda ctx, key: True))


# ---------------------------------------------------------------------------- samplers
def _request_buckets(ctx) -> list[int]:
    return sorted({ctx.layout.seq_bucket(T) for T in ctx.layout.token_buckets})


def _last_owned(ctx, key) -> bool:
    return ctx.local(len(ctx.stages) - 1)


def _sample_signature(ctx, key) -> Signature:
    R, variant = key
    last = ctx.stages[-1]
    shard = last.sharding()
    layout = sampler.RowLayout(R, ctx.cfg.vocab_size, ctx.max_model_len, variant)
    fn = cached(ctx, "sample", lambda: jax.jit(functools.partial(
        sample_body, impl=ctx.sampler_impl, head=LMHead.of(ctx.cfg),
        max_num_seqs=ctx.max_num_seqs), static_argnames=("layout",)))
    return Signature(fn, (_like(ctx.head_w), _sds((R, ctx.cfg.hidden_size), ctx.dtype, shard), layout.abstract(shard)),
                     tuple(last.devices()), dict(layout=layout))


def sample_variants(impl) -> list[SamplerVariant]:
    """The unmasked variants a runner compiles before serving (`sampler.choose_variant` picks no
    other): where programs are exact (GPUs) every search level with and without logprobs and the
    largest with extras (top_k by the group select), and the largest (top_k by the radix search)
    with and without extras; elsewhere the largest with and without extras."""
    if impl.branchy:
        return [SamplerVariant(3, True, ex) for ex in (False, True)]
    narrow = [SamplerVariant(s, lp, wide_top_k=False) for s in (1, 0, 3, 2) for lp in (False, True)]
    return narrow + [SamplerVariant(3, True, True, wide_top_k=False)] + [SamplerVariant(3, True, ex) for ex in (False, True)]


def largest_sample_key(ctx, R: int):
    """The sampler program with the most work at R (its temporary memory bounds the others')."""
    return (R, SamplerVariant(3, True, True))


def _greedy_signature(ctx, R) -> Signature:
    last = ctx.stages[-1]
    fn = cached(ctx, "greedy", lambda: jax.jit(functools.partial(
        greedy_body, head=LMHead.of(ctx.cfg), max_num_seqs=ctx.max_num_seqs)))
    return Signature(fn, (_like(ctx.head_w), _sds((R, ctx.cfg.hidden_size), ctx.dtype, last.sharding())),
                     tuple(last.devices()))


def _prompt_lp_signature(ctx, T) -> Signature:
    last = ctx.stages[-1]
    shard = last.sharding()
    # the chunk budget as a partial keyword: the fingerprint sees it (a module global read while
    # tracing it would not)
    fn = cached(ctx, "prompt_lp", lambda: jax.jit(functools.partial(prompt_lp_body, head=LMHead.of(ctx.cfg),
                                                                    budget=PROMPT_LP_CHUNK_ELEMS)))
    return Signature(fn, (_like(ctx.head_w), _sds((T, ctx.cfg.hidden_size), ctx.dtype, shard),
                                                _sds((T,), jnp.int32, shard)), tuple(last.devices()))


register(ProgramKind("sample", _sample_signature,
                     lambda ctx: [(R, v) for R in _request_buckets(ctx) for v in sample_variants(ctx.sampler_impl)],
                     owned=_last_owned))
register(ProgramKind("greedy", _greedy_signature, _request_buckets, owned=_last_owned))


def _sample_procs_signature(ctx, key) -> Signature:
    from jvllm.worker import logits_processors

    R, variant = key
    last = ctx.stages[-1]
    shard = last.sharding()
    layout = sampler.RowLayout(R, ctx.cfg.vocab_size, ctx.max_model_len, variant)
    pi = logits_processors.abstract_inputs(R, len(ctx.logits_processors), ctx.max_model_len, shard)
    fn = cached(ctx, "sample_procs", lambda: jax.jit(functools.partial(
        sample_procs_body, procs=ctx.logits_processors, impl=ctx.sampler_impl, head=LMHead.of(ctx.cfg),
        max_num_seqs=ctx.max_num_seqs), static_argnames=("layout",)))
    return Signature(fn, (_like(ctx.head_w), _sds((R, ctx.cfg.hidden_size), ctx.dtype, shard), layout.abstract(shard), pi),
                     tuple(last.devices()), dict(layout=layout))


# user logits processors: compiled with the registry, per request bucket, on first use only
register(ProgramKind("sample_procs", _sample_procs_signature, lambda ctx: [], owned=_last_owned))
# prompt logprobs are refused with stages over processes (only the sampled ids cross)
register(ProgramKind("prompt_lp", _prompt_lp_signature,
                     lambda ctx: [] if ctx.multiprocess else list(ctx.layout.token_buckets), owned=_last_owned))


# ---------------------------------------------------------------------------- speculative decoding
def _spec_verify_signature(ctx, key) -> Signature:
    """spec_verify[T, k, draft_probs, want_lp, all greedy] (head_w, hidden[T], idx[R, k+1], draft[R, k],
    num_draft[R], SamplingBatch[R], base_pad[max_num_seqs], draft probs [max_num_seqs, k, V] | None,
    q_rows[R] | None) -> (tokens[R, k+1], num_accepted[R], logprobs | None, next_pad[max_num_seqs]):
    `jvllm.spec_decode.rejection.verify_body`."""
    from jvllm.spec_decode.rejection import verify_body

    T, k, probs, want_lp, greedy = key
    R = ctx.layout.seq_bucket(T)
    last = ctx.stages[-1]
    shard = last.sharding()
    V = ctx.cfg.vocab_size
    sb, _ = sampler.abstract_inputs(R, ctx.max_model_len, V, False, shard)
    fn = cached(ctx, ("spec_verify", want_lp, greedy), lambda: jax.jit(functools.partial(
        verify_body, logits_fn=LMHead.of(ctx.cfg), want_lp=want_lp,
        all_greedy=greedy)))
    i32 = jnp.int32
    q = _sds((ctx.max_num_seqs, k, V), jnp.float32, shard) if probs else None
    q_rows = _sds((R,), i32, shard) if probs else None
    return Signature(fn, (_like(ctx.head_w), _sds((T, ctx.cfg.hidden_size), ctx.dtype, shard),
                          _sds((R, k + 1), i32, shard), _sds((R, k), i32, shard), _sds((R,), i32, shard), sb,
                          _sds((ctx.max_num_seqs,), i32, shard), q, q_rows),
                     tuple(last.devices()))


def _spec_verify_keys(ctx) -> list:
    """With speculation on (`ctx.spec`: (k, draft probs)), every token bucket that fits a
    speculating row: all-greedy and sampled, without and with logprobs (plain ones first)."""
    spec = getattr(ctx, "spec", None)
    if spec is None:
        return []
    k, probs = spec
    return [(T, k, probs, lp, g) for lp in (False, True) for T in ctx.layout.token_buckets if T >= k + 1
            for g in (True, False)]


register(ProgramKind("spec_verify", _spec_verify_signature, _spec_verify_keys, owned=_last_owned))


def _draft_sample_signature(ctx, key) -> Signature:
    """draft_sample[R, all greedy] on a draft model's runner (`ctx.draft_k` set): (head_w, last_hidden[R],
    SamplingBatch[R], dst[R], round j [], acc_p [max_num_seqs, k, V], acc_i [max_num_seqs, k]) ->
    (acc_p, acc_i, ids padded): `jvllm.spec_decode.rejection.draft_sample_body`, accumulators donated."""
    from jvllm.spec_decode.rejection import draft_sample_body

    R, greedy = key
    last = ctx.stages[-1]
    shard = last.sharding()
    V, S, k = ctx.cfg.vocab_size, ctx.max_num_seqs, ctx.draft_k
    sb, _ = sampler.abstract_inputs(R, ctx.max_model_len, V, False, shard)
    fn = cached(ctx, ("draft_sample", greedy), lambda: jax.jit(functools.partial(
        draft_sample_body, logits_fn=LMHead.of(ctx.cfg), all_greedy=greedy),
        donate_argnums=(5, 6)))
    i32 = jnp.int32
    return Signature(fn, (_like(ctx.head_w), _sds((R, ctx.cfg.hidden_size), ctx.dtype, shard), sb,
                          _sds((R,), i32, shard), _sds((), i32, shard), _sds((S, k, V), jnp.float32, shard),
                          _sds((S, k), i32, shard)), tuple(last.devices()))


register(ProgramKind("draft_sample", _draft_sample_signature,
                     lambda ctx: [(R, g) for R in _request_buckets(ctx) for g in (True, False)]
                     if getattr(ctx, "draft_k", None) else [], owned=_last_owned))
