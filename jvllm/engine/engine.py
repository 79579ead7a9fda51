"""LLMEngine: add_request / abort_request / step / has_unfinished_requests.

The loop is nano-vllm's: schedule -> run -> postprocess. `step()` runs one scheduled batch and
returns a RequestOutput for every user request that made progress (or finished). Requests with
n > 1 fan out into n sequences that share the prompt's KV blocks through the prefix cache.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np

from jvllm.config import CacheConfig, ModelConfig, SchedulerConfig, cdiv, pow2_buckets
from jvllm.engine.request import Request, Status
from jvllm.engine.scheduler import Scheduler
from jvllm.memory.block_pool import KVCacheManager
from jvllm.outputs import CompletionOutput, Logprob, RequestOutput
from jvllm.sampling_params import RequestOutputKind, SamplingParams

log = logging.getLogger("jvllm")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Everything `LLM(...)` / `jvllm serve` accept. None means "pick a default for this device"."""

    model: str = "smollm2"
    dtype: str = "auto"
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.9
    block_size: int = 16
    num_gpu_blocks_override: int | None = None
    kv_cache_memory_bytes: int | None = None
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    enable_prefix_caching: bool = True
    seed: int = 0
    skip_tokenizer_init: bool | None = None  # None: auto (True when the checkpoint has no tokenizer)
    token_buckets: tuple[int, ...] | None = None
    query_tile: int | None = None  # tokens per attention query tile of mixed steps (None: 16 on accelerators, 8 on CPU)
    kv_chunk_blocks: int | None = None  # KV blocks per attention chunk (None: 16 on accelerators, 4 on CPU)
    compilation_cache_dir: str | None = None
    use_tqdm_on_load: bool = True
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    # mixture-of-experts models: shard the experts over the tensor-parallel devices (vLLM's flag;
    # attention stays tensor parallel); an error for a model without experts
    enable_expert_parallel: bool = False
    # the experts' grouped matmuls: auto (tokamax on GPUs when installed, else xla) | xla | tokamax
    moe_backend: str = "auto"
    num_microbatches: int | None = None  # pipeline micro-batches per step (default: one per stage)
    # launch pipeline stages after the first from one thread per stage (a stage whose input copy
    # from the previous stage's devices blocks then stalls only its own thread); experimental,
    # off until measured on GPUs (benchmarks/h200_x2_parallel.sh: EXTRA=--pipeline-stage-threads)
    pipeline_stage_threads: bool = False
    # how stage outputs reach the next stage's devices: "device_put" | "ppermute" (a collective-
    # permute program; experimental, off until measured: benchmarks/gpu_handoff_probe.py)
    pipeline_handoff: str = "device_put"
    # auto (GPU: ragged, elsewhere xla) | xla | pallas (decode steps: JAX's Pallas paged-attention
    # kernel; mixed steps: jvllm's ragged kernel) | pallas_decode (mixed steps on XLA) | ragged (all
    # steps on the ragged kernel) | ragged_split (every decode-only step split-K; "ragged" splits only grids under 512 programs, such as B1); "_interpret" runs the Pallas kernels in interpret mode (CPU tests)
    attention_backend: str = "auto"
    # dispatch step N+1 before reading step N's results, so the host's scheduling and input
    # building overlap the device's work (None: on wherever supported: a single-process engine,
    # TP and PP included, that is not a data-parallel replica; True there, False anywhere)
    async_scheduling: bool | None = None


def _on_accelerator() -> bool:
    return jax.default_backend() not in ("cpu",)


def device_memory_stats() -> dict | None:
    """This process's first device's allocator stats (bytes_limit, bytes_in_use, ...); None where
    the backend has none (CPU), which selects the CPU sizing rule. A local device: in a multi-process
    run the global first device belongs to process 0, and its stats are not readable elsewhere (which
    once sent process 1 down the CPU sizing rule, so the processes compiled different programs and
    deadlocked in XLA's shared autotuning)."""
    try:
        return jax.local_devices()[0].memory_stats()
    except Exception:
        return None


def agree_min(value: int) -> int:
    """The smallest of every process's `value` (itself in a single-process run). Every process must
    build the same programs (multi-controller JAX; on GPUs XLA even shares autotuning between the
    processes' compilers, so a mismatch hangs), so a size each process derives from its own device,
    such as the KV pool's block count, is agreed on before anything is compiled with it."""
    if jax.process_count() == 1:
        return int(value)
    from jax.experimental import multihost_utils

    return int(np.min(multihost_utils.process_allgather(np.asarray(value, np.int64))))


def resolve_dtype(dtype: str):
    if dtype in (None, "auto"):
        return jnp.bfloat16 if _on_accelerator() else jnp.float32
    names = {"float32": jnp.float32, "fp32": jnp.float32, "float": jnp.float32, "bfloat16": jnp.bfloat16,
             "bf16": jnp.bfloat16, "float16": jnp.float16, "fp16": jnp.float16, "half": jnp.float16}
    if dtype not in names:
        raise ValueError(f"dtype must be one of auto, {', '.join(names)}; got {dtype!r}")
    return names[dtype]


class RequestGroup:
    """A user request: n sequences with one id."""

    def __init__(self, request_id, prompt, prompt_token_ids, params, seqs):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.seqs: list[Request] = seqs

    @property
    def finished(self) -> bool:
        seqs = self.seqs
        return seqs[0].status._finished if len(seqs) == 1 else all(s.status._finished for s in seqs)


class LLMEngine:
    def __init__(self, config: EngineConfig, devices=None):
        """`devices`: the devices of this engine (a data-parallel replica gets a slice); default all."""
        from jvllm import compile as jcompile
        from jvllm.converters import load_checkpoint, load_tokenizer, model_config, resolve_model
        from jvllm.memory.device import claim_device_memory
        from jvllm.runner import ModelRunner, attention_modes

        claim_device_memory(config.gpu_memory_utilization)  # before anything touches a device
        jcompile.install_counter()
        if config.compilation_cache_dir != "off":
            jcompile.enable_persistent_cache(config.compilation_cache_dir)
        self.config = config
        t0 = time.perf_counter()
        # option checks that need no weights come first: a bad value fails before minutes of loading
        attention_modes(config.attention_backend)
        from jvllm.runner import check_handoff

        check_handoff(config.pipeline_handoff)
        # async scheduling: a whole engine (data-parallel replicas are stepped by
        # DataParallelEngine through step_dispatch/step_collect, which is synchronous). Multi-host
        # runs may use it: every process must take the same decisions from host-visible state,
        # and the async loop's decisions depend only on the order of steps (schedule N+1 from the
        # counts as if N were done, then read N), never on timing or on device readiness.
        supported = devices is None
        if config.async_scheduling and not supported:
            raise ValueError("async_scheduling needs an engine that is not a data-parallel replica "
                             "(got a data-parallel device slice)")
        self.async_scheduling = supported if config.async_scheduling is None else bool(config.async_scheduling)
        spec = resolve_model(config.model)
        self.dtype = resolve_dtype(config.dtype)
        self.model_config: ModelConfig = model_config(spec)
        from jvllm.models.moe import configure_moe

        self.model_config = configure_moe(self.model_config, config.enable_expert_parallel, config.moe_backend)
        layout = self._layout(config, devices)
        try:
            ckpt = load_checkpoint(spec, self.dtype, shardings=layout["shardings"])
        except Exception as e:
            if "RESOURCE_EXHAUSTED" not in str(e) and "out of memory" not in str(e).lower():
                raise
            stats = device_memory_stats() or {}
            raise MemoryError(
                f"loading {config.model!r} ran out of device memory (allocator limit "
                f"{stats.get('bytes_limit', 0) / 2**30:.2f} GiB, pool {stats.get('pool_bytes', 0) / 2**30:.2f} GiB, in use "
                f"{stats.get('bytes_in_use', 0) / 2**30:.2f} GiB; gpu_memory_utilization {config.gpu_memory_utilization}): "
                f"free memory on the device, raise gpu_memory_utilization, or shard the model "
                f"(tensor_parallel_size / pipeline_parallel_size)") from e
        self.load_seconds = ckpt.load_seconds
        self.tokenizer = None
        if config.skip_tokenizer_init is not True:
            self.tokenizer = load_tokenizer(spec)
            if self.tokenizer is None and config.skip_tokenizer_init is False:
                raise ValueError(f"model {config.model!r} ships no tokenizer files; pass skip_tokenizer_init=True")
        mc = self.model_config
        self.eos_token_ids = tuple(mc.eos_token_ids) or (
            (self.tokenizer.eos_token_id,) if self.tokenizer is not None and self.tokenizer.eos_token_id is not None else ())
        t_parts = time.perf_counter()
        stages, head_w = self._build_stages(layout, ckpt.params)
        self.num_stages = len(stages)
        # start-up split beyond load and warm-up (bench reports it): binding weights into modules,
        # KV sizing (the activation probe), building the runner (KV pool allocation), block pool
        self.init_parts = dict(build_stages_s=time.perf_counter() - t_parts)

        acc = _on_accelerator()
        max_model_len = config.max_model_len or mc.max_position_embeddings
        if max_model_len > mc.max_position_embeddings and mc.rope_type == "default":
            raise ValueError(f"max_model_len ({max_model_len}) exceeds the model's max_position_embeddings "
                             f"({mc.max_position_embeddings})")
        mnbt = config.max_num_batched_tokens or (2048 if acc else 512)
        mns = config.max_num_seqs or min(256 if acc else 32, mnbt)
        # with pipeline stages the budget is per micro-batch (SchedulerConfig), so the runner's
        # micro-batches are the scheduler's and each one fits the largest bucket
        n_mb = (config.num_microbatches or self.num_stages) if self.num_stages > 1 else 1
        self.sched_config = SchedulerConfig(max_num_batched_tokens=mnbt, max_num_seqs=mns, max_model_len=max_model_len,
                                            num_microbatches=n_mb)
        buckets = tuple(sorted(set(config.token_buckets or pow2_buckets(8, mnbt))))
        if buckets[-1] < mnbt:
            buckets = buckets + (mnbt,)
        bs = config.block_size
        self.cache_config = CacheConfig(block_size=bs, num_blocks=config.num_gpu_blocks_override,
                                        gpu_memory_utilization=config.gpu_memory_utilization,
                                        kv_cache_memory_bytes=config.kv_cache_memory_bytes,
                                        enable_prefix_caching=config.enable_prefix_caching)

        def make_runner(num_blocks):
            return ModelRunner(mc, head_w=head_w, dtype=self.dtype, block_size=bs,
                               num_blocks=num_blocks, max_model_len=max_model_len, max_num_seqs=mns,
                               token_buckets=buckets, query_tile=config.query_tile or (16 if acc else 8),
                               kv_chunk_blocks=config.kv_chunk_blocks or (16 if acc else 4),
                               stages=[dataclasses.replace(st, kv=None) for st in stages],  # shares weights
                               num_microbatches=config.num_microbatches,
                               stage_threads=config.pipeline_stage_threads,
                               handoff=config.pipeline_handoff,
                               attention_backend=config.attention_backend)

        t_parts = time.perf_counter()
        num_blocks = agree_min(self._num_blocks(mc, max_model_len, mns, make_runner))
        self.init_parts["kv_sizing_s"] = time.perf_counter() - t_parts
        need = cdiv(max_model_len, bs)
        if need > num_blocks - 1:
            raise ValueError(
                f"max_model_len ({max_model_len}) needs {need} KV blocks of {bs} tokens but the pool has "
                f"{num_blocks - 1} usable blocks ({(num_blocks - 1) * bs} tokens); lower max_model_len or give "
                f"the KV cache more memory (gpu_memory_utilization, kv_cache_memory_bytes, num_gpu_blocks_override)")
        t_parts = time.perf_counter()
        self.runner = make_runner(num_blocks)
        self.init_parts["runner_s"] = time.perf_counter() - t_parts
        del ckpt
        self._inflight = None
        self._inflight_q: collections.deque = collections.deque()  # pipelined async loop (_step_pipelined)
        t_parts = time.perf_counter()
        self.kv_manager = KVCacheManager(num_blocks, bs, config.enable_prefix_caching)
        self.init_parts["block_pool_s"] = time.perf_counter() - t_parts
        self.scheduler = Scheduler(self.sched_config, self.kv_manager)
        self.groups: dict[str, RequestGroup] = {}
        self._rng = np.random.default_rng(config.seed)
        self._ids = itertools.count()
        # host_seconds: scheduling, input building, dispatch and post-processing (the device idles
        # through these unless a step is already queued); device_wait_seconds: blocked on results
        self.stats = dict(num_prompt_tokens=0, num_generation_tokens=0, num_steps=0, num_requests=0,
                          host_seconds=0.0, device_wait_seconds=0.0)
        self.warmup_seconds = self.warmup(use_tqdm=config.use_tqdm_on_load)
        self.compiles_after_warmup_base = jcompile.compile_count()
        self.init_seconds = time.perf_counter() - t0

    # ------------------------------------------------------------------ parallel layout
    def _layout(self, config: EngineConfig, devices) -> dict:
        """Mesh, stage meshes and per-parameter shardings for TP x PP (None when on one device)."""
        tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
        mc = self.model_config
        if tp * pp == 1 and devices is None:
            return dict(shardings=None, stage_meshes=[None], ranges=[(0, mc.num_layers)], rules=None)
        from jax.sharding import NamedSharding

        from jvllm.models import param_specs, stage_layers, stage_names
        from jvllm.sharding import expert_parallel_rules, make_mesh, partition_spec, stage_mesh, tensor_parallel_rules

        rules = (expert_parallel_rules if config.enable_expert_parallel else tensor_parallel_rules)(mc, tp)
        mesh = make_mesh(tensor=tp, stage=pp, data=1, devices=devices)
        ranges = stage_layers(mc.num_layers, pp)
        meshes = [stage_mesh(mesh, 0, s) for s in range(pp)]
        if pp > 1 and jax.process_count() > 1:
            self._check_multiprocess_stages(config, meshes)
        shardings = {}
        for m, r in zip(meshes, ranges):
            local = param_specs(mc, self.dtype, r)
            for g, name in stage_names(mc, r).items():
                shardings[g] = NamedSharding(m, partition_spec(local[name][2], rules))
        self.mesh = mesh
        return dict(shardings=shardings, stage_meshes=meshes, ranges=ranges, rules=rules)

    def _check_multiprocess_stages(self, config: EngineConfig, meshes):
        """Pipeline stages over several processes (`jvllm launch`): each process launches its own
        stages and hands hidden states and sampled ids to the others through collective-permute
        programs. Refused, naming the sizes, where a stage would span processes, where a process
        would own neither the first nor the last stage (the sampled ids reach only those two), with
        tied embeddings (the last stage's copy of the embedding would have to cross processes at
        load time) and with stage threads."""
        nproc = jax.process_count()
        owners = [sorted({d.process_index for d in m.devices.flat}) for m in meshes]
        pp, tp = config.pipeline_parallel_size, config.tensor_parallel_size
        per = jax.local_device_count()
        if any(len(o) > 1 for o in owners):
            raise ValueError(f"pipeline_parallel_size={pp} x tensor_parallel_size={tp} over {nproc} processes of "
                             f"{per} device(s): stage(s) {[s for s, o in enumerate(owners) if len(o) > 1]} would span "
                             f"processes; give each process whole stages (tensor_parallel_size a divisor of {per})")
        ends = {owners[0][0], owners[-1][0]}
        idle = sorted(set(range(nproc)) - ends)
        if idle:
            raise ValueError(f"pipeline_parallel_size={pp} over {nproc} processes: process(es) {idle} would own "
                             f"neither the first nor the last stage; use at most 2 processes for the stages")
        if self.model_config.tie_word_embeddings and owners[0] != owners[-1]:
            raise ValueError(f"pipeline stages over {nproc} processes need a model with its own LM head; "
                             f"{config.model!r} ties it to the embedding: run its pipeline stages in one process")
        if config.pipeline_stage_threads:
            raise ValueError("pipeline_stage_threads needs a single-process run (each process already launches "
                             "only its own stages)")

    def _build_stages(self, layout, params):
        from jvllm.models import bind, stage_names
        from jvllm.runner import Stage

        mc = self.model_config
        stages = []
        n = len(layout["ranges"])
        kv_spec = None
        if layout["rules"] is not None:
            from jvllm.sharding import kv_partition_spec

            kv_spec = kv_partition_spec(layout["rules"])
        for s, (m, r) in enumerate(zip(layout["stage_meshes"], layout["ranges"])):
            names = stage_names(mc, r) if n > 1 else {k: k for k in params}
            g, st = bind(mc, {local: params[glob] for glob, local in names.items()}, self.dtype, layers=r)
            stages.append(Stage(g, st, mesh=m, kv_spec=kv_spec, first=s == 0, last=s == n - 1))
        head_w = params["embed"] if mc.tie_word_embeddings else params["lm_head"]
        if mc.tie_word_embeddings and n > 1:  # the last stage needs its own copy of the tied head
            head_w = jax.device_put(head_w, jax.sharding.NamedSharding(layout["stage_meshes"][-1],
                                                                       head_w.sharding.spec))
        return stages, head_w

    # ------------------------------------------------------------------ memory sizing
    def kv_bytes_per_block(self, mc: ModelConfig | None = None) -> int:
        """Bytes one block takes on the most loaded device (stage 0's layers, its share of KV heads)."""
        mc = mc or self.model_config
        cfg = self.config
        layers = -(-mc.num_layers // cfg.pipeline_parallel_size)
        tp = cfg.tensor_parallel_size
        heads = mc.num_kv_heads // tp if mc.num_kv_heads % tp == 0 else mc.num_kv_heads
        return 2 * layers * self.cache_config.block_size * heads * mc.head_dim * jnp.dtype(self.dtype).itemsize

    def _num_blocks(self, mc: ModelConfig, max_model_len: int, max_num_seqs: int, make_runner) -> int:
        cc = self.cache_config
        per_block = self.kv_bytes_per_block(mc)
        if cc.num_blocks is not None:
            return cc.num_blocks
        cap = max_num_seqs * cdiv(max_model_len, cc.block_size) + 1  # never more than all slots could use
        if cc.kv_cache_memory_bytes is not None:
            return max(2, min(cap, cc.kv_cache_memory_bytes // per_block + 1))
        stats = device_memory_stats()
        if stats and stats.get("bytes_limit"):
            # vLLM's rule: utilization x device memory - weights (in use now) - activation peak, with
            # the peak taken from XLA's memory analysis of the largest step program, inside the pool
            # the allocator really holds (jvllm.memory.device)
            from jvllm.memory.device import kv_budget_bytes

            act = self._activation_peak_bytes(make_runner)
            budget, how, advice = kv_budget_bytes(stats, cc.gpu_memory_utilization, act)
            if budget < 2 * per_block:
                raise ValueError(f"no device memory left for the KV cache: {how} < 2 blocks of "
                                 f"{per_block / 2**20:.2f} MiB; {advice}")
            return int(min(cap, budget // per_block))
        return max(2, min(cap, (512 * 2**20) // per_block + 1))  # CPU default: 512 MiB

    def _activation_peak_bytes(self, make_runner) -> int:
        """XLA's temp allocation for the largest step and sampler programs, compiled against a
        2-block pool (the peak does not depend on the pool size: the pool is donated)."""
        from jvllm import compile as jcompile

        probe = make_runner(2)
        T = probe.token_buckets[-1]
        peak = 0
        keys = [("step", (s, T, False)) for s in range(len(probe.stages))] + [("sample", (probe.seq_bucket(T), True))]
        keys = [k for k in keys if probe.owns(*k)]  # this process's programs (stages over processes)
        for kind, key in keys:
            exe = probe.compile(kind, key)
            temp = jcompile.temp_bytes(exe)
            if temp is not None:
                peak = max(peak, temp)
            else:  # no memory analysis on this backend: keep a 5% margin of the device
                limit = (device_memory_stats() or {}).get("bytes_limit", 0)
                peak = max(peak, int(0.05 * limit))
        for k, v in probe.kv:  # this process's pools (others' are None)
            k.delete()
            v.delete()
        return int(peak * 1.1)

    # ------------------------------------------------------------------ warm-up
    def warmup(self, use_tqdm: bool = True) -> float:
        """Compile every program of every bucket ahead of time. Returns seconds spent."""
        t0 = time.perf_counter()
        progs = self.runner.programs()
        it = progs
        if use_tqdm:
            from tqdm.auto import tqdm

            it = tqdm(progs, desc="jvllm: compiling buckets", unit="prog", leave=False)
        for kind, key in it:
            self.runner.compile(kind, key)
        return time.perf_counter() - t0

    # ------------------------------------------------------------------ requests
    def _tokenize(self, prompt):
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError(f"a prompt dict needs 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer (skip_tokenizer_init): pass "
                                 "{'prompt_token_ids': [...]} instead of text")
            return prompt, list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, (int, np.integer)) for t in prompt):
            return None, [int(t) for t in prompt]
        raise TypeError(f"a prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")

    def add_request(self, request_id: str | None, prompt, params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> str:
        """Validate and queue a request. Raises ValueError/TypeError for bad input (nothing queued)."""
        params = params or SamplingParams()
        request_id = str(request_id) if request_id is not None else str(next(self._ids))
        if request_id in self.groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, ids = self._tokenize(prompt)
        V = self.model_config.vocab_size
        L = self.sched_config.max_model_len
        if not ids:
            raise ValueError("the prompt is empty (0 tokens)")
        bad = [t for t in ids if not 0 <= t < V]
        if bad:
            raise ValueError(f"prompt token ids {bad[:8]} outside the vocabulary [0, {V})")
        if len(ids) >= L:
            raise ValueError(f"the prompt has {len(ids)} tokens; max_model_len is {L}, which leaves no room "
                             f"to generate")
        params.validate_for_vocab(V)
        if getattr(self.runner, "multiprocess", False) and (params.logprobs is not None
                                                             or params.prompt_logprobs is not None):
            raise ValueError(f"logprobs={params.logprobs}, prompt_logprobs={params.prompt_logprobs}: logprobs are "
                             f"not available with pipeline stages over {jax.process_count()} processes (only the "
                             f"sampled ids cross between them); run the stages in one process for logprobs")
        seqs = []
        for i in range(params.n):
            if params.seed is not None:
                seed = params.seed if i == 0 else hash((params.seed, i)) & (2**63 - 1)
            else:
                seed = int(self._rng.integers(0, 2**63 - 1))
            rid = request_id if params.n == 1 else f"{i}_{request_id}"
            seqs.append(Request(rid, ids, params, seed, self.eos_token_ids, text, group_id=request_id, index=i,
                                arrival_time=arrival_time, tokenizer=self.tokenizer, length_cap=L - len(ids)))
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
        completed. With async scheduling the next batch is dispatched before this one's results
        are read (`_dispatch_ahead`), so the device never waits for the host between steps."""
        if not self.async_scheduling:
            return self.step_collect(self.step_dispatch())
        if self.sched_config.num_microbatches > 1:
            return self._step_pipelined()
        prev, self._inflight = self._inflight, None
        if prev is None:
            prev = self.step_dispatch()
        if prev[0] == "step":
            t0 = time.perf_counter()
            self._inflight = self._dispatch_ahead(prev)
            self.stats["host_seconds"] += time.perf_counter() - t0
        return self.step_collect(prev)

    def _step_pipelined(self):
        """Async scheduling with pipeline stages: one scheduler step per micro-batch, each
        micro-batch with its own step in flight (vLLM's virtual engines, over one scheduler and one
        KV pool). A call first dispatches a step for every micro-batch that has none in flight,
        then takes the oldest step in flight, dispatches its micro-batch's next step ahead of it
        and reads it. So the host's work on micro-batch a's results (outputs, scheduling, inputs)
        overlaps the stages' work on micro-batch b: with whole steps (both micro-batches read
        before either's next step is scheduled) each GPU idled 3.2-3.9 ms of every 14.8 ms W1
        decode step on 2 H200s while the host worked (h200x2_profile_pp2mp_w1_479b533.json); with
        it, W1 went from 11,979 to 12,196-13,142 out tok/s (h200x2_w1_pp2mp_*.json).
        Steps are dispatched and read in the same order in every process (multi-process stages)."""
        q = self._inflight_q
        t0 = time.perf_counter()
        outs = []
        busy = {h[1].microbatch for h in q}
        for g in range(self.sched_config.num_microbatches):
            if g in busy:
                continue
            h = self._step_dispatch(only=g, allow_preempt=not q)
            if h[0] == "outputs":
                outs += h[1]
            else:
                q.append(h)  # a step, or an error its read reports
        self.stats["host_seconds"] += time.perf_counter() - t0
        if not q:
            return outs
        prev = q.popleft()
        if prev[0] == "step":
            t0 = time.perf_counter()
            nxt = self._dispatch_ahead(prev, only=prev[1].microbatch)
            if nxt is not None:
                q.append(nxt)
            self.stats["host_seconds"] += time.perf_counter() - t0
        return outs + self.step_collect(prev)

    def _dispatch_ahead(self, prev, only=None):
        """Schedule and dispatch the step after `prev` while `prev` runs. Each request that samples
        in `prev` has one pending token: its id stays on the device and feeds this step's input
        (ModelRunner.prepare's `src`). Returns the new handle, or None to fall back to a
        synchronous step (a request needs its tokens on the host: penalties, logit bias,
        min_tokens), or when nothing is left to run. Requests whose pending token is their last
        (max_tokens, max_model_len) are left out; one that stops on EOS / a stop string costs
        one wasted row, discarded when its results come. Never preempts (the step ends where
        blocks run out)."""
        sched_prev = prev[1]
        last = set()
        for s in sched_prev.scheduled:
            r = s.req
            if not s.samples or r.status is not Status.RUNNING:
                continue
            if r.params.needs_extras:
                return None
            n_out = r.num_output_tokens + r.num_pending
            if n_out >= r.max_tokens or n_out >= r.length_cap:
                last.add(r)
        # counts as if `prev` were done (step_collect repeats this; it is idempotent)
        self.scheduler.update_after_step(sched_prev)
        sched = self.scheduler.schedule(skip=frozenset(last), allow_preempt=False, only=only)
        if sched.empty:
            return None
        try:
            handle = self.runner.dispatch(sched.scheduled, prev=prev[2])
        except Exception as e:
            return ("error", sched, e)
        self._mark_pending(sched)
        return ("step", sched, handle)

    @staticmethod
    def _mark_pending(sched):
        for s in sched.scheduled:
            if s.samples:
                s.req.num_pending += 1

    def drain(self) -> list[RequestOutput]:
        """Collect the step(s) in flight, if any (async scheduling)."""
        prev, self._inflight = self._inflight, None
        outs = self.step_collect(prev) if prev is not None else []
        while self._inflight_q:
            outs += self.step_collect(self._inflight_q.popleft())
        return outs

    def step_dispatch(self):
        """Schedule a batch and enqueue it on the device(s) without waiting (data-parallel replicas
        dispatch all, then collect all, so they run at the same time)."""
        t0 = time.perf_counter()
        try:
            return self._step_dispatch()
        finally:
            self.stats["host_seconds"] += time.perf_counter() - t0

    def _step_dispatch(self, only=None, allow_preempt=True):
        sched = self.scheduler.schedule(allow_preempt=allow_preempt, only=only)
        if sched.empty:
            if self.scheduler.waiting and not self.scheduler.running:
                # nothing fits even in an empty pool: fail the head request instead of spinning
                req = self.scheduler.waiting[0]
                req.error = "request does not fit in the KV cache"
                self.scheduler.finish(req, Status.FINISHED_ERROR)
                return ("outputs", self._outputs({req.group_id}))
            return ("outputs", [])
        try:
            handle = self.runner.dispatch(sched.scheduled)
        except Exception as e:
            return ("error", sched, e)
        self._mark_pending(sched)
        return ("step", sched, handle)

    def step_collect(self, handle) -> list[RequestOutput]:
        if handle[0] == "outputs":
            return handle[1]
        sched = handle[1]
        try:
            if handle[0] == "error":
                raise handle[2]
            t0 = time.perf_counter()
            res = self.runner.collect(handle[2])
            t1 = time.perf_counter()
            self.stats["device_wait_seconds"] += t1 - t0
        except Exception as e:  # an engine error fails the requests of this step, not the engine
            log.exception("step failed")
            for s in sched.scheduled:
                if s.samples:
                    s.req.num_pending = max(0, s.req.num_pending - 1)
                if s.req.is_finished:
                    continue
                s.req.error = f"{type(e).__name__}: {e}"
                self.scheduler.finish(s.req, Status.FINISHED_ERROR)
            return self._outputs({s.req.group_id for s in sched.scheduled})
        now = time.time()
        self.scheduler.update_after_step(sched)
        self.stats["num_steps"] += 1
        touched = set()
        for r, s in enumerate(sched.scheduled):
            req = s.req
            touched.add(req.group_id)
            if s.start < req.num_prompt_tokens:
                self.stats["num_prompt_tokens"] += min(s.num_tokens, req.num_prompt_tokens - s.start)
            if r in res.prompt_logprobs:
                self._add_prompt_logprobs(req, *res.prompt_logprobs[r])
            if not s.samples:
                continue
            req.num_pending = max(0, req.num_pending - 1)
            if req.is_finished:  # stopped (or aborted) while this step was in flight: a wasted row
                continue
            tok = int(res.token_ids[r])
            entry, lp = None, None
            if res.logprobs is not None:
                lp = float(res.logprobs[0][r])
                if req.params.logprobs is not None:
                    entry = self._logprob_entry(tok, lp, int(res.logprobs[1][r]), res.logprobs[2][r],
                                                res.logprobs[3][r], req.params.logprobs)
            req.append_token(tok, entry, lp)
            self.stats["num_generation_tokens"] += 1
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
            req.metrics.last_token_time = now
            if req.is_finished:
                req.metrics.finished_time = now
                self.scheduler.finish(req, req.status)
        outs = self._outputs(touched)
        self.stats["host_seconds"] += time.perf_counter() - t1
        return outs

    def _decode_one(self, tid: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode([int(tid)])

    def _logprob_entry(self, tok, lp, rank, top_ids, top_lps, n):
        entry = {tok: Logprob(lp, rank, self._decode_one(tok))}
        for i in range(n):
            t = int(top_ids[i])
            if t not in entry:
                entry[t] = Logprob(float(top_lps[i]), i + 1, self._decode_one(t))
        return entry

    def _add_prompt_logprobs(self, req: Request, pos, tok_lp, rank, top_ids, top_lps):
        n = req.params.prompt_logprobs
        for j, p in enumerate(pos):
            if len(req.prompt_logprobs) != p + 1:
                continue  # already recorded (recompute after preemption)
            t = req.prompt_token_ids[p + 1]
            req.prompt_logprobs.append(self._logprob_entry(t, float(tok_lp[j]), int(rank[j]), top_ids[j], top_lps[j], n))

    def _outputs(self, group_ids) -> list[RequestOutput]:
        outs = []
        for gid in group_ids:
            g = self.groups.get(gid)
            if g is None:
                continue
            out = self.make_output(g)
            if out is not None:
                outs.append(out)
            if g.finished:
                del self.groups[gid]
        return outs

    def make_output(self, g: RequestGroup) -> RequestOutput | None:
        kind = g.params.output_kind
        finished = g.finished
        if kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        comps = []
        for s in g.seqs:
            text = s.streamable_text()
            ids, lps = s.output_token_ids, s.logprobs
            if kind is RequestOutputKind.DELTA:
                t0, k0 = s.sent_text_len, s.sent_token_len
                s.sent_text_len, s.sent_token_len = len(text), len(ids)
                text, ids = text[t0:], ids[k0:]
                lps = lps[k0:] if lps is not None else None
            comps.append(CompletionOutput(
                index=s.index, text=text, token_ids=list(ids),
                cumulative_logprob=s.cumulative_logprob if s.params.logprobs is not None else None,
                logprobs=lps, finish_reason=s.status.reason, stop_reason=s.stop_reason))
        s0 = g.seqs[0]
        return RequestOutput(request_id=g.request_id, prompt=g.prompt, prompt_token_ids=g.prompt_token_ids,
                             prompt_logprobs=s0.prompt_logprobs, outputs=comps, finished=finished,
                             metrics=s0.metrics, num_cached_tokens=s0.metrics.num_cached_tokens)

    # ------------------------------------------------------------------ stats / lifecycle
    def get_stats(self) -> dict:
        from jvllm import compile as jcompile

        pool = self.kv_manager.pool
        return dict(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            kv_usage=pool.usage(), num_blocks=pool.num_blocks, num_free_blocks=pool.num_free,
            prefix_cache_hit_rate=self.kv_manager.hit_rate(), num_preemptions=self.scheduler.num_preemptions,
            compiles_after_warmup=jcompile.compile_count() - self.compiles_after_warmup_base,
            **self.stats, **(self.runner.timers if self.runner is not None else {}))

    def shutdown(self):
        """Free the weights and the KV pool on the device. The engine is unusable afterwards."""
        try:
            self.drain()
        except Exception:
            pass
        for g in list(self.groups):
            self.abort_request(g)
        if getattr(self, "runner", None) is not None:
            self.runner.release()
            self.runner = None
