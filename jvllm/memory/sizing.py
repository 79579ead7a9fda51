"""KV pool sizing: how many blocks the pool gets, from an explicit count, a byte budget, or the
device's free memory after weights and the activation peak (vLLM's rule, `device.kv_budget_bytes`).

Hazard: every process of a multi-process run must build the same programs (multi-controller JAX;
on GPUs XLA even shares autotuning between the processes' compilers, so a mismatch hangs), so a
block count each process derives from its own device is agreed on (`agree_min`) before anything is
compiled with it.
"""
from __future__ import annotations

from typing import Callable

import jax
import numpy as np

from jvllm.config import CacheConfig, cdiv

CPU_DEFAULT_KV_BYTES = 512 * 2**20


def device_memory_stats() -> dict | None:
    """This process's first device's allocator stats (bytes_limit, bytes_in_use, ...); None where
    the backend has none (CPU), which selects the CPU sizing rule. A local device: in a multi-process
    run the global first device belongs to process 0 and its stats are not readable elsewhere."""
    try:
        return jax.local_devices()[0].memory_stats()
    except Exception:
        return None


def agree_min(value: int) -> int:
    """The smallest of every process's `value` (itself in a single-process run)."""
    if jax.process_count() == 1:
        return int(value)
    from jax.experimental import multihost_utils

    return int(np.min(multihost_utils.process_allgather(np.asarray(value, np.int64))))


def num_blocks(cc: CacheConfig, per_block: int, max_model_len: int, max_num_seqs: int,
               activation_peak: Callable[[], int]) -> int:
    """Blocks of the pool (block 0 included). `per_block`: bytes of one block on the most loaded
    device; `activation_peak()`: bytes of the largest programs' temporaries (called only when the
    device's free memory decides). Raises ValueError when not even 2 blocks fit."""
    if cc.num_blocks is not None:
        return cc.num_blocks
    cap = max_num_seqs * cdiv(max_model_len, cc.block_size) + 1  # never more than all slots could use
    if cc.kv_cache_memory_bytes is not None:
        return max(2, min(cap, cc.kv_cache_memory_bytes // per_block + 1))
    stats = device_memory_stats()
    if stats and stats.get("bytes_limit"):
        from jvllm.memory.device import kv_budget_bytes

        budget, how, advice = kv_budget_bytes(stats, cc.gpu_memory_utilization, activation_peak())
        if budget < 2 * per_block:
            raise ValueError(f"no device memory left for the KV cache: {how} < 2 blocks of "
                             f"{per_block / 2**20:.2f} MiB; {advice}")
        return int(min(cap, budget // per_block))
    return max(2, min(cap, CPU_DEFAULT_KV_BYTES // per_block + 1))


def activation_peak_bytes(temps: list[int | None]) -> int:
    """The activation peak from the probe programs' temp allocations (`counter.temp_bytes`), with a
    10% margin; a program whose backend gives no memory analysis counts as 5% of the device."""
    peak = 0
    for temp in temps:
        if temp is None:
            temp = int(0.05 * (device_memory_stats() or {}).get("bytes_limit", 0))
        peak = max(peak, temp)
    return int(peak * 1.1)
