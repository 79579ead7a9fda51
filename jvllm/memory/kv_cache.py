"""Device KV pages: per layer one (K, V) pair of arrays [kv_heads, num_blocks, block_size, head_dim],
allocated once on a stage's devices and donated to every step (XLA updates them in place). With
`kv_cache_dtype="fp8"` each of K and V is a `kv_quant.QuantizedPages` instead: the pages in
float8_e4m3fn plus a bfloat16 scale per (KV head, slot) (see jvllm/ops/kv_quant.py for why).

`bytes_per_block` is THE formula for what a block costs: the engine sizes the pool with it, the
runner allocates exactly that, and the benchmarks derive bytes per token from it.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jvllm.config import ModelConfig
from jvllm.ops.kv_quant import FP8, SCALE_DTYPE, QuantizedPages

# kv_cache_dtype (vLLM's option) -> the pages' dtype; None: the model's dtype
KV_CACHE_DTYPES = {"auto": None, "fp8": FP8, "fp8_e4m3": FP8}


def resolve_dtype(kv_cache_dtype: str, model_dtype):
    """The KV pages' dtype for `kv_cache_dtype`: "auto" -> the model dtype, "fp8" / "fp8_e4m3" ->
    float8_e4m3fn (with per-token scales). Raises ValueError naming the supported values."""
    if not isinstance(kv_cache_dtype, str) or kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {kv_cache_dtype!r}")
    dt = KV_CACHE_DTYPES[kv_cache_dtype]
    return jnp.dtype(model_dtype if dt is None else dt)


def is_quantized(dtype) -> bool:
    """Whether pages of `dtype` are quantized (fp8 with scales) rather than plain arrays."""
    return jnp.dtype(dtype) == FP8


def kv_heads_per_device(cfg: ModelConfig, tensor_parallel_size: int = 1) -> int:
    """KV heads each device holds: a 1/tp share when tp divides them, else all (replicated)."""
    tp = tensor_parallel_size
    return cfg.num_kv_heads // tp if cfg.num_kv_heads % tp == 0 else cfg.num_kv_heads


def bytes_per_block(cfg: ModelConfig, dtype, block_size: int, *, num_layers: int | None = None,
                    tensor_parallel_size: int = 1) -> int:
    """Bytes one block of `block_size` tokens takes (K and V) over `num_layers` layers (default: all)
    on one device at `tensor_parallel_size` (its share of KV heads). `dtype`: the pages' dtype
    (`resolve_dtype`); fp8 slots also carry one scale per KV head (head_dim + 2 bytes a slot)."""
    layers = cfg.num_layers if num_layers is None else num_layers
    heads = kv_heads_per_device(cfg, tensor_parallel_size)
    slot = cfg.head_dim * np.dtype(jnp.dtype(dtype)).itemsize
    if is_quantized(dtype):
        slot += SCALE_DTYPE.itemsize
    return 2 * layers * block_size * heads * slot


def most_loaded_stage_layers(num_layers: int, pipeline_parallel_size: int) -> int:
    """Layers of the largest pipeline stage (the first; `jvllm.models.stage_layers` splits that way)."""
    return -(-num_layers // pipeline_parallel_size)


def page_shape(cfg: ModelConfig, num_blocks: int, block_size: int) -> tuple[int, int, int, int]:
    return (cfg.num_kv_heads, num_blocks, block_size, cfg.head_dim)


def allocate(cfg: ModelConfig, num_layers: int, num_blocks: int, block_size: int, dtype, sharding=None) -> list:
    """Zeroed KV pages for `num_layers` layers: [(K, V)] with `sharding` (None: the default device)
    of the pages; K and V are arrays of `dtype`, or `QuantizedPages` for fp8 (their scales take the
    pages' sharding of the first three axes: split by KV head as the pages are)."""
    shape = page_shape(cfg, num_blocks, block_size)
    zeros = _zeros_program(shape, jnp.dtype(dtype), sharding)
    if not is_quantized(dtype):
        return [(zeros(), zeros()) for _ in range(num_layers)]
    scale_sharding = None
    if sharding is not None:
        spec = tuple(sharding.spec)[:3]
        scale_sharding = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec))
    scales = _zeros_program(shape[:3], SCALE_DTYPE, scale_sharding)
    return [(QuantizedPages(zeros(), scales()), QuantizedPages(zeros(), scales())) for _ in range(num_layers)]


@functools.lru_cache(maxsize=None)
def _zeros_program(shape: tuple, dtype, sharding):
    """One jitted zero-maker per (shape, dtype, sharding): a pool allocated again with the same
    layout (wake_up after sleep) reuses it instead of compiling a new one."""
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)


def delete(pages) -> None:
    """Free KV pages now (their memory returns to the allocator at once)."""
    for arr in jax.tree_util.tree_leaves(pages):
        if isinstance(arr, jax.Array) and not arr.is_deleted():
            arr.delete()
