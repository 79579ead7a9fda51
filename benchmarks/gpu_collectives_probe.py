"""Does an XLA all-reduce across this host's GPUs run (single process, NCCL), and how long does a
TP-decode-sized one take? Each environment variant runs in a child process under a timeout, so a
hang shows as a timeout instead of stopping the caller.

    python benchmarks/gpu_collectives_probe.py [--timeout 40] [--out PATH]

Child: 2+ GPUs on a 1-D mesh; a jitted program does 64 all-reduces of [1, 4096] bf16 (one per
attention and MLP block of a 32-layer TP decode step at batch 1) and reports ms per program and
us per all-reduce (median of 20 calls after warm-up)."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CHILD = r'''
import json, time, jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
devs = jax.devices()
n = len(devs)
mesh = Mesh(np.array(devs), ("t",))
def body(x):
    for _ in range(64):
        x = jax.lax.psum(x, "t") * (1.0 / n)
    return x
f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(None, "t"), out_specs=P(None, "t")) if hasattr(jax, "shard_map")
            else __import__("jax.experimental.shard_map", fromlist=["shard_map"]).shard_map(body, mesh=mesh, in_specs=P(None, "t"), out_specs=P(None, "t")))
x = jax.device_put(jnp.ones((1, 4096 * n), jnp.bfloat16), NamedSharding(mesh, P(None, "t")))
y = f(x); y.block_until_ready()
ok = bool(jnp.allclose(y.astype(jnp.float32), 1.0))
ts = []
for _ in range(20):
    t0 = time.perf_counter(); f(x).block_until_ready(); ts.append(time.perf_counter() - t0)
ms = float(np.median(ts) * 1e3)
print("RESULT " + json.dumps(dict(devices=n, correct=ok, program_ms=ms, allreduce_us=ms * 1e3 / 64)))
'''

VARIANTS = {"default": {}, "p2p_disabled": {"NCCL_P2P_DISABLE": "1"}, "cumem_off": {"NCCL_CUMEM_ENABLE": "0"}}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--timeout", type=float, default=40)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    res = {}
    for name in a.variants.split(","):
        env = dict(os.environ, **VARIANTS[name])
        env.setdefault("NCCL_DEBUG", "WARN")
        try:
            p = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=a.timeout)
            line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
            res[name] = json.loads(line[-1][7:]) if line else dict(rc=p.returncode, tail=(p.stdout + p.stderr)[-1500:])
        except subprocess.TimeoutExpired as e:
            res[name] = dict(timeout_s=a.timeout, tail=((e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""))[-800:]
                             + ((e.stderr or b"").decode() if isinstance(e.stderr, bytes) else (e.stderr or ""))[-1500:])
        print(name, json.dumps(res[name])[:600], flush=True)
    if a.out:
        json.dump(res, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
