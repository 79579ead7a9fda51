"""The probes' one timing rule: a warm call (compiles, autotunes), then the median of `iters`
calls, each waited on with `jax.block_until_ready`; milliseconds. A single call's time includes
its dispatch (about 0.05-0.1 ms): compare kernels of a few microseconds inside one program, not
call by call. Imported by the probes as a sibling module (a probe runs as a script, so its own
folder is first on sys.path)."""
from __future__ import annotations

import statistics
import time


def median_ms(fn, args, iters: int) -> float:
    import jax

    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(iters):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3
