"""LLMEngine: add_request / abort_request / step / has_unfinished_requests.

The loop is nano-vllm's: schedule -> run -> postprocess. `step()` runs one scheduled batch (through
the loop chosen at construction, `loop.py`) and returns a RequestOutput for every user request that
made progress (or finished). Requests with n > 1 fan out into n sequences that share the prompt's
KV blocks through the prefix cache.

Host only: this module never imports jax; device work goes through the worker
(`jvllm.worker.worker.Worker`), imported at construction.
"""
from __future__ import annotations

import dataclasses
import itertools
import time

from jvllm.config import CacheConfig, SchedulerConfig, pow2_buckets
from jvllm.engine.bucket_fit import FLAT_TOKENS, BucketFit
from jvllm.engine.engine_config import EngineConfig, check_options, check_speculation
from jvllm.engine.input_processor import InputProcessor
from jvllm.engine.loop import StepHandle, make_loop
from jvllm.engine.output_processor import OutputProcessor, RequestGroup
from jvllm.engine.request import Status
from jvllm.engine.scheduler import Scheduler
from jvllm.engine.step_collect import StepCollect
from jvllm.engine.weights_sleep import WeightsAndSleep
from jvllm.memory.block_pool import KVCacheManager
from jvllm.outputs import RequestOutput
from jvllm.sampling_params import SamplingParams


class LLMEngine(StepCollect, WeightsAndSleep):
    def __init__(self, config: EngineConfig, devices=None):
        """`devices`: the devices of this engine (a data-parallel replica gets a slice); default all."""
        from jvllm.worker.worker import Worker

        t0 = time.perf_counter()
        self.config = config
        self.worker = worker = Worker(config, devices)
        self.model_config = mc = worker.model_config
        self.dtype = worker.dtype
        check_options(config, mc, data_parallel_replica=devices is not None)
        # async scheduling: a whole engine (data-parallel replicas are stepped by
        # DataParallelEngine through step_dispatch / step_collect, which is synchronous)
        self.async_scheduling = devices is None if config.async_scheduling is None else bool(config.async_scheduling)
        self.load_seconds = worker.load()  # the tokenizer may still be building: worker.tokenizer() waits
        self.num_stages = config.pipeline_parallel_size
        acc = worker.on_accelerator
        # None: the default; any other value (0 included) is the caller's, checked by SchedulerConfig
        max_model_len = mc.max_position_embeddings if config.max_model_len is None else config.max_model_len
        mnbt = (2048 if acc else 512) if config.max_num_batched_tokens is None else config.max_num_batched_tokens
        mns = min(256 if acc else 32, mnbt) if config.max_num_seqs is None else config.max_num_seqs
        # with pipeline stages the budget is per micro-batch (SchedulerConfig), so the runner's
        # micro-batches are the scheduler's and each one fits the largest bucket
        n_mb = (config.num_microbatches or self.num_stages) if self.num_stages > 1 else 1
        # CPUs get a 1-token bucket too: one prompt's decode steps (and their sampler) as 1-row
        # programs, matrix-vector products on XLA:CPU, ran much faster there than in the 8-row
        # bucket (benchmarks/README.md has the figure; the cause inside XLA:CPU is not profiled)
        default = pow2_buckets(8, mnbt) if acc else (1,) + pow2_buckets(8, mnbt)
        buckets = tuple(sorted(set(config.token_buckets or default)))
        if buckets[-1] < mnbt:
            buckets = buckets + (mnbt,)
        self.sched_config = SchedulerConfig(max_num_batched_tokens=mnbt, max_num_seqs=mns, max_model_len=max_model_len,
                                            num_microbatches=n_mb)
        bs = config.block_size
        self.cache_config = CacheConfig(block_size=bs, num_blocks=config.num_gpu_blocks_override,
                                        gpu_memory_utilization=config.gpu_memory_utilization,
                                        kv_cache_memory_bytes=config.kv_cache_memory_bytes,
                                        enable_prefix_caching=config.enable_prefix_caching)
        self.speculator = None
        spec_cfg = draft = None
        if config.speculative_config is not None:
            from jvllm.spec_decode.config import SpeculativeConfig

            spec_cfg = SpeculativeConfig.from_dict(config.speculative_config)
            check_speculation(config, spec_cfg)
            if spec_cfg.uses_draft_model:  # its weights load before the target's pool is sized
                from jvllm.spec_decode.draft import DraftProposer

                draft = DraftProposer(spec_cfg, config, mc, worker.tokenizer())
        num_blocks = worker.build_runner(self.sched_config, self.cache_config, buckets,
                                         extra_bytes_per_block=draft.kv_bytes_per_block() if draft else 0)
        if draft is not None:
            draft.build(self.sched_config, self.cache_config, buckets, num_blocks)
        self.runner = worker.runner
        self.init_parts = worker.init_parts
        t = time.perf_counter()
        self.kv_manager = KVCacheManager(num_blocks, bs, config.enable_prefix_caching)
        self.init_parts["block_pool_s"] = time.perf_counter() - t
        fit = BucketFit(buckets, FLAT_TOKENS) if config.fit_chunks_to_buckets else None
        self.scheduler = Scheduler(self.sched_config, self.kv_manager, fit)
        if spec_cfg is not None:
            self.speculator = self._build_speculator(spec_cfg, draft)
        # the first programs load (and the rest starts compiling) while the tokenizer may still be building
        self.warmup_seconds, self._warmup = worker.warm_up(config.background_compile, use_tqdm=config.use_tqdm_on_load,
                                                                first_only=config.warmup == "first")
        self.compiles_after_warmup_base = (self._warmup.compile_count_at_end if self._warmup.done() else None)
        try:
            self.tokenizer = worker.tokenizer()
        except BaseException:
            self._warmup.cancel()  # the engine is not built: stop its background compiles
            raise
        from jvllm import generation_config

        self.generation_defaults = generation_config.load(config.generation_config, config.model)
        tok_eos = getattr(self.tokenizer, "eos_token_id", None) if self.tokenizer is not None else None
        # the tokenizer's, config.json's and the generation config's end tokens (vLLM stops on all); the
        # first is vLLM's EOS (a finish by it has stop_reason None, by the others their id)
        self.eos_token_ids = tuple(dict.fromkeys(((tok_eos,) if isinstance(tok_eos, int) else ())
                                                 + tuple(mc.eos_token_ids) + self.generation_defaults.eos_token_ids))
        self._default_params = self._defaults_from(self.generation_defaults)
        refused = None
        if worker.multiprocess:
            refused = (f"logprobs are not available with pipeline stages over {worker.process_count} processes "
                       f"(only the sampled ids cross between them); run the stages in one process for logprobs")
        self.inputs = InputProcessor(self.tokenizer, mc.vocab_size, max_model_len, self.eos_token_ids, config.seed,
                                     logprobs_refused=refused, num_layers=mc.num_layers,
                                     num_stages=config.pipeline_parallel_size,
                                     processor_names=tuple(config.logits_processors or ()),
                                     hidden_size=mc.hidden_size)
        self.output = OutputProcessor(self.tokenizer)
        self.groups: dict[str, RequestGroup] = {}
        self._ids = itertools.count()
        self.loop = make_loop(self, self.async_scheduling, n_mb)
        # host_seconds: scheduling, input building, dispatch and post-processing (the device idles
        # through these unless a step is already queued); device_wait_seconds: blocked on results;
        # overlap_host_seconds: the part of host_seconds spent reading a step and building the next
        # step's sampling inputs while that step's forward was already enqueued (num_late_steps);
        # num_ahead_steps: steps dispatched while the step before them was in flight (the rest of
        # num_steps waited for the host: synchronous steps, with a draft model the drafting ones)
        self.stats = dict(num_prompt_tokens=0, num_generation_tokens=0, num_steps=0, num_requests=0,
                          host_seconds=0.0, device_wait_seconds=0.0, overlap_host_seconds=0.0, num_late_steps=0,
                          num_ahead_steps=0)
        self.init_seconds = time.perf_counter() - t0

    def _build_speculator(self, cfg, draft):
        from jvllm.spec_decode.speculator import Speculator

        if cfg.uses_draft_model:
            proposer = draft
        else:
            from jvllm.spec_decode.ngram import NgramProposer

            proposer = NgramProposer(cfg.k, cfg.prompt_lookup_min, cfg.prompt_lookup_max)
        self.runner.spec = (cfg.k, cfg.uses_draft_model)
        return Speculator(cfg, proposer)

    # ------------------------------------------------------------------ warm-up
    def wait_for_warmup(self, timeout: float | None = None) -> float:
        """Block until the background warm-up has compiled every program (re-raising its error);
        `compiles_after_warmup` counts from then. Returns the background warm-up's seconds."""
        self._warmup.wait(timeout)
        if self.compiles_after_warmup_base is None:
            self.compiles_after_warmup_base = self._warmup.compile_count_at_end
        return self._warmup.seconds or 0.0

    def warmup_done(self) -> bool:
        return self._warmup.done()

    @staticmethod
    def _defaults_from(gen) -> SamplingParams:
        try:
            return SamplingParams(**gen.sampling_dict())
        except (ValueError, TypeError) as e:
            raise ValueError(f"{gen.path}: its generation defaults are not valid sampling params: {e}") from None

    def default_sampling_params(self) -> SamplingParams:
        """SamplingParams() under the model's generation config (a fresh copy: vLLM's
        `get_default_sampling_params`); used for requests added without params."""
        return dataclasses.replace(self._default_params)

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str | None, prompt, params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> str:
        """Validate and queue a request. Raises ValueError/TypeError for bad input (nothing queued)."""
        params = params or self.default_sampling_params()
        if self._asleep is not None:
            raise RuntimeError(f"the engine is asleep (sleep level {self._asleep.level}): call wake_up() first")
        request_id = str(request_id) if request_id is not None else str(next(self._ids))
        if request_id in self.groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, ids, seqs = self.inputs.process(request_id, prompt, params, arrival_time)
        self.groups[request_id] = RequestGroup(request_id, text, ids, params, seqs)
        for s in seqs:
            self.scheduler.add(s)
        self.stats["num_requests"] += 1
        return request_id

    def abort_request(self, request_id) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            g = self.groups.get(rid)
            if g is None:
                continue
            for s in g.seqs:
                if not s.is_finished:
                    self.scheduler.finish(s, Status.FINISHED_ABORTED)
            self.groups.pop(rid, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def get_num_unfinished_requests(self) -> int:
        return len(self.scheduler.waiting) + len(self.scheduler.running)

    # ------------------------------------------------------------------ step
    def step(self) -> list[RequestOutput]:
        """Schedule, run and post-process one batch; returns the outputs of the batch that
        completed (with async scheduling the next batch is dispatched before this one is read)."""
        return self.loop.step()

    def drain(self) -> list[RequestOutput]:
        """Collect the step(s) in flight, if any (async scheduling)."""
        return self.loop.drain()

    def dispatch_ahead(self, prev: StepHandle, only=None) -> StepHandle | None:
        """Schedule and dispatch the step after `prev` while `prev` runs. Each request that samples
        in `prev` has one pending token: its id stays on the device and feeds this step's input.
        Returns the new handle, or None when nothing is left to run, or to fall back to a
        synchronous step (a request's sampling needs its tokens on the host: a grammar's mask,
        penalties, logit bias, min_tokens, logits processors; and the runner launches whole steps
        only).
        With such a request and a runner that can (`executor.late_sampling`), only the forward is
        enqueued now (its input ids are on the device): the handle is `late`, and the loop calls
        `launch_late(handle)` once `prev` has been read, so the sampling inputs are built from the
        kept tokens (a grammar advanced by `prev`'s) while the forward runs.
        Requests whose pending token is their last (max_tokens, max_model_len) are left out; one
        that stops on EOS / a stop string costs one wasted row, discarded when its results come.
        Never preempts (the step ends where blocks run out). With speculative decoding, rows may
        get drafts past their pending token (`Speculator.propose_ahead`), and after a speculating
        `prev` (n-gram, one in-process stage: `runner.ahead_after_verify`; else None) each greedy
        verified row runs its pending token (and drafts guessed as if every draft were accepted)
        laid out as if no draft were accepted: the device moves the row by the accepted count
        (`jvllm.worker.pending_ids`), and reading `prev` moves its entry (`ScheduledRequest.follow`).
        Its blocks are allocated for every draft accepted. A verified row that is sampled (its
        draw's counter would need the count), or that could reach max_tokens / max_model_len with
        every draft accepted, waits for the next step."""
        verified = {id(s.req): s for s in prev.sched.scheduled
                    if s.spec_token_ids and s.req.status is Status.RUNNING}
        if verified and not self.runner.ahead_after_verify:
            return None  # its accepted counts set this step's positions: wait for them
        last, late = set(), False
        for s in prev.sched.scheduled:
            r = s.req
            if not s.samples or r.status is not Status.RUNNING:
                continue
            if r.params.needs_extras or r.grammar is not None or r.params.logits_processors:  # mask / processors need the host tokens
                if not self.runner.executor.late_sampling:
                    return None
                late = True
            n_out = r.num_output_tokens + r.num_pending + len(s.spec_token_ids)  # at most, once `prev` is read
            if n_out >= r.max_tokens or n_out >= r.length_cap or (s.spec_token_ids and not r.params.greedy):
                last.add(r)
        # drafts are verified after a whole step, never after a late sampler: a late step runs plain
        if self.speculator is not None and \
                not self.speculator.propose_ahead(self.scheduler, prev.sched.scheduled, drafts=not late,
                                                  skip=frozenset(last)):
            return None
        # counts as if `prev` were done (step_collect repeats this; it is idempotent); a verified
        # row as if no draft were accepted
        self.scheduler.update_after_step(prev.sched)
        for s in verified.values():
            n = 1 + len(s.spec_token_ids) + len(s.req.spec_token_ids)  # every draft of both steps accepted
            if s.req not in last and not self.scheduler.kv.allocate_slots(s.req, n):
                last.add(s.req)
        sched = self.scheduler.schedule(skip=frozenset(last), allow_preempt=False, only=only)
        if sched.empty:
            return None
        for s in sched.scheduled:
            v = verified.get(id(s.req))
            if v is not None:
                v.follow = s
        return self._launch(sched, prev.run, late=late)

    def launch_late(self, handle: StepHandle | None):
        """Enqueue the samplers of a `late` handle (after the step before it was read); a launch
        error becomes the handle's error, which its read reports. Other handles: no-op."""
        if handle is None or not handle.late or handle.error is not None:
            return
        try:
            self.runner.launch_sampling(handle.run)
        except Exception as e:
            handle.error = e
        finally:
            # only now (not at dispatch) this step's pending tokens count: the sampling inputs read
            # num_output_tokens + num_pending as the index of the token being drawn (the sampler's
            # counter), which must not include the token of this very step
            self._count_pending(handle.sched)
            handle.late = False

    def _launch(self, sched, prev_run=None, late: bool = False, spec_q=None) -> StepHandle:
        """`spec_q`: the draft model's probabilities for the verifier (never with `late`: a draft
        model's steps are dispatched synchronously)."""
        try:
            spec = {} if spec_q is None else dict(spec_q=spec_q)  # plain steps: the runner's plain signature
            run = (self.runner.dispatch(sched.scheduled, prev=prev_run, late_sampling=True) if late
                   else self.runner.dispatch(sched.scheduled, prev=prev_run, **spec))
        except Exception as e:
            return StepHandle(sched, error=e)
        if not late:  # a late step counts its pending tokens when its sampler is launched
            self._count_pending(sched)
        return StepHandle(sched, run, late=late)

    @staticmethod
    def _count_pending(sched):
        for s in sched.scheduled:  # the engine alone writes num_pending (read by scheduler and runner)
            if s.samples:
                s.req.num_pending += 1

    def step_dispatch(self) -> StepHandle:
        """Schedule a batch and enqueue it on the device(s) without waiting (data-parallel replicas
        dispatch all, then collect all, so they run at the same time)."""
        t0 = time.perf_counter()
        try:
            return self.dispatch()
        finally:
            self.stats["host_seconds"] += time.perf_counter() - t0

    def dispatch(self, only=None, allow_preempt=True) -> StepHandle:
        spec_q = None
        if self.speculator is not None:  # drafts for the decoding requests (only here: the sync path)
            spec_q = self.speculator.propose(self.scheduler)
        sched = self.scheduler.schedule(allow_preempt=allow_preempt, only=only)
        if sched.empty:
            if self.scheduler.waiting and not self.scheduler.running:
                # nothing fits even in an empty pool: fail the head request instead of spinning
                req = self.scheduler.waiting[0]
                req.error = "request does not fit in the KV cache"
                self.scheduler.finish(req, Status.FINISHED_ERROR)
                return StepHandle(outputs=self.output.outputs(self.groups, {req.group_id}))
            return StepHandle()
        return self._launch(sched, spec_q=spec_q)

    def make_output(self, g: RequestGroup) -> RequestOutput | None:
        return self.output.make_output(g)

    # ------------------------------------------------------------------ stats / lifecycle
    def kv_bytes_per_block(self) -> int:
        """Bytes one KV block takes on the most loaded device (`jvllm.memory.kv_cache.bytes_per_block`)."""
        return self.worker.kv_bytes_per_block()

    def get_stats(self) -> dict:
        """Counters and gauges; `compiles_after_warmup` counts XLA compiles from the end of the
        background warm-up (0 while it runs: `warmup_pending`) outside the warm-up's plan: with
        warmup "first" the planned programs compiling on their first use are `deferred_compiles`."""
        pool = self.kv_manager.pool
        base = self.compiles_after_warmup_base
        if base is None and self._warmup.done():
            base = self.compiles_after_warmup_base = self._warmup.compile_count_at_end
        deferred = self.runner.programs.deferred_compiles if self.runner is not None else 0
        return dict(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            kv_usage=pool.usage(), num_blocks=pool.num_blocks, num_free_blocks=pool.num_free,
            prefix_cache_hit_rate=self.kv_manager.hit_rate(), num_preemptions=self.scheduler.num_preemptions,
            num_bucket_cuts=self.scheduler.num_bucket_cuts,
            compiles_after_warmup=self.worker.compile_count() - base if base is not None else 0,
            deferred_compiles=deferred, warmup_pending=base is None,
            **(self.speculator.stats.as_dict() if self.speculator is not None else {}),
            **self.stats, **(self.runner.timers if self.runner is not None else {}))

    def shutdown(self):
        """Free the weights and the KV pool on the device. The engine is unusable afterwards."""
        warm = getattr(self, "_warmup", None)
        if warm is not None:
            warm.cancel()
            try:
                warm.wait()
            except Exception:
                pass
        try:
            self.drain()
        except Exception:
            pass
        for g in list(self.groups):
            self.abort_request(g)
        spec = getattr(self, "speculator", None)
        if spec is not None and hasattr(spec.proposer, "release"):
            spec.proposer.release()
        if getattr(self, "worker", None) is not None:
            self.worker.release()
        self.runner = None
