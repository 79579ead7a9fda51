"""Does an XLA all-reduce across this host's GPUs run (single process, NCCL), and how long does a
TP-decode-sized one take? Each environment variant runs in a child process under a timeout, so a
hang shows as a timeout instead of stopping the caller.

    python benchmarks/probes/gpu_collectives_probe.py [--timeout 40] [--out PATH]

Child: 2+ GPUs on a 1-D mesh; a jitted program does 64 all-reduces of [1, 4096] bf16 (one per
attention and MLP block of a 32-layer TP decode step at batch 1) and reports ms per program and
us per all-reduce (median of 20 calls after warm-up).

Variants ending in `_mp` run one child process per GPU (jax.distributed on 127.0.0.1, as
`jvllm launch` does); the others drive every GPU from one process. `oneshot*` turn on XLA's
one-shot all-reduce kernel, which (XLA source, all_reduce_thunk.cc) needs peer access and is
chosen per clique from its *local* participants, so it may apply to one process only: the
`_mp` variant shows whether it does."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CHILD = r'''
import json, os, time, jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
if os.environ.get("PROBE_NPROC"):
    jax.distributed.initialize(os.environ["PROBE_COORD"], int(os.environ["PROBE_NPROC"]), int(os.environ["PROBE_PID"]))
devs = jax.devices()
n = len(devs)
mesh = Mesh(np.array(devs), ("t",))
def body(x):
    for _ in range(64):
        x = jax.lax.psum(x, "t") * (1.0 / n)
    return x
f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(None, "t"), out_specs=P(None, "t")) if hasattr(jax, "shard_map")
            else __import__("jax.experimental.shard_map", fromlist=["shard_map"]).shard_map(body, mesh=mesh, in_specs=P(None, "t"), out_specs=P(None, "t")))
sh = NamedSharding(mesh, P(None, "t"))
x = jax.make_array_from_callback((1, 4096 * n), sh, lambda i: np.ones((1, 4096 * n), jnp.bfloat16)[i])
y = f(x); y.block_until_ready()
ok = all(bool(np.allclose(np.asarray(s.data, np.float32), 1.0)) for s in y.addressable_shards)
ts = []
for _ in range(20):
    t0 = time.perf_counter(); f(x).block_until_ready(); ts.append(time.perf_counter() - t0)
ms = float(np.median(ts) * 1e3)
print("RESULT " + json.dumps(dict(devices=n, correct=ok, program_ms=ms, allreduce_us=ms * 1e3 / 64)))
'''

ONESHOT = "--xla_gpu_unsupported_use_all_reduce_one_shot_kernel=true"
VARIANTS = {"default": {}, "p2p_disabled": {"NCCL_P2P_DISABLE": "1"}, "cumem_off": {"NCCL_CUMEM_ENABLE": "0"},
            "default_mp": {}, "oneshot": {"XLA_FLAGS": ONESHOT}, "oneshot_mp": {"XLA_FLAGS": ONESHOT},
            "oneshot_cmdbuf": {"XLA_FLAGS": ONESHOT + " --xla_gpu_enable_command_buffer=+COLLECTIVES"},
            "nccl_ll_mp": {"NCCL_PROTO": "LL"}}


def _run(name, env):
    """One child (or, for *_mp, one child per GPU, process 0's result reported)."""
    if not name.endswith("_mp"):
        return [subprocess.Popen([sys.executable, "-c", CHILD], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)]
    n = int(os.environ.get("PROBE_GPUS", "2"))
    port = 29400 + os.getpid() % 500
    return [subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env=dict(env, CUDA_VISIBLE_DEVICES=str(i), PROBE_NPROC=str(n), PROBE_PID=str(i),
                                      PROBE_COORD=f"127.0.0.1:{port}")) for i in range(n)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--timeout", type=float, default=40)
    ap.add_argument("--variants", default="default,default_mp,oneshot,oneshot_mp")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    unknown = [v for v in a.variants.split(",") if v not in VARIANTS]
    if unknown:
        ap.error(f"unknown --variants {unknown}; known: {sorted(VARIANTS)}")
    res = {}
    for name in a.variants.split(","):
        env = dict(os.environ, **VARIANTS[name])
        env.setdefault("NCCL_DEBUG", "WARN")
        procs = _run(name, env)
        outs = []
        for p in procs:
            try:
                outs.append((p.communicate(timeout=a.timeout)[0], p.returncode))
            except subprocess.TimeoutExpired:
                p.kill()
                outs.append(((p.communicate()[0] or "") + f"\n[timeout {a.timeout}s]", None))
        out0, rc0 = outs[0]
        line = [ln for ln in out0.splitlines() if ln.startswith("RESULT ")]
        res[name] = json.loads(line[-1][7:]) if line else dict(rc=rc0, tail=out0[-1500:])
        res[name]["processes"] = len(procs)
        print(name, json.dumps(res[name])[:600], flush=True)
    if a.out:
        json.dump(res, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
