"""How much accelerator memory this engine may take, with vLLM's meaning of
`gpu_memory_utilization`: the fraction of the device's total memory this engine may use, whatever
other processes (other engines) hold on the same device.

JAX's GPU allocator is one pool per device, preallocated at the first allocation to a fraction of
the device's total memory (75% unless XLA_PYTHON_CLIENT_MEM_FRACTION / XLA_CLIENT_MEM_FRACTION say
otherwise), and it cannot be resized once the backend exists. So:

- `claim_device_memory(u)`, called before jvllm first touches a device, sets the fraction to `u`
  when the backend is not initialized yet and the user has set none of JAX's allocator variables:
  the pool is then this engine's share of the device (two engines at 0.45 each fit on one GPU; at
  JAX's default both would ask for 75%). Otherwise it changes nothing (the backend already has
  its pool, or the user chose one) and says so in the log.
- `kv_budget_bytes` sizes the KV pool inside the pool the allocator really holds: when another
  process already held memory, the allocator's preallocation backs off to what was free
  (`pool_bytes` < `bytes_limit`), and sizing against the nominal limit would fail the KV
  allocation. The rule is vLLM's: share x pool - weights (in use now) - activation peak, where
  the share is `POOL_SHARE` (0.9) of a pool jvllm sized to `u` itself (the pool already is the
  engine's share of the device; the 10% left is headroom for what the activation probe does not
  see: two steps in flight under async scheduling, transfers, fragmentation), and
  `u` of any other pool (JAX's default 75%, or the user's settings).
"""
from __future__ import annotations

import logging
import os

log = logging.getLogger("jvllm")

FRACTION_VARS = ("XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_CLIENT_MEM_FRACTION")
ALLOCATOR_VARS = FRACTION_VARS + ("XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_ALLOCATOR")
POOL_SHARE = 0.9  # of a pool jvllm sized itself, what weights + activations + KV may take
_claimed: float | None = None  # the fraction jvllm gave the allocator, if it did
GPU_PLATFORMS = ("cuda", "gpu", "rocm")


def backends_initialized() -> bool:
    try:
        from jax._src import xla_bridge

        return bool(xla_bridge.backends_are_initialized())
    except Exception:  # a JAX without the probe: assume the worst (never change a live backend's settings)
        return True


def claim_device_memory(utilization: float) -> bool:
    """Give JAX's device allocator `utilization` of each device's memory, if that is still
    possible and the user has not configured the allocator; returns whether it did."""
    global _claimed
    if _claimed is not None or not (isinstance(utilization, (int, float)) and 0.0 < utilization <= 1.0):
        return False  # already claimed, or a bad value that the engine's config check reports
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms and not any(p in platforms.lower() for p in GPU_PLATFORMS):
        return False  # no GPU allocator in this process (CPU tests, TPU)
    if not platforms:
        from jvllm.platform import accelerator_plugins

        if not accelerator_plugins():
            return False  # a CPU-only install: no GPU allocator, and nothing to say about one
    user = [v for v in ALLOCATOR_VARS if v in os.environ]
    if user or backends_initialized():
        log.info("device memory: JAX's allocator settings are kept (%s); gpu_memory_utilization %.2f "
                 "applies inside its pool", ", ".join(user) or "backend already initialized", utilization)
        return False
    # one spelling only: jaxlib refuses both together, and the CUDA plugin then falls back to the
    # CPU; the older name is read by every jaxlib this runs on (0.10 and 0.11)
    os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{utilization:.4f}"
    _claimed = float(utilization)
    return True


def claimed_fraction() -> float | None:
    return _claimed


def kv_budget_bytes(stats: dict, utilization: float, activation_bytes: int) -> tuple[int, str, str]:
    """(bytes the KV pool may take, how that was derived, what to do when it is too little) from
    one device's allocator stats (`bytes_limit`, `bytes_in_use`, optional `pool_bytes`)."""
    limit, used = int(stats["bytes_limit"]), int(stats.get("bytes_in_use", 0))
    pool = int(stats.get("pool_bytes") or 0)
    preallocating = os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE", "true").lower() not in ("false", "0")
    held = limit
    how = f"allocator limit {limit / 2**30:.2f} GiB"
    advice = "raise gpu_memory_utilization"
    if preallocating and 0 < pool < 0.98 * limit:  # (a full preallocation may round a little)
        held = pool
        advice = ("free memory on the device (other processes hold the rest) or lower this engine's "
                  "gpu_memory_utilization to what is free")
        how = (f"the allocator holds {pool / 2**30:.2f} GiB of its {limit / 2**30:.2f} GiB limit (the device "
               f"had no more free, another process on it?, or the pool grows on demand)")
        log.warning("device memory: %s; the KV cache is sized to what it holds", how)
    share = POOL_SHARE if _claimed is not None else utilization
    if _claimed is not None:
        how += f" (sized by jvllm to gpu_memory_utilization {_claimed} of the device)"
    budget = int(share * held - used - activation_bytes)
    return budget, (f"{share} x {how} - weights {used / 2**30:.2f} GiB - activations "
                    f"{activation_bytes / 2**30:.2f} GiB"), advice
