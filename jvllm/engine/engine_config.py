"""EngineConfig: everything `LLM(...)` / `jvllm serve` accept, and the option checks that need no
weights (host only: no jax import at module level)."""
from __future__ import annotations

import dataclasses
import functools
import os
import types
import typing

WARMUPS = ("all", "first")
_SCALARS = (bool, int, float, str)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """None means "pick a default for this device"."""

    model: str = "smollm2"
    dtype: str = "auto"
    # quantized projection weights: None | "fp8" | "int8" (jvllm.quantization); a pre-quantized
    # checkpoint brings its own (None or "fp8" accepted for it)
    quantization: str | None = None
    # weight-only fp8 projections: auto (= xla, the measured faster one) | xla | pallas
    # (jvllm.ops.pallas_matmul for decode-sized steps; interpret mode off GPUs);
    # pallas without fp8 weights is an error (jvllm.quantization.config)
    fp8_matmul_backend: str = "auto"
    # scales of quantized projections: auto / channel (one per output channel) | an integer >= 2
    # dividing every projection's last contracted dim: one per that many input rows per output
    # channel (weight-only, XLA; jvllm.quantization.config)
    quantization_group_size: int | str = "auto"
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.9
    block_size: int = 16
    num_gpu_blocks_override: int | None = None
    kv_cache_memory_bytes: int | None = None
    # KV pages: auto (the model dtype) | fp8 / fp8_e4m3 (float8_e4m3fn, per-token scales: jvllm.ops.kv_quant)
    kv_cache_dtype: str = "auto"
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    enable_prefix_caching: bool = True
    seed: int = 0
    # the model's generation defaults (vLLM's option): auto (its folder's generation_config.json) |
    # vllm (none) | a folder holding one; end tokens and unset sampling fields (jvllm.generation_config)
    generation_config: str = "auto"
    skip_tokenizer_init: bool | None = None  # None: auto (True when the checkpoint has no tokenizer)
    token_buckets: tuple[int, ...] | None = None
    # cut a step's last prefill chunk at a token-bucket edge where that pads less (engine/bucket_fit.py);
    # off by default: it lowers TPOT but delays first tokens, and one GPU A/B did not settle it
    # (benchmarks/README.md, S1)
    fit_chunks_to_buckets: bool = False
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
    # mixture-of-experts models: expert groups per stage (the stage mesh's "expert" axis). Each
    # stage then runs on expert_parallel_size x tensor_parallel_size devices: attention (and its KV
    # pool) tensor parallel and replicated over the groups, the experts split over the groups (with
    # enable_expert_parallel: over all of the stage's devices). An error for a model without experts
    expert_parallel_size: int = 1
    # the experts' grouped matmuls: auto (tokamax on GPUs when installed, else xla) | xla | tokamax
    moe_backend: str = "auto"
    num_microbatches: int | None = None  # pipeline micro-batches per step (default: one per stage)
    # auto (GPU: ragged, elsewhere xla) | xla | pallas (decode steps: JAX's Pallas paged-attention
    # kernel; mixed steps: jvllm's ragged kernel) | pallas_decode (mixed steps on XLA) | ragged (all
    # steps on the ragged kernel) | ragged_split (every decode-only step split-K; "ragged" splits
    # only grids under 512 programs, such as B1); "_interpret" runs the Pallas kernels in
    # interpret mode (CPU tests)
    attention_backend: str = "auto"
    # {name: jittable fn(logits, output_token_ids, args) -> logits} (jvllm.worker.logits_processors)
    logits_processors: dict | None = None
    # allow LLM.sleep / wake_up (jvllm.memory.sleep)
    enable_sleep_mode: bool = False
    # dispatch step N+1 before reading step N's results, so the host's scheduling and input
    # building overlap the device's work (None: on wherever supported: a single-process engine,
    # TP and PP included, that is not a data-parallel replica; True there, False anywhere)
    async_scheduling: bool | None = None
    # compile the programs a first request needs at start-up and the rest in a background thread
    # (LLMEngine.wait_for_warmup waits for them); False compiles everything before returning.
    # Multi-process runs always compile in the foreground.
    background_compile: bool = True
    # which programs the warm-up compiles: "all" (every bucket and sampler variant, so nothing
    # compiles once it is done) | "first" (only what a first request needs; every other planned
    # program compiles on its first use, counted in get_stats()["deferred_compiles"], not in
    # compiles_after_warmup, which still counts compiles outside the plan): for short sessions on small
    # machines that use few buckets (a notebook on a laptop, the test suite). Default from the
    # environment variable JVLLM_WARMUP, else "all".
    warmup: str = dataclasses.field(default_factory=lambda: os.environ.get("JVLLM_WARMUP") or "all")
    # a request's tokens and logprobs bit-identical whatever else is in its batch, however its
    # prompt was chunked and whether its prefix was cached: fixed-tile matmuls, no decode-only
    # variant, one sampler program (jvllm.worker.batch_invariant states what holds where)
    batch_invariant: bool = False
    # speculative decoding, vLLM's dict: {"method": "ngram", "num_speculative_tokens": k,
    # "prompt_lookup_max": 4, "prompt_lookup_min": 2} or {"model": DRAFT, "num_speculative_tokens": k}
    # (jvllm.spec_decode.config states every key); None: off
    speculative_config: dict | None = None

    def __post_init__(self):
        """Every option of a plain type (bool, int, float, str, or None where allowed) has it:
        LLM(seed="x") or LLM(enable_prefix_caching="no") is a ValueError naming the option, before
        anything loads (a bool is no int; an int is a float). A path-like model becomes its str."""
        for f in ("model", "generation_config", "compilation_cache_dir"):
            if isinstance(getattr(self, f), os.PathLike):
                object.__setattr__(self, f, os.fspath(getattr(self, f)))
        for name, allowed in _scalar_types().items():
            v = getattr(self, name)
            ok = any(v is None if t is type(None) else
                     (isinstance(v, t) and not (t in (int, float) and isinstance(v, bool))
                      or (t is float and isinstance(v, int) and not isinstance(v, bool)))
                     for t in allowed)
            if not ok:
                names = " or ".join("None" if t is type(None) else t.__name__ for t in allowed)
                raise ValueError(f"{name} must be {names}, got {v!r}")


@functools.cache
def _scalar_types() -> dict:
    """{EngineConfig field: the types its annotation allows}, for fields of scalar types only."""
    out = {}
    for name, hint in typing.get_type_hints(EngineConfig).items():
        args = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
        if all(a in _SCALARS or a is type(None) for a in args):
            out[name] = args
    return out


def check_options(config: EngineConfig, model_config, data_parallel_replica: bool):
    """Option checks that need no weights (a bad value fails before minutes of loading)."""
    from jvllm.worker.attention_modes import attention_modes

    attention_modes(config.attention_backend, platform="any")
    from jvllm.generation_config import check_source

    check_source(config.generation_config)
    if config.warmup not in WARMUPS:
        raise ValueError(f"warmup must be one of {WARMUPS}, got {config.warmup!r}")
    from jvllm.worker.logits_processors import check_registry

    check_registry(config.logits_processors)
    if config.async_scheduling and data_parallel_replica:
        raise ValueError("async_scheduling needs an engine that is not a data-parallel replica "
                         "(got a data-parallel device slice)")
    mc = model_config
    if config.max_model_len is not None and config.max_model_len > mc.max_position_embeddings \
            and mc.rope_type in ("default", "dynamic"):
        why = ("; rope_scaling 'dynamic' (NTK) rescales by each sequence's whole length beyond it, which a "
               "paged cache cannot reproduce: jvllm runs it within max_position_embeddings only"
               if mc.rope_type == "dynamic" else "")
        raise ValueError(f"max_model_len ({config.max_model_len}) exceeds the model's max_position_embeddings "
                         f"({mc.max_position_embeddings}){why}")


def check_speculation(config: EngineConfig, spec):
    """Engine options speculative decoding does not run with: a clear error naming them (pipeline
    stages, which stages over processes need too; sleep mode with a draft model, whose weights and
    pool sleep mode does not manage)."""
    if config.pipeline_parallel_size > 1:
        raise ValueError(f"speculative_config needs pipeline_parallel_size 1 (got {config.pipeline_parallel_size}): "
                         f"the verifier reads the step's hidden states on one stage")
    if config.batch_invariant:
        raise ValueError("speculative_config with batch_invariant=True is not implemented: a verified step computes "
                         "several of a request's positions at once, which batch-invariant mode does not cover")
    if config.enable_sleep_mode and spec.uses_draft_model:
        raise ValueError("enable_sleep_mode=True with a speculative draft model is not implemented (sleep would "
                         "not free the draft's weights and KV pool); use method 'ngram' or no sleep mode")
