"""Decode-sized MoE layers: jvllm's direct decode path (`jvllm.ops.pallas_moe_decode`) against the
sorted grouped-matmul path of the same pallas backend, per token count, in one program of L
chained layers (distinct weights per layer, router included) so that a layer's time is its
kernels', not one call's dispatch.

    python benchmarks/probes/moe_decode_probe.py [--tokens 1,2,4,8,16] [--valid 0] [--layers 16]
        [--sweep GU/DN,...] [--tiny] [--out $OUT/moe_decode.json]

Per token count T (with --valid V > 0, only the first V tokens are real: the engine's batch-1 step
is a bucket of 8 with one real token): ms per layer of each path, the touched experts' weight
bytes per second. --sweep times decode launches `bn x bk x warps x stages` for gate_up and down,
e.g. "64x128x4x4/64x128x4x4,32x256x4x4/64x128x4x4". Shape: Qwen3-30B-A3B's layer (128 experts,
top-8, hidden 2048, expert size 768, bfloat16) or --tiny (8 experts, top-2, 64 / 32, float32:
a CPU dry run through the interpreter).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from probe_timing import median_ms


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="1,2,4,8,16")
    ap.add_argument("--valid", type=int, default=0, help="real tokens per step (0: all)")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--sweep", default="")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "moe_decode.json"))
    a = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jvllm.ops import grouped_matmul as gm
    from jvllm.ops import pallas_moe_decode as dec

    E, k, D, I, dtype = (8, 2, 64, 32, jnp.float32) if a.tiny else (128, 8, 2048, 768, jnp.bfloat16)
    L = 2 if a.tiny else a.layers
    keys = jax.random.split(jax.random.key(0), 4 * L)
    layers = [[(jax.random.normal(keys[4 * l + i], s, jnp.float32) * 0.02).astype(dtype)
               for i, s in enumerate(((D, E), (E, D, I), (E, D, I), (E, I, D)))] for l in range(L)]
    itemsize = jnp.dtype(dtype).itemsize

    def stack(ffn):
        # the weights are arguments: closed over, they would be captured as constants (19 GB at
        # the real shape: lowering alone ran past the probe's 120 s limit)
        def f(x, valid, ws):
            for router, wg, wu, wd in ws:
                probs = jax.nn.softmax((x @ router).astype(jnp.float32), axis=-1)
                top_w, top_idx = jax.lax.top_k(probs, k)
                top_w = top_w / jnp.sum(top_w, axis=-1, keepdims=True)
                x = x + ffn(x, top_idx, top_w, wg, wu, wd, valid).astype(x.dtype)
            return x
        return jax.jit(f)

    def sorted_ffn(*z):
        saved, dec.MAX_PAIRS = dec.MAX_PAIRS, 0  # trace-time switch: the sort path of the same backend
        try:
            return gm.moe_ffn(*z, backend="pallas")
        finally:
            dec.MAX_PAIRS = saved

    def decode_ffn(gu=dec.GATE_UP, dn=dec.DOWN):
        def ffn(x, top_idx, top_w, wg, wu, wd, valid):
            pairs = jnp.where(valid[:, None], top_idx, -1).reshape(-1)
            return dec.decode_ffn(x, pairs, top_w, wg, wu, wd, gate_up=gu, down=dn)
        return ffn

    def launch(s):
        bn, bk, nw, st = (int(v) for v in s.split("x"))
        return dec.Launch(bn=bn, bk=bk, num_warps=nw, num_stages=st)

    rows = []
    rng = np.random.default_rng(0)
    for T in (int(t) for t in a.tokens.split(",")):
        V = min(a.valid, T) if a.valid else T
        x = jnp.asarray(rng.normal(size=(T, D)), dtype)
        valid = jnp.asarray(np.arange(T) < V)
        cases = [("sorted", stack(sorted_ffn))]
        if T * k <= 1024:  # the decode path has no pair bound here: the probe finds the crossover
            cases.append(("decode", stack(decode_ffn())))
            for s in filter(None, a.sweep.split(",")):
                gu, dn = s.split("/")
                cases.append((f"decode {s}", stack(decode_ffn(launch(gu), launch(dn)))))
        saved, dec.MAX_PAIRS = dec.MAX_PAIRS, 1024
        try:
            for name, fn in cases:
                try:
                    ms = median_ms(fn, (x, valid, layers), a.iters) / L
                except Exception as e:  # a launch that does not compile: recorded, not fatal
                    rows.append(dict(tokens=T, valid=V, path=name, error=f"{type(e).__name__}: {e}"[:400]))
                    print(f"T={T} {name}: {type(e).__name__}", flush=True)
                    continue
                # bytes of the experts the step touches, estimated as distinct picks of V * k
                # uniform choices (the router's picks on random weights are near uniform)
                touched = E * (1 - (1 - k / E) ** V)
                gbs = touched * 3 * D * I * itemsize / (ms / 1e3) / 1e9
                rows.append(dict(tokens=T, valid=V, path=name, ms_per_layer=ms, touched_weight_gb_s=gbs))
                print(f"T={T:3d} valid={V:3d} {name:34s} {ms * 1e3:8.1f} us/layer  {gbs:8.1f} GB/s", flush=True)
        finally:
            dec.MAX_PAIRS = saved
        dump(a, E, k, D, I, L, dtype, rows)
    return 0


def dump(a, E, k, D, I, L, dtype, rows):
    import jax
    import jax.numpy as jnp

    res = dict(shape=dict(experts=E, top_k=k, hidden=D, expert_size=I, layers=L, dtype=str(jnp.dtype(dtype))),
               platform=jax.devices()[0].platform, device_kind=jax.devices()[0].device_kind,
               jax=jax.__version__, rows=rows)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
