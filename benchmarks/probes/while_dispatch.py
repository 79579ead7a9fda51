"""Host cost of while loops in a GPU program: one jitted function holding L searchsorted calls
(the MoE tile table's search: [G] cumulative tile counts against [n] tile ids), with jnp's default
method (a fori_loop: an HLO while loop) against method="compare_all" (no loop). Reports per method
the host time of the call itself (a program without host syncs returns as soon as it is enqueued)
and the time to its result. Prints one JSON object (--out writes it).

    python benchmarks/probes/while_dispatch.py --layers 144 --groups 128 --tiles 384 --out f.json
"""
from __future__ import annotations

import argparse
import json
import time


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=144, help="searches in the program (a 48-layer MoE: 3 a layer)")
    ap.add_argument("--groups", type=int, default=128)
    ap.add_argument("--tiles", type=int, default=384)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    import jax
    import jax.numpy as jnp

    from jvllm.bench import device_info, versions

    def prog(method):
        def f(sizes):
            acc = jnp.zeros((a.tiles,), jnp.int32)
            for i in range(a.layers):  # each search depends on the last: no CSE, no reordering
                tcum = jnp.cumsum(sizes + (acc[: a.groups] % 2))
                acc = acc + jnp.searchsorted(tcum, jnp.arange(a.tiles, dtype=jnp.int32), side="right",
                                             method=method).astype(jnp.int32)
            return acc
        return jax.jit(f)

    sizes = jnp.ones((a.groups,), jnp.int32) * 3
    out = dict(probe="while_dispatch", layers=a.layers, groups=a.groups, tiles=a.tiles, device=device_info(),
               versions=versions())
    results = {}
    for method in ("scan", "compare_all"):
        f = prog(method)
        want = jax.block_until_ready(f(sizes))
        call, total = [], []
        for _ in range(a.reps):
            jax.block_until_ready(sizes)
            t0 = time.perf_counter()
            r = f(sizes)
            t1 = time.perf_counter()
            jax.block_until_ready(r)
            call.append(t1 - t0)
            total.append(time.perf_counter() - t0)
        call.sort(), total.sort()
        results[method] = dict(call_ms=1e3 * call[len(call) // 2], total_ms=1e3 * total[len(total) // 2],
                               has_while="while" in f.lower(sizes).as_text(), result_sum=int(want.sum()))
    assert results["scan"]["result_sum"] == results["compare_all"]["result_sum"]
    out["results"] = results
    text = json.dumps(out, indent=1)
    print(text)
    if a.out:
        with open(a.out, "w") as fh:
            fh.write(text)


if __name__ == "__main__":
    main()
