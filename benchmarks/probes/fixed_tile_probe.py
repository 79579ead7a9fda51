"""Batch-invariant mode's fixed-tile matmul (jvllm.ops.fixed_tile_matmul) on a GPU, at the
Llama-3-8B projection shapes: (1) bit equality of every row across token counts M and across the
split and walk launches (the invariance contract, checked on the real Triton lowering rather
than interpret mode), with the error against XLA's float32 dot as a sanity check; (2) ms per call
of the grouped launches (q/k/v, gate/up) against one launch per weight, and of the walk and split
launches against XLA's bf16 dot at prefill sizes; (3) with --sweep, other launch configurations
(row tile bm x column tile cap bn x warps x stages [x split count S], patched into the module as
both launches' shape; S the default's unless given): ms per call and
whether each gives the same bits as the default configuration (does the per-element rounding depend
on the tile shape, i.e. may a configuration be chosen by M?). One JSON, rewritten after each group.

    python benchmarks/probes/fixed_tile_probe.py [--ms 1,8,37,256,2048] [--time-ms 1,8,2048]
        [--sweep 64x128x4x3,128x128x8x3] [--sweep-groups qkv,gate_up,down] [--skip-main]
        [--sweep-launch auto,walk,split] [--iters 20] [--tiny] [--out $OUT/fixed_tile_probe.json]

--sweep-launch: the launches each sweep configuration is timed with (default auto; "walk" and
"split" force one, e.g. to compare 64-row walk and split launches at W1's 256-row decode bucket).

--tiny: small shapes in interpret mode (a CPU smoke test of the probe itself).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os

from probe_timing import median_ms

# name: (K, [N_i], w_transposed)
GROUPS = {"qkv": (4096, (4096, 1024, 1024), False), "o": (4096, (4096,), False),
          "gate_up": (4096, (14336, 14336), False), "down": (14336, (4096,), False),
          "lm_head": (4096, (128256,), True)}
TINY = {"qkv": (2048, (64, 32, 32), False), "lm_head": (128, (200,), True)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ms", default="1,8,37,256,2048")
    ap.add_argument("--time-ms", default="1,8,2048")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--sweep", default="")
    ap.add_argument("--sweep-groups", default="qkv,gate_up,down")
    ap.add_argument("--sweep-launch", default="auto")
    ap.add_argument("--skip-main", action="store_true", help="only the sweep")
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
    for name, (K, Ns, tr) in ({} if a.skip_main else groups).items():
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
                tm[f"m{m}_{k}"] = round(median_ms(fns[k], (x[:m],) + tuple(ws), a.iters), 4)
        wbytes = sum(w.size * w.dtype.itemsize for w in ws)
        g["ms_per_call"] = tm
        g["weight_GBps_m1_auto"] = round(wbytes / tm[f"m{time_ms[0]}_auto"] / 1e6, 1)
        print(name, "bit_equal", g["bit_equal"], "rel_err", g["rel_err_vs_f32"], tm, flush=True)
        write()
    if a.sweep:
        res["sweep"] = _sweep(a, groups, time_ms, interpret, write, res)
    res["all_bit_equal"] = all(g["bit_equal"] for g in res["groups"].values())
    write()
    print("all_bit_equal", res["all_bit_equal"])
    return 0 if res["all_bit_equal"] else 1


def _sweep(a, groups, time_ms, interpret, write, res):
    """Each configuration against the module's default at each M in time_ms: ms per call (auto
    launch) and the number of output elements whose bits differ from the default's."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jvllm.ops import fixed_tile_matmul as ftm

    orig_bm, orig_walk, orig_tiles = ftm.ROW_TILE, ftm.WALK_LAUNCHES, ftm.tiles
    sweep = res.setdefault("sweep", {})
    key = jax.random.PRNGKey(1)
    for name in a.sweep_groups.split(","):
        if name not in groups:
            continue
        K, Ns, tr = groups[name]
        key, kx, *kws = jax.random.split(key, 2 + len(Ns))
        x = jax.random.normal(kx, (max(time_ms), K), jnp.bfloat16)
        ws = [(jax.random.normal(k, (N, K) if tr else (K, N), jnp.float32) / K ** 0.5).astype(jnp.bfloat16)
              for k, N in zip(kws, Ns)]
        base = {}
        rows = sweep.setdefault(name, {})
        S0 = orig_tiles(K, *Ns).splits  # kept unless a configuration names its own
        for cfg in ["default"] + a.sweep.split(","):
            warps = stages = None  # default: each launch's own shape
            if cfg != "default":
                bm, bn, warps, stages, *rest = (int(v) for v in cfg.split("x"))
                S = rest[0] if rest else S0
                # both launches: the split launch's row and column tiles, the only walk shape (the
                # split count the default's, or the configuration's fifth field: the tiles' bn no
                # longer decides it; another S sums in another order, so its bits may differ)
                ftm.ROW_TILE, ftm.WALK_LAUNCHES = bm, (ftm.Launch(bm, bn, warps, stages),)
                ftm.tiles = lambda K, *Ns, S=S, bn=bn: dataclasses.replace(
                    orig_tiles(K, *Ns), bn=ftm._col_tiles(Ns, bn)[0], splits=S)
            try:
                t = ftm.tiles(K, *Ns)
                if (K // t.bk) % t.splits:
                    raise ValueError(f"S={t.splits} does not divide the {K // t.bk} bk steps of K={K}")
                walk = ftm.launch_shape(t, Ns, 2048, 1)  # the walk's shape at a prefill chunk
                row = {"tiles": dataclasses.asdict(t), "walk_launch_m2048": dataclasses.asdict(walk),
                       "walk_row_tile": walk.bm}
                for launch in a.sweep_launch.split(","):
                    fn = jax.jit(lambda x, *w, launch=launch: ftm.fixed_tile_matmuls(
                        x, w, w_transposed=tr, interpret=interpret, num_warps=warps, num_stages=stages, launch=launch))
                    sfx = "" if launch == "auto" else f"_{launch}"
                    for m in time_ms:
                        outs = [np.asarray(o).view(np.uint16) for o in fn(x[:m], *ws)]
                        if cfg == "default" and m not in base:
                            base[m] = outs
                        row[f"m{m}{sfx}_unequal_vs_default"] = sum(int((o != b).sum()) for o, b in zip(outs, base[m]))
                        row[f"m{m}{sfx}_ms"] = round(median_ms(fn, (x[:m],) + tuple(ws), a.iters), 4)
            except Exception as e:  # a configuration Triton refuses (registers, shared memory)
                row = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            finally:
                ftm.ROW_TILE, ftm.WALK_LAUNCHES, ftm.tiles = orig_bm, orig_walk, orig_tiles
            rows[cfg] = row
            print("sweep", name, cfg, row, flush=True)
            write()
    return sweep


if __name__ == "__main__":
    raise SystemExit(main())
