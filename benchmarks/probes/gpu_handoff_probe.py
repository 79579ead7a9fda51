"""Does handing a pipeline stage's output to the next stage's GPU block the host? The PP=2 runs on
2 H200s spent 10.9-14 ms of each W1 step inside launch calls and did not overlap the stages; the
suspect is `jax.device_put` of a not-yet-computed array onto another device. This probe times, on
two devices:

  producer   a jitted chain of matmuls on device 0 (~`--work-ms` of device time), then
  device_put jax.device_put(out, device 1)               (what the runner does today)
  ppermute   one SPMD program over a 2-device mesh: out (device 0's shard) and a dummy buffer
             (device 1's) form a global [2, ...] array; lax.ppermute moves shard 0 -> 1; device
             1's shard of the result is taken without a copy (what a ppermute hand-off would do)
  consumer   a jitted program on device 1 reading the handed-off array

For each method: host seconds spent in the hand-off call (~0 if it is asynchronous, ~work-ms if it
waits for the producer), host seconds to enqueue producer + hand-off + consumer, and wall time to
the consumer's result; results checked equal. --tiny runs on 2 fake CPU devices (a dry run:
CPU timings mean nothing here).

    python benchmarks/probes/gpu_handoff_probe.py [--out $OUT/handoff_probe.json] [--work-ms 5] [--tiny]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "handoff_probe.json"))
    ap.add_argument("--work-ms", type=float, default=5.0)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--trials", type=int, default=20)
    a = ap.parse_args(argv)
    if a.tiny:
        os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
        os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    d0, d1 = jax.devices()[:2]
    T, H = (64, 256) if a.tiny else (256, 4096)          # hidden states of a 256-token micro-batch
    dt = jnp.float32 if a.tiny else jnp.bfloat16
    w = jax.device_put(jnp.eye(H, dtype=dt) * 0.5 + 0.01, d0)

    def chain(x, w, n):
        for _ in range(n):
            x = jnp.tanh(x @ w)
        return x

    # calibrate n so the producer takes about work_ms on device 0
    x0 = jax.device_put(jnp.ones((T, H), dt), d0)
    n = 8
    while True:
        prod = jax.jit(lambda x, w, n=n: chain(x, w, n))
        jax.block_until_ready(prod(x0, w))
        t = time.perf_counter()
        for _ in range(5):
            jax.block_until_ready(prod(x0, w))
        ms = (time.perf_counter() - t) / 5 * 1e3
        if ms >= a.work_ms or n >= 4096 or a.tiny:
            break
        n *= 2
    consumer = jax.jit(lambda h: jnp.sum(h.astype(jnp.float32), axis=-1))  # runs where its input is (device 1)

    mesh = Mesh(np.array([d0, d1]), ("stage",))
    gsh = NamedSharding(mesh, P("stage"))
    dummy = jax.device_put(jnp.zeros((1, T, H), dt), d1)
    shard_map = getattr(jax, "shard_map", None)
    if shard_map is None:
        from jax.experimental.shard_map import shard_map
    perm = jax.jit(shard_map(lambda s: jax.lax.ppermute(s, "stage", [(0, 1)]), mesh=mesh,
                             in_specs=P("stage"), out_specs=P("stage")))

    def via_device_put(h):
        return jax.device_put(h, d1)

    def via_ppermute(h):
        g = jax.make_array_from_single_device_arrays((2, T, H), gsh, [h[None], dummy])
        out = perm(g)
        return next(s.data for s in out.addressable_shards if s.device == d1)[0]

    res = dict(device=str(d0.device_kind), jax=jax.__version__, producer_ms=ms, producer_matmuls=n,
               hidden=[T, H], dtype=str(jnp.dtype(dt)), methods={})
    ref = None
    for name, hand in (("device_put", via_device_put), ("ppermute", via_ppermute)):
        jax.block_until_ready(consumer(hand(prod(x0, w))))  # compile / warm
        call, enqueue, wall = [], [], []
        for _ in range(a.trials):
            t0 = time.perf_counter()
            h = prod(x0, w)
            t1 = time.perf_counter()
            h1 = hand(h)
            t2 = time.perf_counter()
            y = consumer(h1)
            t3 = time.perf_counter()
            y.block_until_ready()
            t4 = time.perf_counter()
            call.append(t2 - t1), enqueue.append(t3 - t0), wall.append(t4 - t0)
        got = np.asarray(y)
        if ref is None:
            ref = got
        res["methods"][name] = dict(handoff_call_ms=statistics.median(call) * 1e3,
                                    enqueue_ms=statistics.median(enqueue) * 1e3,
                                    wall_ms=statistics.median(wall) * 1e3,
                                    result_on=str(list(h1.devices())[0]),
                                    matches=bool(np.allclose(got, ref, rtol=1e-2, atol=1e-2)))
        print(name, json.dumps(res["methods"][name]), flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    json.dump(res, open(a.out, "w"), indent=1)
    print(f"producer {ms:.2f} ms on {d0}; a hand-off call near {ms:.1f} ms blocks the host")
    return 0 if all(m["matches"] for m in res["methods"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
