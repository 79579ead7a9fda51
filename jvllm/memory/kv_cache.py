"""Device KV pages: per layer one (K, V) pair of arrays [kv_heads, num_blocks, block_size, head_dim],
allocated once on a stage's devices and donated to every step (XLA updates them in place).

`bytes_per_block` is THE formula for what a block costs: the engine sizes the pool with it, the
runner allocates exactly that, and the benchmarks derive bytes per token from it.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jvllm.config import ModelConfig


def kv_heads_per_device(cfg: ModelConfig, tensor_parallel_size: int = 1) -> int:
    """KV heads each device holds: a 1/tp share when tp divides them, else all (replicated)."""
    tp = tensor_parallel_size
    return cfg.num_kv_heads // tp if cfg.num_kv_heads % tp == 0 else cfg.num_kv_heads


def bytes_per_block(cfg: ModelConfig, dtype, block_size: int, *, num_layers: int | None = None,
                    tensor_parallel_size: int = 1) -> int:
    """Bytes one block of `block_size` tokens takes (K and V) over `num_layers` layers (default: all)
    on one device at `tensor_parallel_size` (its share of KV heads)."""
    layers = cfg.num_layers if num_layers is None else num_layers
    heads = kv_heads_per_device(cfg, tensor_parallel_size)
    return 2 * layers * block_size * heads * cfg.head_dim * np.dtype(jnp.dtype(dtype)).itemsize


def most_loaded_stage_layers(num_layers: int, pipeline_parallel_size: int) -> int:
    """Layers of the largest pipeline stage (the first; `jvllm.models.stage_layers` splits that way)."""
    return -(-num_layers // pipeline_parallel_size)


def page_shape(cfg: ModelConfig, num_blocks: int, block_size: int) -> tuple[int, int, int, int]:
    return (cfg.num_kv_heads, num_blocks, block_size, cfg.head_dim)


def allocate(cfg: ModelConfig, num_layers: int, num_blocks: int, block_size: int, dtype, sharding=None) -> list:
    """Zeroed KV pages for `num_layers` layers: [(K, V)] with `sharding` (None: the default device)."""
    zeros = _zeros_program(page_shape(cfg, num_blocks, block_size), jnp.dtype(dtype), sharding)
    return [(zeros(), zeros()) for _ in range(num_layers)]


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
