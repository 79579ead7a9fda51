"""Sleep mode (`LLM(enable_sleep_mode=True)`, `llm.sleep(level)`, `llm.wake_up()`): give the
device memory of an idle engine back, for a trainer sharing the devices between rollouts.

  level 1  frees the KV pool (its contents are lost: the prefix cache is invalidated by the caller)
  level 2  also moves the weights to host memory (numpy), restored by `wake_up`

The compiled programs are kept (their argument shapes, dtypes and shardings do not change), so a
woken engine serves without recompiling its step programs; re-zeroing the pool runs one tiny
program per pool shape.

Hazard: level 2 deletes the device arrays of the weights, so arrays the caller holds from
`LLM.get_weights()`, or handed over in place through `update_weights`, are invalid afterwards.
"""
from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jvllm.memory import kv_cache


@dataclasses.dataclass
class Asleep:
    level: int
    freed_bytes: int
    host_weights: dict | None = None    # {global name: numpy} (level 2)
    shardings: dict | None = None        # {global name: the sharding to restore}


def _nbytes(tree) -> int:
    return sum(a.nbytes for a in jax.tree_util.tree_leaves(tree) if isinstance(a, jax.Array) and not a.is_deleted())


def sleep(runner, level: int) -> Asleep:
    """Free the KV pool (level 1) and the weights too (level 2) of `runner`, which must be idle."""
    from jvllm.worker.weights import live_params

    if level not in (1, 2):
        raise ValueError(f"sleep level must be 1 (free the KV pool) or 2 (also offload the weights), got {level!r}")
    freed = 0
    for st in runner.stages:
        if st.kv is not None:
            freed += _nbytes(st.kv)
            kv_cache.delete(st.kv)
            st.kv = None
    if level == 1:
        return Asleep(1, freed)
    live = live_params(runner)
    host = {k: np.asarray(a) for k, a in live.items()}
    shard = {k: a.sharding for k, a in live.items()}
    arrays = list(live.values()) + jax.tree_util.tree_leaves(runner.head_w)
    freed += _nbytes(list({id(a): a for a in arrays}.values()))
    kv_cache.delete(arrays)
    return Asleep(2, freed, host, shard)


def wake_up(runner, asleep: Asleep):
    """Undo `sleep`: a zeroed KV pool of the same shape, the weights back where they were."""
    from jvllm.worker.weights import update_params

    if asleep.level == 2:
        # the deleted arrays still give update_params the targets' shardings and dtypes (metadata)
        update_params(runner, {k: jax.device_put(a, asleep.shardings[k]) for k, a in asleep.host_weights.items()})
    for i, st in enumerate(runner.stages):
        if runner.local(i):
            st.kv = kv_cache.allocate(runner.cfg, st.num_layers(), runner.num_blocks, runner.block_size,
                                      runner.kv_dtype, st.sharding(st.kv_spec))

