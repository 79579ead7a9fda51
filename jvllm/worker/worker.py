"""Worker: the device side of an engine. It claims the device memory share, turns on the compile
counter and caches, reads the model config, loads the checkpoint into the TP / PP layout, builds
the stages, sizes the KV pool, builds the ModelRunner and warms it up. The engine (host only, no
jax import) talks to devices only through this object.

Order (a bad option fails before minutes of loading): `Worker(config)` reads the model config
only; `load()` loads weights and tokenizer (the tokenizer in a thread beside the weights: its
Python-heavy import and build overlap the weights' numpy and device work); `build_runner(...)`
sizes the pool and allocates it; `warm_up(...)` compiles.
"""
from __future__ import annotations

import dataclasses
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp

from jvllm import compilation
from jvllm.compilation.registry import WarmUp, compile_threads, planned_compile_count
from jvllm.config import CacheConfig, ModelConfig, SchedulerConfig
from jvllm.memory import kv_cache, sizing
from jvllm.worker.stage import Stage

DTYPES = {"float32": jnp.float32, "fp32": jnp.float32, "float": jnp.float32, "bfloat16": jnp.bfloat16,
          "bf16": jnp.bfloat16, "float16": jnp.float16, "fp16": jnp.float16, "half": jnp.float16}


def on_accelerator() -> bool:
    return jax.default_backend() not in ("cpu",)


def resolve_dtype(dtype: str):
    if dtype in (None, "auto"):
        return jnp.bfloat16 if on_accelerator() else jnp.float32
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(DTYPES)}; got {dtype!r}")
    return DTYPES[dtype]


def process_count() -> int:
    return jax.process_count()


def devices() -> list:
    return list(jax.devices())


class Worker:
    def __init__(self, config, devices=None):
        """`config`: an EngineConfig; `devices`: this engine's devices (a data-parallel replica's
        slice), default all."""
        from jvllm.converters import model_config, resolve_model
        from jvllm.memory.device import claim_device_memory

        claim_device_memory(config.gpu_memory_utilization)  # before anything touches a device
        compilation.install_counter()
        self.config = config
        self.devices = devices
        self.init_parts: dict = {}  # start-up seconds by phase (the bench reports them)
        self.tokenizer_seconds = 0.0  # the tokenizer thread's own seconds (`load`)
        self._tokenizer_job = self._tokenizer = None  # `load` starts the build, `tokenizer()` waits for it
        t = time.perf_counter()
        self.on_accelerator = on_accelerator()  # the first backend call: initializes the device(s)
        self.process_count = jax.process_count()
        self.init_parts["backend_init_s"] = time.perf_counter() - t
        # jvllm's persistent cache dir (XLA programs, executables, tokenizers), None = off; JAX's own
        # cache on accelerators only (counter.enable_persistent_cache says why)
        self.cache_dir = compilation.enable_persistent_cache(config.compilation_cache_dir, jax_cache=self.on_accelerator)
        t = time.perf_counter()
        self.spec = resolve_model(config.model)
        self.dtype = resolve_dtype(config.dtype)
        self.kv_dtype = kv_cache.resolve_dtype(config.kv_cache_dtype, self.dtype)  # the KV pages' dtype
        from jvllm.models.moe import configure_moe

        from jvllm.quantization import apply_quantization

        quantized = apply_quantization(model_config(self.spec), config.quantization,
                                       fp8_matmul_backend=config.fp8_matmul_backend,
                                       group_size=config.quantization_group_size)
        self.model_config: ModelConfig = configure_moe(quantized, config.enable_expert_parallel, config.moe_backend)
        if config.batch_invariant:  # fixed-tile projections and LM head (jvllm.worker.batch_invariant)
            self.model_config = dataclasses.replace(self.model_config, batch_invariant=True)
        self.init_parts["model_config_s"] = time.perf_counter() - t
        self.runner = None
        self.mesh = None
        self._stages = self._head_w = None

    # ------------------------------------------------------------------ loading
    def load(self) -> float:
        """Load the weights into their stages and start building the tokenizer in a thread; returns
        the weights' load seconds. `tokenizer()` waits for the tokenizer. On accelerators the
        build runs beside the weights (their load is mostly device transfers) and `load` waits for
        it, so its errors come before any compile; on CPUs it starts after the weights and runs
        beside the runner's construction and the warm-up (a CPU's weight conversion is host Python
        and numpy, and the build's transformers import holds the GIL), so its errors come with
        the engine's first `tokenizer()` call."""
        from jvllm.converters import load_checkpoint, load_tokenizer

        config = self.config
        layout = self._layout(config, self.devices)
        tok_dir = os.path.join(self.cache_dir, "tokenizers") if self.cache_dir else None

        def tokenizer_job():
            t = time.perf_counter()
            tok = load_tokenizer(self.spec, tok_dir)
            self.tokenizer_seconds = time.perf_counter() - t
            return tok

        build = config.skip_tokenizer_init is not True
        after = not self.on_accelerator
        self.init_parts["tokenizer_s"] = 0.0
        pool = ThreadPoolExecutor(1, thread_name_prefix="jvllm-tokenizer")
        try:
            if build and not after:
                self._tokenizer_job = pool.submit(tokenizer_job)
            ckpt = self._load_checkpoint(load_checkpoint, config, layout)
            if build and after:
                self._tokenizer_job = pool.submit(tokenizer_job)
        except BaseException:
            pool.shutdown(wait=True)  # a failed load leaves no thread behind
            raise
        pool.shutdown(wait=False)
        if not after:
            self.tokenizer()
        t = time.perf_counter()
        self._stages, self._head_w = self._build_stages(layout, ckpt.params)
        self.init_parts["build_stages_s"] = time.perf_counter() - t
        return ckpt.load_seconds

    def tokenizer(self):
        """The tokenizer `load` started (None when the checkpoint ships none or skip_tokenizer_init;
        a ValueError when it ships none and skip_tokenizer_init is False), waiting for its thread
        on the first call; a failed build re-raises its error on every call.
        `init_parts["tokenizer_s"]` is that wait (the part of the build not hidden behind other
        work), `tokenizer_seconds` the build's own."""
        job = self._tokenizer_job
        if job is not None:  # kept until it succeeds: a failed build raises on every call
            t = time.perf_counter()
            tok = job.result()
            self.init_parts["tokenizer_s"] = time.perf_counter() - t
            if tok is None and self.config.skip_tokenizer_init is False:
                raise ValueError(f"model {self.config.model!r} ships no tokenizer files; pass skip_tokenizer_init=True")
            self._tokenizer, self._tokenizer_job = tok, None
        return self._tokenizer

    def _load_checkpoint(self, load_checkpoint, config, layout):
        try:
            return load_checkpoint(self.spec, self.dtype, shardings=layout["shardings"],
                                   quantization=self.model_config.quant)  # the layout resolved above
        except Exception as e:
            if "RESOURCE_EXHAUSTED" not in str(e) and "out of memory" not in str(e).lower():
                raise
            stats = sizing.device_memory_stats() or {}
            raise MemoryError(
                f"loading {config.model!r} ran out of device memory (allocator limit "
                f"{stats.get('bytes_limit', 0) / 2**30:.2f} GiB, pool {stats.get('pool_bytes', 0) / 2**30:.2f} GiB, in use "
                f"{stats.get('bytes_in_use', 0) / 2**30:.2f} GiB; gpu_memory_utilization {config.gpu_memory_utilization}): "
                f"free memory on the device, raise gpu_memory_utilization, or shard the model "
                f"(tensor_parallel_size / pipeline_parallel_size)") from e

    def _layout(self, config, devices) -> dict:
        """Mesh, stage meshes and per-parameter shardings for TP x PP (None when on one device)."""
        tp, pp, ep = config.tensor_parallel_size, config.pipeline_parallel_size, config.expert_parallel_size
        mc = self.model_config
        if tp * pp * ep == 1 and devices is None:
            return dict(shardings=None, stage_meshes=[None], ranges=[(0, mc.num_layers)], rules=None)
        from jax.sharding import NamedSharding

        from jvllm.models import param_specs, stage_layers, stage_names
        from jvllm.sharding import make_mesh, parallel_rules, partition_spec, stage_mesh

        rules = parallel_rules(mc, tp, ep, config.enable_expert_parallel)
        mesh = make_mesh(tensor=tp, stage=pp, data=1, devices=devices, expert=ep)
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

    def _check_multiprocess_stages(self, config, meshes):
        """Pipeline stages over several processes (`jvllm launch`): refused, naming the sizes, where
        a stage would span processes, where a process would own neither the first nor the last
        stage (the sampled ids reach only those two), and with tied embeddings (the last stage's copy
        of the embedding would have to cross processes at load time)."""
        nproc = jax.process_count()
        owners = [sorted({d.process_index for d in m.devices.flat}) for m in meshes]
        pp, tp = config.pipeline_parallel_size, config.tensor_parallel_size
        per = jax.local_device_count()
        if any(len(o) > 1 for o in owners):
            raise ValueError(f"pipeline_parallel_size={pp} x tensor_parallel_size={tp} over {nproc} processes of "
                             f"{per} device(s): stage(s) {[s for s, o in enumerate(owners) if len(o) > 1]} would span "
                             f"processes; give each process whole stages (tensor_parallel_size a divisor of {per})")
        idle = sorted(set(range(nproc)) - {owners[0][0], owners[-1][0]})
        if idle:
            raise ValueError(f"pipeline_parallel_size={pp} over {nproc} processes: process(es) {idle} would own "
                             f"neither the first nor the last stage; use at most 2 processes for the stages")
        if self.model_config.tie_word_embeddings and owners[0] != owners[-1]:
            raise ValueError(f"pipeline stages over {nproc} processes need a model with its own LM head; "
                             f"{config.model!r} ties it to the embedding: run its pipeline stages in one process")

    def _build_stages(self, layout, params):
        from jvllm.models import bind, stage_names

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
        if mc.lm_head_bias:  # the weight above (the last stage's copy when tied) with its bias
            from jvllm.models.layers import HeadParams

            head_w = HeadParams(head_w, params["lm_head_bias"])
        return stages, head_w

    # ------------------------------------------------------------------ KV pool and runner
    def kv_bytes_per_block(self) -> int:
        """Bytes one block takes on the most loaded device (stage 0's layers, its share of KV heads)."""
        c, mc = self.config, self.model_config
        return kv_cache.bytes_per_block(mc, self.kv_dtype, c.block_size,
                                        num_layers=kv_cache.most_loaded_stage_layers(mc.num_layers, c.pipeline_parallel_size),
                                        tensor_parallel_size=c.tensor_parallel_size)

    def _make_runner(self, num_blocks: int, sc: SchedulerConfig, buckets):
        from jvllm.worker.model_runner import ModelRunner

        c, acc = self.config, self.on_accelerator
        return ModelRunner(self.model_config, head_w=self._head_w, dtype=self.dtype, kv_dtype=self.kv_dtype,
                           block_size=c.block_size,
                           num_blocks=num_blocks, max_model_len=sc.max_model_len, max_num_seqs=sc.max_num_seqs,
                           token_buckets=buckets,
                           query_tile=c.query_tile or (16 if acc else 8),
                           kv_chunk_blocks=c.kv_chunk_blocks or (16 if acc else 4),
                           stages=[dataclasses.replace(st, kv=None) for st in self._stages],  # shares weights
                           num_microbatches=c.num_microbatches, attention_backend=c.attention_backend,
                           logits_processors=tuple((c.logits_processors or {}).items()),
                           batch_invariant=c.batch_invariant)

    def _activation_peak(self, sc: SchedulerConfig, buckets) -> int:
        """XLA's temp allocation for the largest step and sampler programs, compiled against a
        2-block pool (the peak does not depend on the pool size: the pool is donated). With a warm
        executable cache the figures are read from its entries: nothing is traced or compiled."""
        probe = self._make_runner(2, sc, buckets)
        T = probe.token_buckets[-1]
        from jvllm.worker.programs import largest_sample_key

        keys = [("step", (s, T, False)) for s in range(len(probe.stages))] + [
            ("sample", largest_sample_key(probe, probe.layout.seq_bucket(T)))]
        owned = set(probe.programs.keys())  # this process's programs (stages over processes)
        temps = [probe.programs.temp_bytes(*k) for k in keys if k in owned]
        for st in probe.stages:
            kv_cache.delete(st.kv)  # this process's pools (others' are None)
        return sizing.activation_peak_bytes(temps)

    def build_runner(self, sc: SchedulerConfig, cc: CacheConfig, buckets, extra_bytes_per_block: int = 0) -> int:
        """Size the KV pool (agreed on by every process), allocate it and build the runner. Returns
        the number of blocks. Raises ValueError when max_model_len does not fit in the pool.
        `extra_bytes_per_block`: device bytes another pool of as many blocks needs beside this one
        (a speculative draft model's), so the budget is split between the two."""
        from jvllm.config import cdiv

        t = time.perf_counter()
        n = sizing.num_blocks(cc, self.kv_bytes_per_block() + extra_bytes_per_block, sc.max_model_len, sc.max_num_seqs,
                              lambda: self._activation_peak(sc, buckets))
        n = sizing.agree_min(n)
        self.init_parts["kv_sizing_s"] = time.perf_counter() - t
        need, bs = cdiv(sc.max_model_len, cc.block_size), cc.block_size
        if need > n - 1:
            raise ValueError(
                f"max_model_len ({sc.max_model_len}) needs {need} KV blocks of {bs} tokens but the pool has "
                f"{n - 1} usable blocks ({(n - 1) * bs} tokens); lower max_model_len or give "
                f"the KV cache more memory (gpu_memory_utilization, kv_cache_memory_bytes, num_gpu_blocks_override)")
        t = time.perf_counter()
        self.runner = self._make_runner(n, sc, buckets)
        self._stages = None  # the runner holds the stages now
        self.init_parts["runner_s"] = time.perf_counter() - t
        return n

    @property
    def multiprocess(self) -> bool:
        return bool(self.runner is not None and self.runner.multiprocess)

    # ------------------------------------------------------------------ warm-up
    def warm_up(self, background: bool, use_tqdm: bool = True, first_only: bool = False) -> tuple[float, WarmUp]:
        """Compile every program ahead of serving: with `background` the ones a first request
        needs now and the rest in a daemon thread (never across processes: all must compile the
        same programs in the same order). `first_only` (EngineConfig.warmup "first"): only the
        first request's; the others compile on first use (in every process alike: they run the
        same steps). Returns (foreground seconds, handle of the rest)."""
        r = self.runner
        first, rest = r.warmup_keys()
        if first_only:
            r.programs.defer(rest)
            rest = []
        if not background or self.process_count > 1:
            first, rest = first + rest, []
        progress = None
        if use_tqdm:
            from tqdm.auto import tqdm

            def progress(keys):
                return tqdm(keys, desc="jvllm: compiling buckets", unit="prog", leave=False)
        t0 = time.perf_counter()
        if self.process_count > 1:  # every process compiles the same programs in the same order
            r.programs.warm_up(first, progress=progress)  # foreground: returns when done
            return time.perf_counter() - t0, r.programs.warm_up(rest)
        # one process: the first programs load in parallel and the rest starts beside them (its head
        # is the smallest prefill step, which a short first prompt needs next); the rest's handle
        # ends after both, so that compiles after warm-up count from the end of all of it
        first_done = threading.Event()
        handle = r.programs.warm_up(rest, background=True, after=first_done) if rest else None
        try:
            r.programs.warm_up(first, progress=progress, threads=min(len(first), max(2, compile_threads())))
        finally:
            first_done.set()
        return time.perf_counter() - t0, handle or r.programs.warm_up([])

    def compile_count(self) -> int:
        """Process-wide XLA compiles, less deferred programs' first-use compiles (warmup "first")."""
        return planned_compile_count()

    def compiled_programs(self) -> dict:
        return self.runner.programs.compiled() if self.runner is not None else {}

    def release(self):
        if self.runner is not None:
            self.runner.release()
            self.runner = None
