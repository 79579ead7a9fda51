"""The model runner's device programs, each declared once and registered with the program registry
(`jvllm.compilation.registry`):

  step[s, T, decode]  (leaves, kv, packed, prev_tok | hidden[T]) -> (kv, last_hidden[R], hidden[T])
                      for the last stage, (kv, hidden[T]) for others; kv donated; `packed` is the
                      `InputLayout.pack` vector; the first stage takes prev_tok [max_num_seqs] (token
                      t is prev_tok[src[t]] where src[t] >= 0: the id sampled on the device by the
                      step before, async scheduling), later stages the previous stage's hidden states
  sample[R, extras]   (head_w, last_hidden[R], SamplingBatch, SamplingExtras|None) -> ids, logprobs, ids padded
  greedy[R]           (head_w, last_hidden[R]) -> ids, ids padded: argmax only (no lax.cond: on GPUs
                      XLA runs a cond by copying its predicate to the host and blocking on it)
  prompt_lp[T]        (head_w, hidden[T], targets[T]) -> prompt logprobs (only when a request asks)

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
from jvllm.ops.attention import tensor_parallel_mesh
from jvllm.sampling import logprob_outputs, sample
from jvllm.worker import sampler


def logits(w, h, tied: bool):
    return jnp.dot(h, w.T if tied else w, preferred_element_type=jnp.float32)


def _pad_tok(tok, max_num_seqs: int):
    return jnp.zeros((max_num_seqs,), jnp.int32).at[:tok.shape[0]].set(tok)


def step_body(layout, graphdef, treedef, first, last, attention, mesh, decode, kv_chunk_blocks,
              leaves, kv, packed, x, *, T):
    tokens, src, md = layout.unpack(packed, T, decode)
    if first:
        x = jnp.where(src >= 0, x[jnp.maximum(src, 0)], tokens)
    model = nnx.merge(graphdef, jax.tree_util.tree_unflatten(treedef, leaves))
    with tensor_parallel_mesh(mesh):  # Pallas kernels run per device on local KV heads
        h, kv = model(x, kv, md, kv_chunk_blocks, attention)
    if last:
        return kv, h[md.logits_indices], h
    return kv, h


def sample_body(w, h, sb, ex, *, tied, branchless, max_num_seqs):
    tok, lp = sample(logits(w, h, tied), sb, ex, branchless=branchless)
    return tok, lp, _pad_tok(tok, max_num_seqs)


def greedy_body(w, h, *, tied, max_num_seqs):
    tok = jnp.argmax(logits(w, h, tied), axis=-1).astype(jnp.int32)
    return tok, _pad_tok(tok, max_num_seqs)


def prompt_lp_body(w, h, targets, *, tied):
    return logprob_outputs(logits(w, h, tied), targets)


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


def step_fn(ctx, s: int, decode: bool):
    st = ctx.stages[s]
    return cached(ctx, ("step", s, decode), lambda: jax.jit(functools.partial(
        step_body, ctx.layout, st.graphdef, st.treedef, st.first, st.last, ctx.attention_modes[decode], st.mesh,
        decode, ctx.kv_chunk_blocks), donate_argnums=(1,), static_argnames=("T",)))


def logits_fn(ctx):
    return cached(ctx, "logits", lambda: jax.jit(functools.partial(logits, tied=ctx.cfg.tie_word_embeddings)))


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
    return Signature(step_fn(ctx, s, decode), (_like(st.leaves), _like(st.kv), packed, x),
                     tuple(st.devices()), dict(T=T))


def _step_keys(ctx) -> list:
    out = []
    for T in ctx.layout.token_buckets:
        for decode in (False, True) if ctx.layout.has_decode_variant(T) else (False,):
            out += [(s, T, decode) for s in range(len(ctx.stages))]
    return out


register(ProgramKind("step", _step_signature, _step_keys, owned=lambda ctx, key: ctx.local(key[0])))


# ---------------------------------------------------------------------------- samplers
def _request_buckets(ctx) -> list[int]:
    return sorted({ctx.layout.seq_bucket(T) for T in ctx.layout.token_buckets})


def _last_owned(ctx, key) -> bool:
    return ctx.local(len(ctx.stages) - 1)


def _sample_signature(ctx, key) -> Signature:
    R, extras = key
    last = ctx.stages[-1]
    shard = last.sharding()
    sb, ex = sampler.abstract_inputs(R, ctx.max_model_len, ctx.cfg.vocab_size, extras, shard)
    # GPUs: no lax.cond in the sampler (a cond's predicate goes to the host and blocks the
    # dispatcher); elsewhere conds skip the unneeded work
    fn = cached(ctx, "sample", lambda: jax.jit(functools.partial(
        sample_body, tied=ctx.cfg.tie_word_embeddings, branchless=ctx.platform == "gpu", max_num_seqs=ctx.max_num_seqs)))
    return Signature(fn, (_like(ctx.head_w), _sds((R, ctx.cfg.hidden_size), ctx.dtype, shard), sb, ex),
                     tuple(last.devices()))


def _greedy_signature(ctx, R) -> Signature:
    last = ctx.stages[-1]
    fn = cached(ctx, "greedy", lambda: jax.jit(functools.partial(
        greedy_body, tied=ctx.cfg.tie_word_embeddings, max_num_seqs=ctx.max_num_seqs)))
    return Signature(fn, (_like(ctx.head_w), _sds((R, ctx.cfg.hidden_size), ctx.dtype, last.sharding())),
                     tuple(last.devices()))


def _prompt_lp_signature(ctx, T) -> Signature:
    last = ctx.stages[-1]
    shard = last.sharding()
    fn = cached(ctx, "prompt_lp", lambda: jax.jit(functools.partial(prompt_lp_body, tied=ctx.cfg.tie_word_embeddings)))
    return Signature(fn, (_like(ctx.head_w), _sds((T, ctx.cfg.hidden_size), ctx.dtype, shard),
                                                _sds((T,), jnp.int32, shard)), tuple(last.devices()))


register(ProgramKind("sample", _sample_signature, lambda ctx: [(R, ex) for R in _request_buckets(ctx) for ex in (False, True)],
                     owned=_last_owned))
register(ProgramKind("greedy", _greedy_signature, _request_buckets, owned=_last_owned))
# prompt logprobs are refused with stages over processes (only the sampled ids cross)
register(ProgramKind("prompt_lp", _prompt_lp_signature,
                     lambda ctx: [] if ctx.multiprocess else list(ctx.layout.token_buckets), owned=_last_owned))
