"""The memory table of a bench JSON: device memory after the runs, the weights and the KV pool."""
from __future__ import annotations

from jvllm.bench import facts


def memory_report(llm) -> dict:
    """Device memory after the runs: the allocator's peak and current use (None on backends
    without allocator stats, e.g. CPU), the weights and the KV pool. `per_device` lists every
    device with stats, in a multi-process run every process's. A collective in a multi-process
    run: every process must call it."""
    import jax
    import numpy as np

    from jvllm.memory.device import claimed_fraction
    from jvllm.memory.sizing import device_memory_stats

    eng = getattr(llm.llm_engine, "replicas", [llm.llm_engine])[0]
    stats = device_memory_stats() or {}
    keys = ("peak_bytes_in_use", "bytes_in_use", "bytes_limit")
    rows = []  # this process's devices: [peak, in use, limit], -1 where the backend has no stats
    for d in jax.local_devices():
        try:
            ms = d.memory_stats() or {}
        except Exception:
            ms = {}
        rows.append([int(ms.get(k) if ms.get(k) is not None else -1) for k in keys])
    table = np.asarray(rows, np.int64)[None]
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        # gathered as bytes: without jax_enable_x64 an int64 array travels as int32 (and overflows),
        # while uint8 travels as it is
        raw = np.asarray(multihost_utils.process_allgather(table[0].view(np.uint8)))
        table = raw.reshape(raw.shape[0], -1).view(np.int64).reshape(raw.shape[0], len(rows), len(keys))
    per_device = [dict(device=f"process {p} local device {i}" if jax.process_count() > 1 else str(jax.local_devices()[i]),
                       **{k: (int(v) if v >= 0 else None) for k, v in zip(keys, row)})
                  for p, proc in enumerate(table) for i, row in enumerate(proc) if (row >= 0).any()]
    kv = sum(a.nbytes for pair in eng.runner.kv for a in pair)
    return dict(peak_bytes_in_use=stats.get("peak_bytes_in_use"), bytes_in_use=stats.get("bytes_in_use"),
                bytes_limit=stats.get("bytes_limit"), pool_bytes=stats.get("pool_bytes"),
                allocator_fraction_set_by_jvllm=claimed_fraction(), per_device=per_device,
                weight_bytes=facts.param_stats(llm)["weight_bytes"], kv_pool_bytes_global=kv,
                kv_blocks=eng.runner.num_blocks, block_size=eng.runner.block_size,
                kv_cache_dtype=str(eng.runner.kv_dtype), kv_tokens=(eng.runner.num_blocks - 1) * eng.runner.block_size)
