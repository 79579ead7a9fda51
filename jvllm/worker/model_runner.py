"""ModelRunner: turns a step's scheduled requests into device inputs, launches them through its
stage executor, and brings the sampled ids (and logprobs) back.

`dispatch(scheduled, prev)` prepares every micro-batch's host inputs (`inputs.InputLayout`,
`sampler`), then has the executor (`executors/`, chosen once here) launch them; it returns a
`DispatchedStep` for `collect`. Programs come from the registry (`self.programs.get(kind, key)`),
compiled at warm-up or on demand.

Parallelism: the runner holds one or more pipeline stages (`stage.Stage`), each a model slice with
its own weights, KV pages and device sub-mesh (tensor parallelism inside a stage is GSPMD over
NamedSharding'd params and KV pages). With several stages the work comes as micro-batches
dispatched asynchronously stage after stage, so stage s works on micro-batch m while stage s+1
works on m-1.

Hazard: anything here that calls a jnp function eagerly with a new shape compiles a tiny XLA
program at serving time; the compile counter catches that in tests.
"""
from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from jvllm.compilation.registry import Programs
from jvllm.config import ModelConfig, cdiv
from jvllm.memory import kv_cache
from jvllm.sampling import NUM_TOP_LOGPROBS, SamplerImpl
from jvllm.worker import logits_processors, microbatches, programs, sampler
from jvllm.worker.attention_modes import attention_modes
from jvllm.worker.batch_invariant import StepVariants
from jvllm.worker.executors import MicrobatchResult, Pending, Work, make_executor
from jvllm.worker.inputs import InputLayout
from jvllm.worker.stage import Stage, put, to_host


@dataclasses.dataclass
class StepResult:
    token_ids: np.ndarray                 # [R] sampled ids (rows of scheduled requests, in order)
    logprobs: tuple | None                # (tok_lp [R], rank [R], top_ids [R,N], top_lp [R,N]) or None
    prompt_logprobs: dict                 # row -> (positions, tok_lp, rank, top_ids, top_lp)
    hidden_states: dict = dataclasses.field(default_factory=dict)  # row -> (start, [L+1, n, hidden] numpy)
    spec: dict = dataclasses.field(default_factory=dict)  # row -> spec_decode.inputs.SpecRowResult (rows with drafts)


@dataclasses.dataclass
class DispatchedStep:
    """A dispatched step: its number of rows and one Pending per micro-batch; `late`: (work,
    forward outputs) per micro-batch while a `late_sampling` dispatch waits for its samplers."""
    num_rows: int
    pending: list[Pending]
    late: list | None = None
    spec: list = dataclasses.field(default_factory=list)  # [(step rows, draft counts, tokens, num_accepted, logprobs)] on device


def _not_sampled():
    raise RuntimeError("a late_sampling step was read (or fed a later step) before launch_sampling enqueued "
                       "its samplers")


def _split_hidden(hs: np.ndarray, sched, rows) -> dict:
    """{step row: (first position, hs[:, its tokens])} for the rows that asked; a row's tokens are
    consecutive in the flat batch, in scheduled order."""
    out, off = {}, 0
    for row, s in zip(rows, sched):
        if s.req.params.return_hidden_states:
            out[row] = (s.start, hs[:, off:off + s.num_tokens])
        off += s.num_tokens
    return out


def _steer_inputs(sched, T: int, R: int, cfg, dtype):
    """(vectors [R, num_layers, hidden], row of each token [T], -1 = none) for the rows that steer,
    or None when none does (the plain step program runs)."""
    if not any(s.req.params.steering for s in sched):
        return None
    vecs = np.zeros((R, cfg.num_layers, cfg.hidden_size), dtype)
    row = np.full(T, -1, np.int32)
    off = 0
    for r, s in enumerate(sched):
        st = s.req.params.steering
        if st:
            for layer, v in st.items():
                vecs[r, layer] = v
            row[off:off + s.num_tokens] = r
        off += s.num_tokens
    return vecs, row


class ModelRunner:
    def __init__(self, cfg: ModelConfig, graphdef=None, state=None, head_w=None, *, dtype, block_size: int,
                 num_blocks: int, max_model_len: int, max_num_seqs: int, token_buckets: tuple[int, ...],
                 query_tile: int = 8, kv_chunk_blocks: int = 16, stages: list[Stage] | None = None,
                 num_microbatches: int | None = None, attention_backend: str = "auto",
                 logits_processors: tuple = (), batch_invariant: bool = False, kv_dtype=None,
                 sampler_impl: SamplerImpl | None = None):
        """`kv_dtype`: the KV pages' dtype (`kv_cache.resolve_dtype`; None: the model's `dtype`).
        `sampler_impl`: `jvllm.sampling.SamplerImpl` (None: the platform's)."""
        self.cfg = cfg
        self.stages = stages or [Stage(graphdef, state)]
        self.head_w = head_w
        self.dtype = jnp.dtype(dtype)
        self.kv_dtype = jnp.dtype(dtype if kv_dtype is None else kv_dtype)
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.logits_processors = logits_processors  # ((name, fn), ...): jvllm.worker.logits_processors
        self.num_microbatches = num_microbatches or len(self.stages)
        self.variants = StepVariants.for_mode(batch_invariant)  # jvllm.worker.batch_invariant
        self.attention_backend, self.attention_modes = attention_modes(attention_backend)
        max_blocks = cdiv(max_model_len, block_size)
        self.kv_chunk_blocks = min(kv_chunk_blocks, max_blocks)
        self.layout = InputLayout(tuple(token_buckets), max_num_seqs, query_tile, block_size, num_blocks,
                                  cdiv(max_blocks, self.kv_chunk_blocks) * self.kv_chunk_blocks,
                                  decode_variants=self.variants.decode_variants)
        self.platform = jax.default_backend()
        # GPUs: exact sampler variants without conds (a cond blocks the dispatcher); elsewhere conds
        self.sampler_impl = sampler_impl or SamplerImpl.for_platform(self.platform)
        if batch_invariant:  # vocabulary sums in a fixed order whatever the rows (jvllm.worker.batch_invariant)
            self.sampler_impl = dataclasses.replace(self.sampler_impl, fixed_order_sums=True)
        # stages over several processes: each process launches only its own stages
        self.pid = jax.process_index()
        self.multiprocess = jax.process_count() > 1 and len(self.stages) > 1
        self._local = [not self.multiprocess or st.mesh is None
                       or next(iter(st.mesh.devices.flat)).process_index == self.pid for st in self.stages]
        for i, st in enumerate(self.stages):
            st.kv = (kv_cache.allocate(cfg, st.num_layers(), num_blocks, block_size, self.kv_dtype,
                                       st.sharding(st.kv_spec)) if self.local(i) else None)  # else another process's pool
        first = self.stages[0]
        z = np.zeros(self.max_num_seqs, np.int32)
        self.no_prev = put(z, first.sharding()) if first.sharding() is not None else jnp.asarray(z)
        self.timers = dict(prepare_s=0.0, step_call_s=0.0, sample_inputs_s=0.0, sample_call_s=0.0, step_call_put_s=0.0,
                           grammar_mask_s=0.0, late_sampling_s=0.0)
        self.jit_cache: dict = {}
        self.spec: tuple[int, bool] | None = None  # speculative decoding: (k, draft probs?), set by the engine before warm-up
        self.executor = make_executor(self)
        self.programs = Programs(self)  # every kind registered by worker/programs.py and executors/

    # ------------------------------------------------------------------ facts
    @property
    def token_buckets(self) -> tuple[int, ...]:
        return self.layout.token_buckets

    @property
    def num_blocks(self) -> int:
        return self.layout.num_blocks

    @property
    def block_size(self) -> int:
        return self.layout.block_size

    @property
    def num_swaps(self) -> int:
        return getattr(self.executor, "num_swaps", 0)

    def local(self, s_idx: int) -> bool:
        """Whether stage `s_idx` runs in this process (always, in a single-process run)."""
        return self._local[s_idx]

    @property
    def kv(self):
        """Single stage: its [(K, V)]; several: every local stage's pairs in order."""
        return self.stages[0].kv if len(self.stages) == 1 else [kv for st in self.stages for kv in st.kv or ()]

    @property
    def state(self):
        return self.stages[0].state

    def warmup_keys(self) -> tuple[list, list]:
        """(the programs every request needs: the smallest decode step and its greedy sampler;
        every other program, in the order a new workload meets them: each token bucket's prefill
        step and greedy sampler from the smallest bucket up (a 1-token prefill step after
        them), then the rest), this process's only.
        A request whose program is not compiled yet compiles it on demand (or waits for the
        warm-up thread if that is compiling it). Batch-invariant mode: the first are its one step
        program and its greedy sampler. The masked twin (mask=True) of every `sample` variant
        comes last."""
        keys = self.programs.keys()
        # the masked twin of every sampler variant (grammars, allowed_token_ids, bad_words)
        keys += [("sample", (key[0], dataclasses.replace(key[1], mask=True))) for kind, key in keys if kind == "sample"]
        b = self.layout.token_buckets
        t_dec = min((T for T in b if self.layout.has_decode_variant(T)), default=b[0])
        sampler0 = ("greedy", self.layout.seq_bucket(t_dec))
        first = [k for k in keys if (k[0] == "step" and k[1][1:] == (t_dec, self.layout.has_decode_variant(t_dec)))
                 or k == sampler0]

        def order(k):
            kind, key = k
            if kind == "step" and key[2] is False:
                # a 1-token prefill step (the CPU's 1-token bucket) runs only for a 1-token prompt alone
                return (0, key[1] if key[1] > 1 else b[-1] + 1, 0)
            if kind == "greedy":
                return (0, key, 1)
            return (1, 0, 0)

        return first, sorted((k for k in keys if k not in first), key=order)

    def release(self):
        """Drop device buffers (weights and KV pools) so their memory returns at once."""
        for st in self.stages:
            kv_cache.delete((st.kv, st.state))
            st.kv = st.state = st.leaves = None
            st._packed = (None, None)  # the packed copies of the small leaves
        kv_cache.delete(self.head_w)
        self.head_w = None
        self.programs.clear()
        self.executor.release()

    # ------------------------------------------------------------------ execute
    def dispatch(self, scheduled, prev: DispatchedStep | None = None, late_sampling: bool = False,
                 spec_q=None) -> DispatchedStep:
        """Enqueue one step on the device(s) without waiting for it; returns a handle for `collect`.
        `prev`: the handle of the step still in flight whose sampled ids some of these requests
        need as input (async scheduling), else None. Each micro-batch takes its pending tokens from
        the one micro-batch of `prev` its requests were in; the ids move to the first stage's
        devices on the device, never through the host.

        `late_sampling` (needs `executor.late_sampling`): enqueue only the forwards now; the
        sampling inputs (a grammar's mask, penalties' history, logits processors' inputs) are built
        from the requests' host state and the samplers enqueued by `launch_sampling(handle)`, which
        must come before `collect` or before the handle is a later dispatch's `prev`. The engine
        calls it once the step before has been read, so those inputs see its tokens while this
        step's forward runs.
        Rows with draft tokens (`ScheduledRequest.spec_token_ids`) are verified by the spec_verify
        program after the step (single stage, never `late_sampling`); `spec_q`: the draft model's
        (probabilities [max_num_seqs, k, V] on device, {request_id: row}) or None (one-hot drafts)."""
        if late_sampling and not self.executor.late_sampling:
            raise ValueError(f"late_sampling: the {type(self.executor).__name__} launches whole micro-batches only")
        tm = self.timers
        prev_groups = prev.pending if prev is not None else None
        work = []  # host-side inputs of every micro-batch first, then the launches
        for group, p in microbatches.split(scheduled, self.num_microbatches, len(self.stages), prev_groups):
            sched = [s for _, s in group]
            prev_rows = None
            if p is not None:
                prev_rows = {s.req.request_id: row for row, (_, s) in enumerate(prev_groups[p].group)}
            t0 = time.perf_counter()
            ps = self.layout.prepare(sched, prev_rows=prev_rows)
            packed = self.layout.pack(ps)
            tm["prepare_s"] += time.perf_counter() - t0
            if p is not None and bool((ps.src >= 0).any()):
                tok_in = self.executor.prev_ids(prev_groups[p])
            else:
                tok_in = self.no_prev
            w = Work(group, sched, ps.T, ps.R, ps.decode, packed, tok_in,
                     capture=any(s.req.params.return_hidden_states for s in sched),
                     steer=_steer_inputs(sched, ps.T, ps.R, self.cfg, self.dtype))
            if not late_sampling:
                self._sampling_inputs(w)
            work.append(w)
        if late_sampling:  # the forwards now, the samplers in launch_sampling
            late = [(w, self.executor.forward(w)) for w in work]
            return DispatchedStep(len(scheduled), [Pending(w.group, resolve=_not_sampled) for w in work], late)
        # launch order: micro-batch by micro-batch, each through all stages, then its sampler
        pending, spec = [], []
        for w in work:
            drafted = [bool(getattr(s, "spec_token_ids", None)) for s in w.sched]
            if all(drafted) and not any(s.req.needs_prompt_logprobs for s in w.sched):
                # every row's tokens come from spec_verify: no sampler program (nor its LM-head
                # matmul); its ids are never read, and its tok_pad is spec_verify's next_pad
                self.executor.forward(w)
                pending.append(Pending(w.group, MicrobatchResult(w.group, np.zeros(w.R, np.int32), None, None, None)))
            else:
                pending.append(self.executor.launch(w))
            if any(drafted):
                res = pending[-1].value  # None only for stages over processes (never ahead of a verify)
                base = res.tok_pad if res is not None and res.tok_pad is not None else self.no_prev
                rec, next_pad = self._launch_verify(w, spec_q, base)
                spec.append(rec)
                if res is not None:
                    res.tok_pad = next_pad  # the next step's prev_tok: verified rows' last token + count
        return DispatchedStep(len(scheduled), pending, spec=spec)

    @property
    def ahead_after_verify(self) -> bool:
        """A step may take its input ids from a verify step in flight: its step programs read the
        accepted counts (`programs.takes_accepted_counts`) and its executor is in-process."""
        return programs.takes_accepted_counts(self) and self.executor.late_sampling

    def _launch_verify(self, w, spec_q, base_pad):
        """Enqueue spec_verify on the step's hidden states (`w.x`: the last stage's output); returns
        (the record `collect` reads, next_pad)."""
        from jvllm.spec_decode.inputs import verify_inputs

        if self.spec is None or len(self.stages) != 1:
            raise RuntimeError("draft tokens reached a runner without speculative decoding (single stage) set up")
        k, probs = self.spec
        vi = verify_inputs(w.sched, w.R, k, self.cfg.vocab_size, spec_q[1] if spec_q is not None else None)
        if probs != (spec_q is not None):
            raise RuntimeError(f"spec_verify set up {'with' if probs else 'without'} draft probabilities, "
                               f"got {'some' if spec_q is not None else 'none'}")
        shard = self.stages[-1].sharding()
        args = (vi.idx, vi.draft, vi.num_draft, vi.sb) + ((vi.q_rows,) if probs else ())
        if shard is not None:
            args = jax.tree_util.tree_map(lambda a: put(np.asarray(a), shard), args)
        q = (spec_q[0], args[4]) if probs else (None, None)
        greedy = not np.any(vi.sb.temperature > 0)
        tok, acc, lp, next_pad = self.programs.get("spec_verify", (w.T, k, probs, vi.want_lp, bool(greedy)))(
            self.head_w, w.x, *args[:4], base_pad, *q)
        return ([i for i, _ in w.group], vi.num_draft, tok, acc, lp), next_pad

    def launch_sampling(self, handle: DispatchedStep):
        """The second half of a `late_sampling` dispatch: build each micro-batch's sampling inputs
        from the requests' state now and enqueue its sampler (a no-op for other handles)."""
        if handle.late is None:
            return
        t0 = time.perf_counter()
        late, handle.late = handle.late, None
        for (w, out), pending in zip(late, handle.pending):
            self._sampling_inputs(w)
            pending.value = self.executor.launch_sample(w, out)
        self.timers["late_sampling_s"] += time.perf_counter() - t0

    def _sampling_inputs(self, w: Work):
        """Fill `w`'s sampler inputs (`sampler.plan`: the variant and the one packed per-row array,
        masks included; logits processors' inputs) from its requests' host state."""
        tm, sched = self.timers, w.sched
        t1 = time.perf_counter()
        # batch-invariant mode: the largest sampler variant for every batch that samples
        w.plan = sampler.plan(sched, w.R, self.cfg.vocab_size, self.max_model_len, self.sampler_impl,
                              full=self.variants.full_sampler)
        tm["grammar_mask_s"] += w.plan.mask_fill_s if w.plan is not None else 0.0
        w.procs_in = None
        if logits_processors.uses_processors(sched):
            w.procs_in = logits_processors.host_inputs(sched, w.R, tuple(n for n, _ in self.logits_processors),
                                                       self.max_model_len)
        tm["sample_inputs_s"] += time.perf_counter() - t1

    def collect(self, handle: DispatchedStep) -> StepResult:
        """Wait for a dispatched step and bring its sampled ids (and logprobs) to the host."""
        n = handle.num_rows
        token_ids = np.zeros(n, np.int32)
        lps = None
        plp_all, hs_all = {}, {}
        for e in handle.pending:
            res = e.result()
            rows = [i for i, _ in res.group]
            token_ids[rows] = to_host(res.tok)[: len(rows)]
            if res.logprobs is not None:
                if lps is None:
                    lps = (np.zeros(n, np.float32), np.zeros(n, np.int32),
                           np.zeros((n, NUM_TOP_LOGPROBS), np.int32), np.zeros((n, NUM_TOP_LOGPROBS), np.float32))
                for dst, src in zip(lps, res.logprobs):
                    dst[rows] = to_host(src)[: len(rows)]
            if res.prompt_logprobs:
                spans, dev = res.prompt_logprobs
                host = [to_host(a) for a in dev]
                for local, (o, pos) in spans.items():
                    plp_all[rows[local]] = (pos, *(a[o:o + len(pos)] for a in host))
            if res.hidden_states is not None:
                hs_all.update(_split_hidden(to_host(res.hidden_states), [s for _, s in res.group], rows))
        from jvllm.spec_decode.inputs import SpecRowResult

        spec = {}
        for rows, nd, tok, acc, lp in handle.spec:
            tok, acc = to_host(tok), to_host(acc)
            lp = None if lp is None else [to_host(a) for a in lp]
            for local, row in enumerate(rows):
                if nd[local]:
                    spec[row] = SpecRowResult(tok[local], int(acc[local]),
                                              None if lp is None else tuple(a[local] for a in lp))
        return StepResult(token_ids, lps, plp_all, hs_all, spec=spec)

    def execute(self, scheduled) -> StepResult:
        return self.collect(self.dispatch(scheduled))

    def prompt_logprobs(self, scheduled, T, all_h):
        """Enqueue prompt logprobs of the requests that ask (last stage): ({row: (offset,
        positions)}, device arrays), or None when no position of this step needs one."""
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
            return None
        out = self.programs.get("prompt_lp", T)(self.head_w, all_h, put(targets, self.stages[-1].sharding()))
        return (spans, out)  # device arrays: brought to the host in `collect`, not here

    # ------------------------------------------------------------------ one-off forward
    def sequence_logits(self, token_ids) -> np.ndarray:
        """float32 logits [n, vocab] of one whole sequence, computed as one prefill through the
        paged path (blocks 1..k of this runner's pool, which it overwrites: for `jvllm verify` and
        tests, never on a runner that is serving). Compiles for each new length."""
        from types import SimpleNamespace

        if len(self.stages) != 1:
            raise ValueError("sequence_logits needs a single-stage runner")
        ids = [int(t) for t in token_ids]
        n, bs = len(ids), self.block_size
        blocks = list(range(1, cdiv(n, bs) + 1))
        if blocks and blocks[-1] >= self.num_blocks:
            raise ValueError(f"{n} tokens need {len(blocks)} blocks; this runner's pool has {self.num_blocks - 1}")
        req = SimpleNamespace(all_token_ids=ids)
        sched = [SimpleNamespace(req=req, num_tokens=n, start=0, block_ids=blocks)]
        layout = dataclasses.replace(self.layout, token_buckets=(n,))
        ps = layout.prepare(sched, allow_decode=False)
        st = self.stages[0]
        st.kv, _, h = programs.step_fn(self, 0, False)(st.params(), st.kv, layout.pack(ps),
                                                       np.zeros(self.max_num_seqs, np.int32), T=ps.T)
        return np.asarray(programs.logits_fn(self)(self.head_w, h))
