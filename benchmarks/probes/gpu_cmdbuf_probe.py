"""Does XLA's host cost of launching a program depend on whether its buffers moved?

XLA runs a GPU program's kernels as command buffers (CUDA graphs) and, before each launch,
re-records a command buffer whose referenced allocations (parameters, outputs, temps) changed
address since the last launch. The engine's step program gets new input and output buffers every
step, so every launch is an update. This probe times the host side of launching one program of
`--layers` small matmul + norm layers (B1-like: 16 rows) in four ways:

  moving     each call's input is the previous call's output (new buffers in and out: the engine)
  same_in    the same input array every call, outputs new
  stable     the same input, and the output written into a donated buffer (aliased: same address)
  stable_2   as stable, with the input refreshed by a small program writing into a donated buffer

    python benchmarks/probes/gpu_cmdbuf_probe.py [--layers 32] [--width 2048] [--calls 300] [--out probe.json]

JSON: per mode, host microseconds per call (each call timed alone, on an idle device: back to back
the in-flight limit makes the host wait for the device) and wall microseconds per call back to back.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))  # the repository root


def main(argv=None):
    import jax
    import jax.numpy as jnp
    import numpy as np

    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--extra-ops", type=int, default=0)
    ap.add_argument("--out", default="cmdbuf_probe.json")
    a = ap.parse_args(argv)
    D, L, R = a.width, a.layers, a.rows
    key = jax.random.PRNGKey(0)
    ws = [jax.random.normal(jax.random.fold_in(key, i), (D, D), jnp.bfloat16) * 0.02 for i in range(L)]

    def body(ws, x):
        for w in ws:
            h = x.astype(jnp.float32)
            h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + 1e-5)
            y = h.astype(jnp.bfloat16) @ w
            for _ in range(a.extra_ops):  # more small kernels per layer (the engine has ~20)
                y = jnp.tanh(y) + jnp.cumsum(y[:, :8], axis=-1).sum(-1, keepdims=True).astype(y.dtype)
            x = x + jnp.tanh(y)
        return x

    f_move = jax.jit(body)

    def body_out(ws, x, out):
        return out.at[...].set(body(ws, x))

    f_stable = jax.jit(body_out, donate_argnums=(2,))
    refresh = jax.jit(lambda buf, new: buf.at[...].set(new), donate_argnums=(0,))

    x0 = jnp.ones((R, D), jnp.bfloat16)
    res = {}

    def timed(name, step):
        for _ in range(20):
            step()
        jax.block_until_ready(state["last"])
        host = []
        for _ in range(a.calls):  # one call at a time on an idle device: the launch's own host cost
            t = time.perf_counter()
            step()
            host.append(time.perf_counter() - t)
            jax.block_until_ready(state["last"])
        t0 = time.perf_counter()
        for _ in range(a.calls):  # back to back (PjRt bounds the calls in flight, so host waits show here)
            step()
        jax.block_until_ready(state["last"])
        wall = (time.perf_counter() - t0) / a.calls
        res[name] = dict(host_us_median=1e6 * float(np.median(host)), host_us_mean=1e6 * float(np.mean(host)),
                         wall_us_per_call=1e6 * wall)
        print(name, {k: round(v, 1) for k, v in res[name].items()}, flush=True)

    state = dict(x=x0, out=jnp.zeros((R, D), jnp.bfloat16), last=x0, buf=jnp.zeros((R, D), jnp.bfloat16))

    def moving():
        state["x"] = state["last"] = f_move(ws, state["x"])

    def same_in():
        state["last"] = f_move(ws, x0)

    def stable():
        state["out"] = state["last"] = f_stable(ws, x0, state["out"])

    new_in = [jnp.full((R, D), i, jnp.bfloat16) for i in range(2)]
    it = [0]

    def stable_2():
        it[0] += 1
        state["buf"] = refresh(state["buf"], new_in[it[0] % 2])
        state["out"] = state["last"] = f_stable(ws, state["buf"], state["out"])

    for name, fn in [("moving", moving), ("same_in", same_in), ("stable", stable), ("stable_2", stable_2),
                     ("moving_again", moving)]:
        timed(name, fn)
    from jvllm import bench

    json.dump(dict(layers=L, width=D, rows=R, extra_ops=a.extra_ops, calls=a.calls, device=bench.device_info(), versions=bench.versions(),
                   xla_flags=os.environ.get("XLA_FLAGS", ""), results=res), open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
