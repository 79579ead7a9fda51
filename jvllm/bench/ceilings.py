"""The device's ceilings, measured in the same run as the figures they divide: copy bandwidth
(B1's MBU) and matmul rate (P1's MFU). Run them before the engine exists, so that their compiles
do not count against `compiles_after_warmup`."""
from __future__ import annotations

import statistics
import time


def median_time(fn, *args, trials: int = 7, calls: int = 10) -> float:
    """Seconds per call: median over `trials` of `calls` back-to-back calls then one sync (so the
    host round trip of a sync is spread over many calls), after a warm-up."""
    import jax

    for _ in range(3):
        jax.block_until_ready(fn(*args))  # compile, first run, clocks up
    ts = []
    for _ in range(trials):
        t = time.perf_counter()
        outs = [fn(*args) for _ in range(calls)]
        jax.block_until_ready(outs)
        ts.append((time.perf_counter() - t) / calls)
        del outs
    return statistics.median(ts)


def measure_copy_bandwidth(nbytes: int | None = None) -> dict:
    """Device copy bandwidth (read + write) from a jitted `x + 1` over a large array."""
    import jax
    import jax.numpy as jnp

    on_acc = jax.default_backend() != "cpu"
    nbytes = nbytes or (2 * 2**30 if on_acc else 256 * 2**20)
    n = nbytes // 4
    x = jnp.ones((n,), jnp.float32)
    f = jax.jit(lambda a: a + 1.0)
    dt = median_time(f, x, calls=10 if on_acc else 2)
    x.delete()
    return dict(copy_bytes=n * 4, copy_seconds=dt, copy_bandwidth_Bps=2 * n * 4 / dt, counts="read + write")


def measure_matmul_rate(n: int | None = None, dtype="float32") -> dict:
    """FLOP/s of jnp.dot on an n x n matrix in `dtype` (8192 on an accelerator, 2048 on a CPU)."""
    import jax
    import jax.numpy as jnp

    on_acc = jax.default_backend() != "cpu"
    n = n or (8192 if on_acc else 2048)
    dt_ = jnp.dtype(dtype)
    a = jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.float32).astype(dt_)
    b = jax.random.normal(jax.random.PRNGKey(1), (n, n), jnp.float32).astype(dt_)
    f = jax.jit(lambda x, y: jnp.dot(x, y))
    dt = median_time(f, a, b, calls=10 if on_acc else 1, trials=7 if on_acc else 3)
    a.delete(), b.delete()
    return dict(matmul_n=n, matmul_dtype=str(dt_), matmul_seconds=dt, matmul_flops_per_s=2 * n**3 / dt)


def measure(latency: bool, prefill: bool, copy_bytes: int | None, matmul_n: int | None, dtype: str | None) -> dict:
    """The ceilings the chosen workloads need (copy for B1, matmul in the model's `dtype` name for
    P1), with the platform; {} when neither is needed."""
    import jax

    from jvllm.worker.worker import resolve_dtype

    ceil = {}
    if latency:
        ceil.update(measure_copy_bandwidth(copy_bytes))
    if prefill:
        ceil.update(measure_matmul_rate(matmul_n, resolve_dtype(dtype)))
    if ceil:
        ceil["platform"] = jax.default_backend()
        if jax.default_backend() == "cpu":
            ceil["note"] = "CPU ceilings: host memory bandwidth / host matmul rate, not a GPU roofline"
    return ceil
