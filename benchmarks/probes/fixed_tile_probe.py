"""Batch-invariant mode's fixed-tile matmul (jvllm.ops.fixed_tile_matmul) on a GPU, at the
Llama-3-8B projection shapes: (1) bit equality of every row across token counts M and across the
split and walk launches (the invariance contract, checked on the real Triton lowering rather
than interpret mode), with the error against XLA's float32 dot as a sanity check; (2) ms per call
of the grouped launches (q/k/v, gate/up) against one launch per weight, and of the walk and split
launches against XLA's bf16 dot at prefill sizes. One JSON, rewritten after each group.

    python benchmarks/probes/fixed_tile_probe.py [--ms 1,8,37,256,2048] [--time-ms 1,8,2048]
        [--iters 20] [--tiny] [--out $OUT/fixed_tile_probe.json]

--tiny: small shapes in interpret mode (a CPU smoke test of the probe itself).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time

# name: (K, [N_i], w_transposed)
GROUPS = {"qkv": (4096, (4096, 1024, 1024), False), "o": (4096, (4096,), False),
          "gate_up": (4096, (14336, 14336), False), "down": (14336, (4096,), False),
          "lm_head": (4096, (128256,), True)}
TINY = {"qkv": (2048, (64, 32, 32), False), "lm_head": (128, (200,), True)}


def _time(fn, args, iters):
    import jax

    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(iters):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t)
    return round(statistics.median(ts) * 1e3, 4)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ms", default="1,8,37,256,2048")
    ap.add_argument("--time-ms", default="1,8,2048")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "fixed_tile_probe.json"))
    a = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jvllm.ops import fixed_tile_matmul as ftm

    groups = TINY if a.tiny else GROUPS
    ms = [int(m) for m in a.ms.split(",")]
    time_ms = [int(m) for m in a.time_ms.split(",")]
    if a.tiny:
        ms, time_ms, a.iters = [m for m in ms if m <= 64] or [1, 8, 37], [1, 8], 2
    interpret = True if a.tiny else None
    res = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
           "backend": jax.default_backend(), "ms": ms, "groups": {}}

    def write():
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)

    key = jax.random.PRNGKey(0)
    for name, (K, Ns, tr) in groups.items():
        key, kx, *kws = jax.random.split(key, 2 + len(Ns))
        x = jax.random.normal(kx, (max(ms + time_ms), K), jnp.bfloat16)
        ws = [(jax.random.normal(k, (N, K) if tr else (K, N), jnp.float32) / K ** 0.5).astype(jnp.bfloat16)
              for k, N in zip(kws, Ns)]
        t = ftm.tiles(K, *Ns)
        col_tiles = sum(-(-N // t.bn) for N in Ns)

        def grouped(x, *ws, launch="auto"):
            return ftm.fixed_tile_matmuls(x, ws, w_transposed=tr, interpret=interpret, launch=launch)

        def separate(x, *ws):
            return [ftm.fixed_tile_matmul(x, w, w_transposed=tr, interpret=interpret) for w in ws]

        def xla(x, *ws):
            return [jnp.dot(x, w.T if tr else w, preferred_element_type=jnp.float32).astype(x.dtype) for w in ws]

        fns = {"auto": jax.jit(grouped), "split": jax.jit(lambda x, *w: grouped(x, *w, launch="split")),
               "walk": jax.jit(lambda x, *w: grouped(x, *w, launch="walk")),
               "separate": jax.jit(separate), "xla": jax.jit(xla)}
        g = {"K": K, "Ns": list(Ns), "transposed": tr, "tiles": dataclasses.asdict(t),
             "col_tiles": col_tiles, "launch_by_m": {m: ftm.launch_splits(t, m, col_tiles) for m in ms}}
        res["groups"][name] = g
        full = [np.asarray(o) for o in fns["auto"](x[:max(ms)], *ws)]
        ref = [np.asarray(o) for o in jax.jit(lambda x, *ws: [
            jnp.dot(x.astype(jnp.float32), (w.T if tr else w).astype(jnp.float32),
                    precision=jax.lax.Precision.HIGHEST) for w in ws])(x[:max(ms)], *ws)]
        g["rel_err_vs_f32"] = max(float(np.abs(f.astype(np.float32) - r).max() / np.abs(r).max())
                                  for f, r in zip(full, ref))
        eq = {}
        for m in ms:
            for launch in ("auto", "split", "walk"):
                outs = fns[launch](x[:m], *ws)
                bad = sum(int((np.asarray(o).view(np.uint16) != f[:m].view(np.uint16)).sum())
                          for o, f in zip(outs, full))
                eq[f"m{m}_{launch}"] = bad
        g["unequal_elements_vs_full_auto"] = eq
        g["bit_equal"] = all(v == 0 for v in eq.values())
        write()
        tm = {}
        for m in time_ms:
            for k in ("auto", "split", "walk", "separate", "xla"):
                if k == "separate" and len(Ns) == 1:
                    continue
                tm[f"m{m}_{k}"] = _time(fns[k], (x[:m],) + tuple(ws), a.iters)
        wbytes = sum(w.size * w.dtype.itemsize for w in ws)
        g["ms_per_call"] = tm
        g["weight_GBps_m1_auto"] = round(wbytes / tm[f"m{time_ms[0]}_auto"] / 1e6, 1)
        print(name, "bit_equal", g["bit_equal"], "rel_err", g["rel_err_vs_f32"], tm, flush=True)
        write()
    res["all_bit_equal"] = all(g["bit_equal"] for g in res["groups"].values())
    write()
    print("all_bit_equal", res["all_bit_equal"])
    return 0 if res["all_bit_equal"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
