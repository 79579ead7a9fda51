"""ModelRunner: turns a SchedulerOutput into device inputs, runs the compiled programs, returns ids.

Programs (all compiled ahead of time at start-up, one executable per bucket, see `warmup`):
  step[T]        (state, kv, packed, prev_tok | hidden[T]) -> (kv, last_hidden[R], hidden[T]); kv
                 donated; `packed` is one int32 vector of the tokens, their sources and the
                 attention metadata (`pack_inputs`)
  sample[R, ex]  (head_w, last_hidden[R], SamplingBatch, SamplingExtras|None) -> ids, logprobs
  prompt_lp[T]   (head_w, hidden[T], targets[T]) -> prompt logprobs (only when a request asks)
Buckets: `token_buckets` (T); the request bucket is R = min(T, max_num_seqs), so each token bucket
compiles exactly one model program. Inputs are numpy arrays built on the host and transferred
as one packed vector per stage and step; the host receives sampled ids (and logprobs only when some request wants them).

Parallelism: the runner holds one or more pipeline *stages* (`Stage`), each a model slice with its
own weights, KV pages and device sub-mesh (axis "tensor": tensor parallelism inside a stage is
GSPMD over NamedSharding'd params and KV pages). With several stages the work comes as
micro-batches (the scheduler's: `Request.microbatch`, each within the token budget; the engine's
async loop gives each micro-batch its own step) that are dispatched asynchronously stage after
stage, so stage s works on micro-batch m while stage s+1 works on m-1 (JAX's async dispatch
pipelines them; chosen over one SPMD program with a stage axis because each stage keeps plain
per-device programs and no collective-permute schedule is needed). Fastest with one process per
stage (measured on 2 H200s, W1: 13,142 out tok/s against 10,809 with both stages in one process,
h200x2_w1_pp2mp_07bfa10.json / h200x2_w1_pp2_07bfa10.json).

Hazard: anything here that calls a jnp function eagerly with a new shape compiles a tiny XLA
program at serving time; the compile counter (`jvllm.compile`) catches that in tests.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jvllm import compile as jcompile
from jvllm.config import ModelConfig, cdiv
from jvllm.models.layers import lm_logits
from jvllm.ops.attention import AttentionMetadata, build_metadata, tensor_parallel_mesh
from jvllm.sampling import NUM_TOP_LOGPROBS, SamplingBatch, SamplingExtras, logprob_outputs, sample


# attention_backend -> (attention of decode-only steps, attention of mixed/prefill steps); see
# LlamaForCausalLM.__call__. Measured on an H200 (benchmarks/results/h200_gpu_kernels.json, Llama-3-8B
# attention): the ragged kernel takes 0.45 ms for a 2048-token prefill (XLA tiles 5.5 ms), 0.41 ms
# for a W1-like mixed step (XLA 4.2 ms), 0.58 ms for 256 decodes at context 800 (JAX's Pallas decode
# kernel 0.76 ms, XLA 1.76 ms) and ties JAX's kernel at batch 1, so "auto" is "ragged" on GPUs.
ATTENTION_MODES = {"xla": ("xla", "xla"), "pallas": ("pallas", "ragged"), "pallas_decode": ("pallas", "xla"),
                   "ragged": ("ragged", "ragged"), "ragged_split": ("ragged_split", "ragged")}


def attention_modes(backend: str) -> tuple[str, dict[bool, str]]:
    """attention_backend -> (the backend, {decode-only step?: attention mode}); "auto" is ragged on
    GPUs, xla elsewhere. Raises ValueError naming the accepted values."""
    if backend == "auto":
        backend = "ragged" if jax.default_backend() == "gpu" else "xla"
    base = backend.removesuffix("_interpret")
    if base not in ATTENTION_MODES:
        raise ValueError(f"attention_backend must be auto or one of {', '.join(ATTENTION_MODES)} (optionally "
                         f"with _interpret), got {backend!r}")
    suffix = "_interpret" if backend.endswith("_interpret") else ""
    return backend, {dec: (m if m == "xla" else m + suffix) for dec, m in zip((True, False), ATTENTION_MODES[base])}


def _key_data(seed: int) -> tuple[int, int]:
    s = seed & (2**64 - 1)
    return (s >> 32) & 0xFFFFFFFF, s & 0xFFFFFFFF


@dataclasses.dataclass
class StepResult:
    token_ids: np.ndarray                 # [R] sampled ids (rows of scheduled requests, in order)
    logprobs: tuple | None                # (tok_lp [R], rank [R], top_ids [R,N], top_lp [R,N]) or None
    prompt_logprobs: dict                 # row -> (positions, tok_lp, rank, top_ids, top_lp)


@dataclasses.dataclass
class Stage:
    graphdef: object
    state: object
    mesh: object | None = None        # 1-D mesh ("tensor",) of this stage's devices; None = default device
    kv_spec: object = None            # PartitionSpec of KV pages on `mesh`
    kv: list | None = None
    first: bool = True
    last: bool = True
    leaves: list | None = None        # the state's leaves, flattened once (a plain list flattens
    treedef: object = None            # in C++ on every call; an nnx.State would in Python)

    def __post_init__(self):
        if self.state is not None and self.leaves is None:
            self.leaves, self.treedef = jax.tree_util.tree_flatten(self.state)

    def sharding(self, spec=None):
        from jax.sharding import NamedSharding, PartitionSpec

        if self.mesh is None:
            return None
        return NamedSharding(self.mesh, spec if spec is not None else PartitionSpec())


def _plain_greedy(p) -> bool:
    """Sampling params that the argmax-only program serves (no temperature, logprobs, penalties)."""
    return p.greedy and p.logprobs is None and not p.needs_extras


def _put(x, sharding):
    """numpy -> device array with `sharding` (also across processes in a multi-host run: a
    sharding with devices of other processes is built from this process's slices)."""
    if sharding is None:
        return x
    if jax.process_count() > 1 and not sharding.is_fully_addressable:
        return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx], dtype=x.dtype)
    return jax.device_put(x, sharding)


def _to_host(x) -> np.ndarray:
    if not getattr(x, "is_fully_addressable", True):  # multi-host: every process holds a replica
        return np.asarray(x.addressable_data(0))
    return np.asarray(x)


# How a pipeline stage's output (hidden states; the last stage's sampled ids for the first stage)
# reaches the next stage's devices: "device_put" (jax.device_put, the runtime's device-to-device
# copy) or "ppermute" (one collective-permute program over a 2 x tp mesh of both stages' devices,
# assembled from the arrays' per-device buffers without copies; precompiled per bucket). The
# second exists because on 2 H200s PP=2 spent 10.9-14 ms of each W1 step in launch calls without
# overlapping its stages, and a device_put that waits for its input would explain it. It does not:
# benchmarks/gpu_handoff_probe.py found neither blocking the host (device_put 0.18 ms, ppermute 0.85
# ms against a 5.5 ms producer; h200x2_handoff_probe_a78ae13.json), and PP=2 W1 gave 7,071 with
# ppermute against 6,959 with device_put, so "device_put" stays the default in one process. Across
# processes ppermute is the only way (multiprocess below).
HANDOFFS = ("device_put", "ppermute")


def check_handoff(handoff: str) -> str:
    if handoff not in HANDOFFS:
        raise ValueError(f"pipeline_handoff must be one of {', '.join(HANDOFFS)}, got {handoff!r}")
    return handoff


@dataclasses.dataclass
class _Pending:
    """A micro-batch launched by stage threads: its group now, its pending entry (group, ids,
    logprobs, prompt logprobs, padded ids) once the last stage's thread has enqueued the sampler."""
    group: list
    future: object


class _Deferred:
    """A micro-batch of pipeline stages over processes whose sampled ids cross from the last
    stage's process to the first stage's by a hop issued later (`ModelRunner._flush_deferred`):
    right after the next micro-batch's stage 0 is queued, so that the first stage's GPU is not
    held in a collective while the last stage still computes. Every process issues the same hops
    in the same order (the collectives must match); `result()` issues any still due."""

    def __init__(self, group, runner, own=None):
        self.group, self.runner, self.own, self.value = group, runner, own, None

    def result(self) -> tuple:
        if self.value is None:
            self.runner._flush_deferred()
        return self.value


def _entry(e) -> tuple:
    """A pending micro-batch's (group, ids, logprobs, prompt logprobs, padded ids), waiting for
    its stage threads to enqueue it if it is a _Pending, issuing its ids' hand-off if _Deferred."""
    if isinstance(e, _Pending):
        return e.future.result()
    return e.result() if isinstance(e, _Deferred) else e


def _group(e) -> list:
    """A pending micro-batch's group, without waiting for anything."""
    return e.group if isinstance(e, (_Pending, _Deferred)) else e[0]


class ModelRunner:
    def __init__(self, cfg: ModelConfig, graphdef=None, state=None, head_w=None, *, dtype, block_size: int,
                 num_blocks: int, max_model_len: int, max_num_seqs: int, token_buckets: tuple[int, ...],
                 query_tile: int = 8, kv_chunk_blocks: int = 16, stages: list[Stage] | None = None,
                 num_microbatches: int | None = None, attention_backend: str = "auto",
                 stage_threads: bool = False, handoff: str = "device_put"):
        self.cfg = cfg
        self.stages = stages or [Stage(graphdef, state)]
        self.head_w = head_w
        self.dtype = jnp.dtype(dtype)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.token_buckets = tuple(sorted(token_buckets))
        self.query_tile = query_tile
        self.num_microbatches = num_microbatches or len(self.stages)
        self.stage_threads = stage_threads  # pipeline stages after the first launched from threads
        self.handoff = check_handoff(handoff)
        # Pipeline stages over several processes (one per stage's devices, `jvllm launch`): each
        # process launches only its own stages; hidden states and the sampled ids cross between
        # processes through the hop programs, which both processes of a hop call (multi-controller
        # JAX), so the hand-off is "ppermute" whatever was asked.
        self.pid = jax.process_index()
        self.multiprocess = jax.process_count() > 1 and len(self.stages) > 1
        if self.multiprocess:
            self.handoff = "ppermute"
        self._hop_programs: dict = {}  # (src, dst) -> (mesh, program, dst devices)
        self._hop_fillers: dict = {}   # (src, dst, shape, dtype) -> dst-half buffers of a hop's input
        self._swap_fn = None           # 2 stages over processes: both hand-offs in one program (_swap)
        self.num_swaps = 0
        self._deferred: list = []      # stages over processes: micro-batches whose ids are still due
        self._stage_pools = None
        self._timer_lock = threading.Lock()
        attention_backend, self.attention_modes = attention_modes(attention_backend)
        self.attention_backend = attention_backend
        max_blocks = cdiv(max_model_len, block_size)
        self.kv_chunk_blocks = min(kv_chunk_blocks, max_blocks)
        self.table_width = cdiv(max_blocks, self.kv_chunk_blocks) * self.kv_chunk_blocks
        # which stages run in this process (all of them in a single-process run)
        self._local = [not self.multiprocess or st.mesh is None
                       or next(iter(st.mesh.devices.flat)).process_index == self.pid for st in self.stages]
        self._stage_devs = [frozenset(st.mesh.devices.flat) if st.mesh is not None else frozenset()
                            for st in self.stages]  # hop outputs pick their stage's shards per step
        for i, st in enumerate(self.stages):
            st.kv = self._alloc_kv(st) if self.local(i) else None  # another process's pool
        self._step_fns = {(i, dec): jax.jit(functools.partial(
            self._step_impl, st.graphdef, st.treedef, st.first, st.last, self.attention_modes[dec], st.mesh, dec),
            donate_argnums=(1,), static_argnames=("T",)) for i, st in enumerate(self.stages) for dec in (False, True)}
        # A step's host inputs travel as ONE packed int32 vector (`pack_inputs`: tokens, src and the
        # attention metadata), so a step costs one host-to-device transfer per stage instead of
        # eight (the 8-leaf device_put took 0.26 ms of every TP=2 B1 step on an H200,
        # h200x2_profile_tp2mp_b1_oneshot_07bfa10.json; across processes each leaf was a
        # make_array_from_callback of its own). First-stage programs also take prev_tok
        # [max_num_seqs]: token t of the batch is prev_tok[src[t]] where src[t] >= 0, the id sampled
        # on the device by the step before, not yet seen by the host (async scheduling); with
        # nothing pending src is all -1 and prev_tok this zero array. Later stages take the
        # previous stage's hidden states instead.
        first = self.stages[0]
        z = np.zeros(self.max_num_seqs, np.int32)
        self._no_prev = _put(z, first.sharding()) if first.sharding() is not None else jnp.asarray(z)
        self.platform = jax.default_backend()
        self._sample_fn = jax.jit(functools.partial(self._sample_impl, tied=cfg.tie_word_embeddings))
        self._greedy_fn = jax.jit(functools.partial(self._greedy_impl, tied=cfg.tie_word_embeddings))
        self.timers = dict(prepare_s=0.0, step_call_s=0.0, sample_inputs_s=0.0, sample_call_s=0.0, step_call_put_s=0.0)
        self._plp_fn = jax.jit(functools.partial(self._plp_impl, tied=cfg.tie_word_embeddings))
        self._compiled: dict = {}
        self.use_executable_cache = os.environ.get("JVLLM_EXECUTABLE_CACHE", "1") != "0"

    def local(self, s_idx: int) -> bool:
        """Whether stage `s_idx` runs in this process (always, in a single-process run)."""
        return self._local[s_idx]

    def owns(self, kind, key) -> bool:
        """Whether this process compiles and runs program (kind, key): a stage's step programs in
        the stage's process, sampling and prompt logprobs in the last stage's, a hop in both of its
        ends' (every program in a single-process run)."""
        if not self.multiprocess:
            return True
        if kind == "step":
            return self.local(key[0])
        if kind == "hop":
            return self.local(key[0]) or self.local(key[1])
        if kind == "swap":
            return self.local(0) or self.local(1)
        return self.local(len(self.stages) - 1)

    # single-stage conveniences (verify, tests)
    @property
    def kv(self):
        return self.stages[0].kv if len(self.stages) == 1 else [kv for st in self.stages for kv in st.kv or ()]

    @property
    def state(self):
        return self.stages[0].state

    # ------------------------------------------------------------------ memory
    def kv_shape(self):
        return (self.cfg.num_kv_heads, self.num_blocks, self.block_size, self.cfg.head_dim)

    def _alloc_kv(self, st: Stage):
        shape = self.kv_shape()
        zeros = jax.jit(lambda: jnp.zeros(shape, self.dtype), out_shardings=st.sharding(st.kv_spec))
        return [(zeros(), zeros()) for _ in range(self._stage_num_layers(st))]

    def _stage_num_layers(self, st: Stage) -> int:
        flat = nnx.to_flat_state(st.state) if hasattr(nnx, "to_flat_state") else st.state.flat_state()
        return len({str(path[1]) for path, _ in flat if str(path[0]) == "layers"})

    def release(self):
        """Drop device buffers (weights and KV pools) so their memory returns at once."""
        for st in self.stages:
            for arr in jax.tree_util.tree_leaves((st.kv, st.state)):
                if isinstance(arr, jax.Array) and not arr.is_deleted():
                    arr.delete()
            st.kv = st.state = st.leaves = None
        if isinstance(self.head_w, jax.Array) and not self.head_w.is_deleted():
            self.head_w.delete()
        self.head_w = None
        self._compiled.clear()
        self._hop_fillers.clear()
        for pool in self._stage_pools or ():
            pool.shutdown(wait=True)
        self._stage_pools = None

    # ------------------------------------------------------------------ programs
    def _step_impl(self, graphdef, treedef, first, last, attention, mesh, decode, leaves, kv, packed, x, *, T):
        """packed: `pack_inputs` of bucket (T, decode); x: prev_tok [max_num_seqs] (first stage) or
        the previous stage's hidden states [T, hidden] (later stages)."""
        tokens, src, md = self.unpack_inputs(packed, T, decode)
        if first:
            x = jnp.where(src >= 0, x[jnp.maximum(src, 0)], tokens)
        model = nnx.merge(graphdef, jax.tree_util.tree_unflatten(treedef, leaves))
        with tensor_parallel_mesh(mesh):  # Pallas kernels run per device on local KV heads
            h, kv = model(x, kv, md, self.kv_chunk_blocks, attention)
        if last:
            return kv, h[md.logits_indices], h
        return kv, h

    def _logits(self, w, h, tied):
        return lm_logits(w, h, tied, self.cfg.final_logit_softcap)

    def _sample_impl(self, w, h, sb, ex, *, tied):
        # GPUs: no lax.cond in the sampler (XLA copies a cond's predicate to the host and blocks,
        # so a sampled step would stall async dispatch); elsewhere conds skip the unneeded work
        tok, lp = sample(self._logits(w, h, tied), sb, ex, branchless=self.platform == "gpu")
        return tok, lp, self._pad_tok(tok)

    def _greedy_impl(self, w, h, *, tied):
        """All rows greedy, no penalties, no logprobs: argmax only. A program of its own because
        XLA on GPUs runs `lax.cond` by copying the predicate to the host and blocking on it, which
        would make every dispatch wait for the step before it (the general sampler has conds)."""
        tok = jnp.argmax(self._logits(w, h, tied), axis=-1).astype(jnp.int32)
        return tok, self._pad_tok(tok)

    def _pad_tok(self, tok):
        """Sampled ids [R] padded to [max_num_seqs]: the next step's `prev_tok` (fixed shape, so
        the step programs need no variant per request bucket)."""
        return jnp.zeros((self.max_num_seqs,), jnp.int32).at[:tok.shape[0]].set(tok)

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

    def has_decode_variant(self, T: int) -> bool:
        """Decode-only steps (T tokens = T requests <= max_num_seqs) land in buckets up to the first
        one that holds max_num_seqs; those get a one-query-tile program too."""
        return T <= self.bucket(min(self.max_num_seqs, self.token_buckets[-1]))

    def tiling(self, T: int, decode: bool) -> tuple[int, int]:
        """(query tile size, number of tiles) of a bucket. A decode-only step (every request one
        token) uses tiles of one query, so attention does no padded-query work; a mixed step uses
        `query_tile` (each tile reads its request's pages once)."""
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

    def pack_inputs(self, T: int, decode: bool, tokens, src, md: AttentionMetadata) -> np.ndarray:
        """One int32 vector of a step's host inputs (layout `input_layout`), checked field by field."""
        fields = dict(tokens=tokens, src=src, **{k: getattr(md, k) for k in AttentionMetadata.__dataclass_fields__})
        parts = []
        for name, shape in self.input_layout(T, decode):
            a = np.asarray(fields[name])
            if a.shape != shape:
                raise ValueError(f"step input {name}: shape {a.shape}, bucket (T={T}, decode={decode}) needs {shape}")
            parts.append(a.reshape(-1).astype(np.int32, copy=False))
        return np.concatenate(parts)

    def unpack_inputs(self, packed, T: int, decode: bool):
        """(tokens, src, AttentionMetadata) from a packed vector (static slices, inside programs)."""
        out, off = {}, 0
        for name, shape in self.input_layout(T, decode):
            n = int(np.prod(shape))
            out[name] = packed[off:off + n].reshape(shape)
            off += n
        tokens, src = out.pop("tokens"), out.pop("src")
        return tokens, src, AttentionMetadata(**out)

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
            out += [("step", (s, T, False)) for s in range(len(self.stages))]
            if self.has_decode_variant(T):
                out += [("step", (s, T, True)) for s in range(len(self.stages))]
            out.append(("prompt_lp", T))
        for R in sorted({self.seq_bucket(T) for T in self.token_buckets}):
            out += [("sample", (R, False)), ("sample", (R, True)), ("sample", (R, "greedy"))]
        if self.handoff == "ppermute" and len(self.stages) > 1:
            n = len(self.stages)
            out += [("hop", (s - 1, s, (T, self.cfg.hidden_size), str(self.dtype))) for T in self.token_buckets
                    for s in range(1, n)]
            out.append(("hop", (n - 1, 0, (self.max_num_seqs,), "int32")))  # sampled ids -> first stage
            if self.multiprocess and n == 2:
                out += [("swap", ((T, self.cfg.hidden_size), str(self.dtype))) for T in self.token_buckets]
        if self.multiprocess:  # prompt logprobs are refused across processes (see LLMEngine)
            out = [(k, key) for k, key in out if k != "prompt_lp" and self.owns(k, key)]
        return out

    def compile(self, kind, key):
        if (kind, key) in self._compiled:
            return self._compiled[(kind, key)]
        sds = jax.ShapeDtypeStruct
        hidden = self.cfg.hidden_size
        last = self.stages[-1]

        def on(st, tree):  # abstract inputs replicated on a stage's devices
            shard = st.sharding()
            return jax.tree_util.tree_map(lambda a: sds(a.shape, a.dtype, sharding=shard), tree)

        def like(tree):
            return jax.tree_util.tree_map(lambda a: sds(a.shape, a.dtype, sharding=a.sharding), tree)

        kwargs = {}
        if kind == "step":
            s_idx, T, decode = key
            st = self.stages[s_idx]
            packed = sds((self.packed_size(T, decode),), jnp.int32)
            x = sds((self.max_num_seqs,), jnp.int32) if st.first else sds((T, hidden), self.dtype)
            fn, args = self._step_fns[(s_idx, decode)], (like(st.leaves), like(st.kv), on(st, packed), on(st, x))
            kwargs = dict(T=T)
            static = (self.attention_modes[decode], st.first, st.last, repr(st.treedef), "packed-v1")
        elif kind == "sample" and key[1] == "greedy":
            fn, args = self._greedy_fn, (like(self.head_w), on(last, sds((key[0], hidden), self.dtype)))
            static = ()
        elif kind == "sample":
            R, extras = key
            sb, ex = self._abstract_sampling(R, extras)
            fn, args = self._sample_fn, (like(self.head_w), on(last, sds((R, hidden), self.dtype)), on(last, sb), on(last, ex))
            static = ()
        elif kind == "prompt_lp":
            fn, args = self._plp_fn, (like(self.head_w), on(last, sds((key, hidden), self.dtype)),
                                      on(last, sds((key,), jnp.int32)))
            static = ()
        elif kind == "hop":
            src, dst, shape, dtype = key
            mesh2, fn, _ = self._hop_program(src, dst)
            from jax.sharding import NamedSharding, PartitionSpec

            args = (sds((2 * shape[0], *shape[1:]), jnp.dtype(dtype), sharding=NamedSharding(mesh2, PartitionSpec("hop"))),)
            static = ()
        elif kind == "swap":
            shape, dtype = key
            fn = self._swap_program()
            from jax.sharding import NamedSharding, PartitionSpec

            hop = NamedSharding(self._hop_program(0, 1)[0], PartitionSpec("hop"))
            args = (sds((2 * shape[0], *shape[1:]), jnp.dtype(dtype), sharding=hop),
                    sds((2 * self.max_num_seqs,), jnp.int32, sharding=hop))
            static = ()
        else:
            raise KeyError(kind)
        exe = None
        cache_key = None
        if self._executable_cache_ok():
            sig = [(a.shape, str(a.dtype), repr(a.sharding)) for a in jax.tree_util.tree_leaves(args)]
            cache_key = jcompile.executable_key(
                "jvllm-exe-v1", kind, key, static, sig, jax.tree_util.tree_structure(args), repr(self.cfg),
                str(self.dtype), self.kv_chunk_blocks, self.max_num_seqs, self.cfg.tie_word_embeddings)
            # the executable's devices in its own order: its stage's mesh (row-major), or the one device
            owner = self.stages[key[0]] if kind == "step" else last
            devs = list(owner.mesh.devices.flat) if owner.mesh is not None else [jax.devices()[0]]
            if kind in ("hop", "swap"):
                devs = list(self._hop_program(*(key[:2] if kind == "hop" else (0, 1)))[0].devices.flat)
            exe = jcompile.load_executable(cache_key, devices=devs)
        if exe is None:
            exe = fn.lower(*args, **kwargs).compile()
            if cache_key is not None:
                jcompile.store_executable(cache_key, exe)
        self._compiled[(kind, key)] = exe
        return exe

    def _hop_program(self, src: int, dst: int):
        """(mesh, jitted program, dst's device set) of the `ppermute` hand-off from stage `src` to
        stage `dst`: a ("hop", "tensor") mesh whose row 0 is src's devices and row 1 dst's; the
        program moves row 0's shard of a [2 * n, ...] array (sharded on "hop") to row 1."""
        k = (src, dst)
        if k not in self._hop_programs:
            from jax.sharding import Mesh, PartitionSpec

            devs = np.stack([np.asarray(self.stages[src].mesh.devices).reshape(-1),
                             np.asarray(self.stages[dst].mesh.devices).reshape(-1)])
            mesh2 = Mesh(devs, ("hop", "tensor"))
            fn = jax.jit(jax.shard_map(lambda a: jax.lax.ppermute(a, "hop", [(0, 1)]), mesh=mesh2,
                                       in_specs=PartitionSpec("hop"), out_specs=PartitionSpec("hop")))
            self._hop_programs[k] = (mesh2, fn, frozenset(devs[1]))
        return self._hop_programs[k]

    def _to_stage(self, x, src: int, dst: int, shape=None, dtype=None):
        """A device array on stage `src`'s devices -> the same values replicated on stage `dst`'s
        (`handoff`). The ppermute path needs `x` replicated on src's mesh (every device one full
        copy; the stage programs' outputs are) and falls back to device_put otherwise.

        Across processes (`multiprocess`) both ends' processes call this for every hand-off, in
        the same order: src's with `x`, dst's with x=None and its `shape` and `dtype`; each gives
        the hop program its own devices' buffers. Returns the array on dst's devices in dst's
        process, None in src's."""
        dst_shard = self.stages[dst].sharding()
        if not self.multiprocess and (self.handoff != "ppermute" or src == dst or not isinstance(x, jax.Array)
                                      or not x.sharding.is_fully_replicated):
            return jax.device_put(x, dst_shard)
        from jax.sharding import NamedSharding, PartitionSpec

        shape = tuple(x.shape) if x is not None else tuple(shape)
        dtype = str(x.dtype) if x is not None else str(jnp.dtype(dtype))
        key = (src, dst, shape, dtype)
        mesh2 = self._hop_program(src, dst)[0]
        g = self._hop_input(x, src, dst, shape, dtype, NamedSharding(mesh2, PartitionSpec("hop")))
        return self._hop_output(self.compile("hop", key)(g), dst, shape)

    def _hop_output(self, out, dst: int, shape):
        """The half of a hop program's output on stage `dst`'s devices as that stage's array
        (in dst's process; None elsewhere)."""
        if not self.local(dst):
            return None
        devs = self._stage_devs[dst]
        return jax.make_array_from_single_device_arrays(
            tuple(shape), self.stages[dst].sharding(), [sh.data for sh in out.addressable_shards if sh.device in devs])

    def _hop_input(self, x, src: int, dst: int, shape, dtype, sharding):
        """The [2 * n, ...] input of a hop from stage `src` to stage `dst` on `sharding` (a mesh
        with one row per stage): this process's pieces, `x`'s shards on src's devices and never-read
        fillers (allocated once per shape) on dst's."""
        mine = []
        if self.local(src):
            if x is None or not x.sharding.is_fully_replicated:
                raise ValueError(f"hand-off from stage {src}: needs the stage's output replicated on its devices")
            mine += [sh.data for sh in x.addressable_shards]
        if self.local(dst):
            key = (src, dst, tuple(shape), str(jnp.dtype(dtype)))
            if key not in self._hop_fillers:
                filler = jax.device_put(np.zeros(shape, dtype), self.stages[dst].sharding())
                self._hop_fillers[key] = [sh.data for sh in filler.addressable_shards]
            mine += self._hop_fillers[key]
        return jax.make_array_from_single_device_arrays((2 * shape[0], *shape[1:]), sharding, mine)

    def _swap_program(self):
        """Two stages over processes: one program with both hand-offs of a pipeline step, stage
        0's hidden states to stage 1 and stage 1's sampled ids to stage 0 (two collective-permutes
        over the hop mesh of stages (0, 1)), so each micro-batch step launches one hop program
        instead of two (each hop launch cost the host about 0.15 ms of execute plus the call's
        own overhead on 2 H200s, h200x2_profile_pp2mp_w1_479b533.json)."""
        if self._swap_fn is None:
            from jax.sharding import PartitionSpec

            mesh2 = self._hop_program(0, 1)[0]
            hop = PartitionSpec("hop")
            self._swap_fn = jax.jit(jax.shard_map(
                lambda h, ids: (jax.lax.ppermute(h, "hop", [(0, 1)]), jax.lax.ppermute(ids, "hop", [(1, 0)])),
                mesh=mesh2, in_specs=(hop, hop), out_specs=(hop, hop)))
        return self._swap_fn

    def _swap(self, h, ids, T: int):
        """Hand stage 0's hidden states `h` [T, hidden] to stage 1 and stage 1's sampled ids `ids`
        [max_num_seqs] to stage 0 in one program (2 stages over processes; every process calls it
        at the same point). Returns (hidden states on stage 1 or None, ids on stage 0 or None)."""
        from jax.sharding import NamedSharding, PartitionSpec

        mesh2 = self._hop_program(0, 1)[0]
        hop = NamedSharding(mesh2, PartitionSpec("hop"))
        shape_h = (T, self.cfg.hidden_size)
        g_h = self._hop_input(h, 0, 1, shape_h, self.dtype, hop)
        g_i = self._hop_input(ids, 1, 0, (self.max_num_seqs,), jnp.int32, hop)
        out_h, out_i = self.compile("swap", (shape_h, str(self.dtype)))(g_h, g_i)
        self.num_swaps += 1
        return self._hop_output(out_h, 1, shape_h), self._hop_output(out_i, 0, (self.max_num_seqs,))

    def _executable_cache_ok(self) -> bool:
        """jvllm's executable cache (jvllm.compile) serves single-process runners, TP and PP meshes
        included, while JAX's persistent cache directory is set (multi-process runs compile: every
        process would need the same entry at once)."""
        return (self.use_executable_cache and jax.process_count() == 1
                and jcompile.executable_cache_dir() is not None)

    # ------------------------------------------------------------------ host inputs
    def prepare(self, scheduled, allow_decode: bool = True, prev_rows: dict | None = None):
        """numpy inputs for one step from a list of ScheduledRequest:
        (T bucket, R bucket, decode-only?, tokens, AttentionMetadata, src). A request whose last
        token is still on the device (sampled by the step in flight, async scheduling) has it taken
        from that step's output: src[t] = its row there (`prev_rows[request_id]`), else -1."""
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
            known = s.req.all_token_ids[start:start + n]
            toks += known
            if len(known) < n:  # the one pending token (async scheduling)
                if len(known) != n - 1 or prev_rows is None or s.req.request_id not in prev_rows:
                    raise RuntimeError(f"request {s.req.request_id}: {n - len(known)} input tokens are not known")
                pend_at.append(len(toks))
                pend_row.append(prev_rows[s.req.request_id])
                toks.append(0)
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
        return T, R, decode, tokens, md, src

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
            counter[r] = s.req.num_output_tokens + s.req.num_pending  # index of the token drawn now
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
    def _microbatches(self, scheduled, prev_groups=None):
        """Split a step into up to `num_microbatches` groups of (index, ScheduledRequest): the
        scheduler's micro-batches (`Request.microbatch`, engine runs), else balanced by tokens
        (several pipeline stages; one group otherwise). Returns [(group, p)] where p is
        the index of the group of `prev_groups` (the step still in flight) whose sampled ids this
        group's pending tokens come from, or None.

        With a step in flight (async scheduling) groups are stable: a request that was in group p
        of the previous step stays with the others of group p, so each group's pending tokens sit
        in one device array (that group's sampled ids) and micro-batch g of step N+1 follows
        micro-batch g of step N through the stages: stage 0 starts step N+1's first micro-batch
        while the last stage still works on step N's second one, so the pipeline stays full
        across steps, not only within one. New requests go to the group with the fewest tokens."""
        m = min(self.num_microbatches, len(scheduled)) if len(self.stages) > 1 else 1
        owner = {} if prev_groups is None else {s.req.request_id: p for p, e in enumerate(prev_groups)
                                                for _, s in _group(e)}  # no wait for stage threads or deferred hand-offs
        if m > 1 and all(getattr(s.req, "microbatch", None) is not None for s in scheduled):
            # the scheduler's micro-batches (each within the token budget, members stable while running)
            by: dict[int, list] = {}
            for i, s in enumerate(scheduled):
                by.setdefault(s.req.microbatch, []).append((i, s))
            out = []
            for g in sorted(by):
                ps = {owner[s.req.request_id] for _, s in by[g] if s.req.request_id in owner}
                if len(ps) > 1:
                    raise RuntimeError(f"micro-batch {g} draws pending tokens from micro-batches {sorted(ps)} "
                                       "of the step in flight; a request changed micro-batch while running")
                out.append((by[g], ps.pop() if ps else None))
            return out
        if prev_groups is None:
            if m <= 1:
                return [(list(enumerate(scheduled)), None)]
            total = sum(s.num_tokens for s in scheduled)
            groups, cur, acc = [], [], 0
            for i, s in enumerate(scheduled):
                cur.append((i, s))
                acc += s.num_tokens
                if acc >= total * (len(groups) + 1) / m and len(groups) < m - 1:
                    groups.append(cur)
                    cur = []
            if cur:
                groups.append(cur)
            return [(g, None) for g in groups]
        pinned: dict[int, list] = {}
        free = []
        for i, s in enumerate(scheduled):
            p = owner.get(s.req.request_id)
            (free if p is None else pinned.setdefault(p, [])).append((i, s))
        out = [(g, p) for p, g in sorted(pinned.items())]
        while len(out) < max(m, 1):
            out.append(([], None))
        load = [sum(s.num_tokens for _, s in g) for g, _ in out]
        for item in free:
            k = int(np.argmin(load))
            out[k][0].append(item)
            load[k] += item[1].num_tokens
        return [(sorted(g, key=lambda t: t[0]), p) for g, p in out if g]

    def dispatch(self, scheduled, prev=None):
        """Enqueue one step on the device(s) without waiting for it; returns a handle for `collect`.
        `prev`: the handle of the step still in flight whose sampled ids some of these requests
        need as input (async scheduling), else None. Each micro-batch takes its pending tokens from
        the one micro-batch of `prev` its requests were in (`_microbatches`); the ids move to the
        first stage's devices as a device-to-device copy that the first stage's program waits on,
        never through the host."""
        tm = self.timers
        prev_groups = prev[1] if prev is not None else None
        first_shard = self.stages[0].sharding()
        work = []  # host-side inputs of every micro-batch first, then the launches
        for group, p in self._microbatches(scheduled, prev_groups):
            sched = [s for _, s in group]
            prev_tok, prev_rows, prev_entry = None, None, None
            if p is not None:
                if self.multiprocess:  # its ids may still be due to cross processes: resolved at launch
                    p_group, prev_entry = _group(prev_groups[p]), prev_groups[p]
                else:
                    p_group, *_, prev_tok = _entry(prev_groups[p])
                prev_rows = {s.req.request_id: row for row, (_, s) in enumerate(p_group)}
            t0 = time.perf_counter()
            T, R, decode, tokens, md, src = self.prepare(sched, prev_rows=prev_rows)
            packed = self.pack_inputs(T, decode, tokens, src, md)
            t1 = time.perf_counter()
            if all(_plain_greedy(s.req.params) for s in sched):  # the argmax program needs no inputs
                sb, ex, want_lp, greedy = None, None, False, True
            else:
                sb, ex, want_lp = self._sampling_inputs(sched, R)
                greedy = ex is None and not want_lp and not np.any(sb.temperature[:len(sched)] > 0)
            tm["prepare_s"] += t1 - t0
            tm["sample_inputs_s"] += time.perf_counter() - t1
            has_src = bool((src >= 0).any())
            if prev_entry is not None and has_src:
                tok_in = prev_entry  # _launch_multiprocess takes its ids (on stage 0) at launch
            elif prev_tok is not None and has_src:
                tok_in = prev_tok if first_shard is None else self._to_stage(prev_tok, len(self.stages) - 1, 0)
            else:
                tok_in = self._no_prev
            work.append(dict(group=group, sched=sched, T=T, R=R, decode=decode, packed=packed, x=None,
                             tok_in=tok_in, sb=sb, ex=ex, want_lp=want_lp, greedy=greedy))
        # Launch order: micro-batch by micro-batch, each through all stages, then its sampler.
        # Measured on 2 H200s (PP=2, W1): 8,688 out tok/s this way against 7,503 stage-major (every
        # micro-batch's stage 0 first; bench_pp2 JSONs of commits 1fbff9a and 377d736).
        if self.multiprocess:
            return len(scheduled), [self._launch_multiprocess(w) for w in work]
        if self.stage_threads and len(self.stages) > 1:
            return len(scheduled), [self._launch_threaded(w) for w in work]
        pending = []
        for w in work:
            for s_idx in range(len(self.stages)):
                out = self._launch_stage(s_idx, w)
            pending.append(self._launch_sample(w, out))
        return len(scheduled), pending

    def _launch_multiprocess(self, w):
        """Micro-batch `w` through stages spread over processes: this process's stages launched,
        each stage's hidden states handed to the next stage's process (both ends call the hop, in
        the same order in every process), the sampler in the last stage's process. Its sampled ids
        go to the first stage's process later (`_Deferred`), after the next micro-batch's stage 0:
        on 2 GPUs the order per step (micro-batches a, b) is then GPU 0: s0(a), send h(a), s0(b),
        send h(b), receive ids(a); GPU 1: receive h(a), s1(a), sample(a), receive h(b), send
        ids(a), s1(b), ... and neither GPU waits in a collective while the other computes."""
        n = len(self.stages)
        prev = w["tok_in"]
        if isinstance(prev, _Deferred):  # its input ids may still be due: every process hands them over now
            ids = _entry(prev)[4]
            w["tok_in"] = ids if self.local(0) else self._no_prev
        out = None
        for s_idx in range(n):
            if self.local(s_idx):
                out = self._launch_stage(s_idx, w, on_stage=True)
            if n == 2 and s_idx == 0 and self._deferred:
                # both hand-offs in one program: this micro-batch's hidden states to stage 1, the
                # oldest deferred micro-batch's ids to stage 0
                e = self._deferred.pop(0)
                t = time.perf_counter()
                h1, ids0 = self._swap(w["x"] if self.local(0) else None, e.own, w["T"])
                self._add_time("sample_call_s", time.perf_counter() - t)
                w["x"] = h1
                tok = e.own if self.local(1) else ids0
                e.value = (e.group, tok, None, None, tok)
                self._flush_deferred()  # any older ones still due (none in the steady state)
                continue
            if s_idx < n - 1 and (self.local(s_idx) or self.local(s_idx + 1)):
                w["x"] = self._to_stage(w["x"] if self.local(s_idx) else None, s_idx, s_idx + 1,
                                        shape=(w["T"], self.cfg.hidden_size), dtype=self.dtype)
            if s_idx == 0:  # stage 0 of this micro-batch is queued: earlier micro-batches' ids may cross
                self._flush_deferred()
        own = self._launch_sample(w, out)[4] if self.local(n - 1) else None
        entry = _Deferred(w["group"], self, own)
        self._deferred.append(entry)
        return entry

    def _flush_deferred(self):
        """Hand every deferred micro-batch's sampled ids from the last stage's process to the first
        stage's, oldest first (all processes call this at the same points)."""
        n = len(self.stages)
        while self._deferred:
            e = self._deferred.pop(0)
            t = time.perf_counter()
            moved = None
            if self.local(n - 1) or self.local(0):
                moved = self._to_stage(e.own, n - 1, 0, shape=(self.max_num_seqs,), dtype=jnp.int32)
            self._add_time("sample_call_s", time.perf_counter() - t)
            tok = e.own if self.local(n - 1) else moved
            e.value = (e.group, tok, None, None, tok)

    def _launch_stage(self, s_idx, w, on_stage: bool = False):
        """Enqueue stage `s_idx` of micro-batch `w` (moving its input onto the stage's devices)."""
        st = self.stages[s_idx]
        shard = st.sharding()
        t1 = time.perf_counter()
        packed = _put(w["packed"], shard)  # this stage's host inputs: one transfer
        if st.first:
            x = w["tok_in"]
        else:  # hidden states of the previous stage: device to device
            x = self._to_stage(w["x"], s_idx - 1, s_idx) if shard is not None and not on_stage else w["x"]
        self._add_time("step_call_put_s", time.perf_counter() - t1)
        out = self.compile("step", (s_idx, w["T"], w["decode"]))(st.leaves, st.kv, packed, x)
        st.kv = out[0]
        w["x"] = out[-1]
        self._add_time("step_call_s", time.perf_counter() - t1)
        return out

    def _launch_sample(self, w, out):
        """Enqueue the sampler (and prompt logprobs) of micro-batch `w` after its last stage; returns
        its pending entry (group, ids, logprobs or None, prompt logprobs, ids padded for prev_tok)."""
        t3 = time.perf_counter()
        _, last_h, all_h = out
        sched, R, sb, ex = w["sched"], w["R"], w["sb"], w["ex"]
        if w["greedy"]:
            tok, tok_pad = self.compile("sample", (R, "greedy"))(self.head_w, last_h)
            lp = None
        else:
            shard = self.stages[-1].sharding()
            if shard is not None:
                sb, ex = jax.tree_util.tree_map(lambda a: _put(np.asarray(a), shard), (sb, ex))
            tok, lp, tok_pad = self.compile("sample", (R, ex is not None))(self.head_w, last_h, sb, ex)
        self._add_time("sample_call_s", time.perf_counter() - t3)
        plp = None
        if any(s.req.needs_prompt_logprobs for s in sched):
            plp = self._prompt_logprobs(sched, w["T"], all_h)
        return (w["group"], tok, lp if w["want_lp"] else None, plp, tok_pad)

    def _add_time(self, key, dt):
        with self._timer_lock:
            self.timers[key] += dt

    def _launch_threaded(self, w):
        """`stage_threads`: stage 0 is enqueued from the calling thread; every later stage from a
        thread of its own (one per stage, so a stage still runs its micro-batches in order and owns
        its KV pool), chained through futures. A stage's launch may block on its input crossing
        from the previous stage's devices (if the runtime copies between devices synchronously),
        and this way that blocks only that stage's thread, never the next micro-batch's stage 0.
        Returns the micro-batch's pending entry with its device values as futures (_Pending)."""
        import concurrent.futures as cf

        if self._stage_pools is None:
            self._stage_pools = [cf.ThreadPoolExecutor(1, thread_name_prefix=f"jvllm-stage{s}")
                                 for s in range(1, len(self.stages))]
        self._launch_stage(0, w)  # sets w["x"] for stage 1
        fut = None
        for s_idx in range(1, len(self.stages)):
            last = s_idx == len(self.stages) - 1

            def run(s_idx=s_idx, prev=fut, last=last):
                if prev is not None:  # stage s_idx - 1 (another thread) has enqueued this micro-batch
                    prev.result()
                o = self._launch_stage(s_idx, w)
                return self._launch_sample(w, o) if last else o

            fut = self._stage_pools[s_idx - 1].submit(run)
        return _Pending(w["group"], fut)

    def collect(self, handle) -> StepResult:
        """Wait for a dispatched step and bring its sampled ids (and logprobs) to the host."""
        n, pending = handle
        token_ids = np.zeros(n, np.int32)
        lps = None
        plp_all = {}
        for e in pending:
            group, tok, lp, plp, _ = _entry(e)
            rows = [i for i, _ in group]
            token_ids[rows] = _to_host(tok)[: len(rows)]
            if lp is not None:
                if lps is None:
                    lps = (np.zeros(n, np.float32), np.zeros(n, np.int32),
                           np.zeros((n, NUM_TOP_LOGPROBS), np.int32), np.zeros((n, NUM_TOP_LOGPROBS), np.float32))
                for dst, src in zip(lps, lp):
                    dst[rows] = _to_host(src)[: len(rows)]
            if plp:
                spans, dev = plp
                host = [_to_host(a) for a in dev]
                for local, (o, pos) in spans.items():
                    plp_all[rows[local]] = (pos, *(a[o:o + len(pos)] for a in host))
        return StepResult(token_ids, lps, plp_all)

    def execute(self, scheduled) -> StepResult:
        return self.collect(self.dispatch(scheduled))

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
        shard = self.stages[-1].sharding()
        out = self.compile("prompt_lp", T)(self.head_w, all_h, _put(targets, shard))
        return (spans, out)  # device arrays: brought to the host in `collect`, not here

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
            T, R, _, tokens, md, src = self.prepare(sched, allow_decode=False)
        finally:
            self.token_buckets = saved
        if len(self.stages) != 1:
            raise ValueError("sequence_logits needs a single-stage runner")
        st = self.stages[0]
        packed = self.pack_inputs(T, False, tokens, src, md)
        st.kv, _, h = self._step_fns[(0, False)](st.leaves, st.kv, packed, np.zeros(self.max_num_seqs, np.int32), T=T)
        return np.asarray(self._logits_fn(self.head_w, h))

    @functools.cached_property
    def _logits_fn(self):
        return jax.jit(functools.partial(self._logits, tied=self.cfg.tie_word_embeddings))
