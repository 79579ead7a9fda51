"""The MoE expert FFN (jvllm.ops.grouped_matmul) alone, per backend and token count, on one
device and, with --devices N, expert parallel over N (per --routings: gather + psum, and
all-to-all) against tensor parallel over N; with --expert-groups G the N devices form a
(G, N/G) ("expert", "tensor") mesh and the experts go over the G groups, their hidden dimension
over the rest ("groups" mode, both routings).

    python benchmarks/probes/moe_grouped_matmul.py [--tokens 1,8,64,256,2048] [--backends xla,pallas,tokamax]
        [--devices 8] [--expert-groups 2] [--routings gather,all_to_all] [--tiny] [--sweep CFGS] [--out $OUT/moe_gmm.json]

Shape: one Qwen3-30B-A3B layer (128 experts, top-8, hidden 2048, expert size 768, bfloat16), or
--tiny (8 experts, top-2, 64 / 32, float32) for a CPU run. Routing is random (each token k distinct
experts). Per case: median ms over --iters calls of the jitted FFN (routing sort, gathers, three
grouped matmuls, combine), the distinct experts the batch touches, and the bandwidth that reading
just those experts' weights once would need at that time (the figure to compare with the device's
peak: a backend that reads every expert, like XLA's dense expansion of ragged_dot on CUDA, shows
up as far below it at small batches).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from probe_timing import median_ms


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="1,8,64,256,2048")
    ap.add_argument("--backends", default="xla,pallas")
    ap.add_argument("--devices", type=int, default=1, help="also EP and TP over this many devices (> 1)")
    ap.add_argument("--expert-groups", type=int, default=1, help="also experts over G groups x hidden over N/G")
    ap.add_argument("--routings", default="gather", help="routings of the expert-parallel modes: gather,all_to_all")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--sweep", default="",
                    help="pallas launch configs to time on the three grouped matmuls alone (gate/up with "
                         "silu, then down, timed apart), e.g. '16x128x64x3x4,64x128x64x3x4' (bm x bn x bk x "
                         "stages x warps; a leading t: the swapped product, e.g. t32x128x128x3x4; GU/DOWN: "
                         "down's own launch, e.g. 64x128x128x3x8/64x64x128x3x4)")
    ap.add_argument("--chain", type=int, default=0, help="sweep: time L chained FFN layers per program (0: per call)")
    ap.add_argument("--rounds", type=int, default=3, help="sweep with --chain: rounds over all configs")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "moe_gmm.json"))
    a = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from jvllm.ops import grouped_matmul as gm

    E, k, D, I, dtype = (8, 2, 64, 32, jnp.float32) if a.tiny else (128, 8, 2048, 768, jnp.bfloat16)
    key = jax.random.split(jax.random.key(0), 3)
    ws = [(jax.random.normal(kk, s, jnp.float32) * 0.02).astype(dtype)
          for kk, s in zip(key, ((E, D, I), (E, D, I), (E, I, D)))]
    itemsize = jnp.dtype(dtype).itemsize
    rng = np.random.default_rng(0)
    routings = a.routings.split(",")
    layouts = []  # (mode, mesh, expert_axes, hidden_axis)
    if a.devices > 1:
        mesh = Mesh(np.asarray(jax.devices()[:a.devices]).reshape(1, a.devices), ("expert", "tensor"))
        layouts += [("expert_parallel", mesh, ("expert", "tensor"), None), ("tensor_parallel", mesh, (), "tensor")]
    if a.expert_groups > 1:
        if a.devices % a.expert_groups:
            raise SystemExit(f"--expert-groups {a.expert_groups} must divide --devices {a.devices}")
        g = Mesh(np.asarray(jax.devices()[:a.devices]).reshape(a.expert_groups, -1), ("expert", "tensor"))
        layouts.append(("groups", g, ("expert",), "tensor"))

    def place(mesh, ex, hid):
        e = ex if len(ex) > 1 else (ex[0] if ex else None)
        col, row = NamedSharding(mesh, P(e, None, hid)), NamedSharding(mesh, P(e, hid, None))
        return [jax.device_put(ws[0], col), jax.device_put(ws[1], col), jax.device_put(ws[2], row)]

    placed = {mode: place(m, ex, hid) for mode, m, ex, hid in layouts}
    rows = []
    for T in (int(t) for t in a.tokens.split(",")):
        x = jnp.asarray(rng.normal(size=(T, D)), dtype)
        idx = jnp.asarray(np.stack([rng.choice(E, k, replace=False) for _ in range(T)]), jnp.int32)
        w = jnp.asarray(rng.random((T, k)), jnp.float32)
        touched = int(len(np.unique(np.asarray(idx))))
        need = touched * 3 * D * I * itemsize
        for b in a.backends.split(","):
            try:
                gm.ragged_dot_fn(b)
            except ImportError as e:
                rows.append(dict(tokens=T, backend=b, mode="one_device", error=str(e)))
                continue
            cases = [("one_device", "-", jax.jit(lambda *z, b=b: gm.moe_ffn(*z, backend=b)), ws)]
            for mode, m, ex, hid in layouts:
                for rt in (routings if ex else ["gather"]):
                    cases.append((mode, rt, jax.jit(lambda *z, b=b, m=m, ex=ex, hid=hid, rt=rt: gm.sharded_ffn(
                        *z, mesh=m, expert_axes=ex, hidden_axis=hid, routing=rt, backend=b)), placed[mode]))
            for mode, rt, fn, wts in cases:
                try:
                    ms = median_ms(fn, (x, idx, w, *wts), a.iters)
                except Exception as e:  # a backend that cannot compile this shape: recorded, not fatal
                    rows.append(dict(tokens=T, backend=b, mode=mode, routing=rt, error=f"{type(e).__name__}: {e}"[:400]))
                    continue
                r = dict(tokens=T, backend=b, mode=mode, routing=rt, ms=ms, experts_touched=touched,
                         touched_weight_gb_s=need / (ms / 1e3) / 1e9)
                rows.append(r)
                print(f"T={T:5d} {b:8s} {mode:16s} {rt:10s} {ms:9.3f} ms  experts {touched:3d}  "
                      f"{r['touched_weight_gb_s']:8.1f} GB/s of touched weights", flush=True)
        if a.sweep:
            rows += sweep(a, T, x, idx, ws, E, k, I, need, dtype, rng,
                          lambda r, done=list(rows): dump(a, E, k, D, I, dtype, done + r, True))
    dump(a, E, k, D, I, dtype, rows, partial=False)
    return 0


def _launch(cfg: str) -> dict:
    """'[t]bm x bn x bk x stages x warps' -> grouped_matmul keywords (t: the swapped product)."""
    bm, bn, bk, st, nw = (int(v) for v in cfg.lstrip("t").split("x"))
    return dict(bm=bm, bn=bn, bk=bk, num_stages=st, num_warps=nw, swap=cfg.startswith("t"))


def sweep(a, T, x, idx, ws, E, k, I, need, dtype, rng, write):
    """Each launch config GU[/DOWN] (gate/up with silu, then down; DOWN defaults to GU's launch),
    against the first config's outputs. Per call (--chain 0): gate/up and down timed apart, each
    its own program. --chain L: one program of L chained FFN layers (each layer's output is the
    next one's input), so dispatch and clock ramps weigh 1/L; --rounds R times every config in turn
    (config-major order would put a drifting clock on one config) and takes each one's median."""
    import statistics

    import jax
    import jax.numpy as jnp

    from jvllm.ops import grouped_matmul as gm
    from jvllm.ops.pallas_grouped_matmul import grouped_matmul
    from probe_timing import median_ms

    order, sizes = gm.sort_by_expert(idx, E)
    xs = x[order // k]
    hs = jnp.asarray(rng.normal(size=(xs.shape[0], I)), dtype)
    progs = {}
    for cfg in a.sweep.split(","):
        gu_cfg, _, dn_cfg = cfg.partition("/")
        kw = _launch(gu_cfg)
        dkw = _launch(dn_cfg) if dn_cfg else kw
        gu = lambda xs, sz, kw=kw: gm.glu(grouped_matmul(xs, ws[0], sz, **kw),  # noqa: E731
                                          grouped_matmul(xs, ws[1], sz, **kw), "silu")
        down = lambda hs, sz, dkw=dkw: grouped_matmul(hs, ws[2], sz, **dkw)  # noqa: E731

        def chain(xs, sz, gu=gu, down=down):
            for _ in range(a.chain):
                xs = (down(gu(xs, sz), sz).astype(jnp.float32) * 0.05).astype(xs.dtype)
            return xs

        progs[cfg] = (jax.jit(gu), jax.jit(down), jax.jit(chain))
    rows, first_out, times = [], None, {cfg: [] for cfg in progs}
    for cfg, (gu, down, chain) in progs.items():
        try:  # with --chain only the chained program (each Pallas program compiles for ~10-20 s on a GPU)
            got = (chain(xs, sizes),) if a.chain else (gu(xs, sizes), down(hs, sizes))
        except Exception as e:
            rows.append(dict(tokens=T, backend="pallas", mode="sweep", config=cfg, error=f"{type(e).__name__}: {e}"[:400]))
            times.pop(cfg)
            continue
        if first_out is None:  # the sweep's first config is the others' reference
            first_out = got
        diff = max(float(jnp.max(jnp.abs(g.astype(jnp.float32) - r.astype(jnp.float32)))) for g, r in zip(got, first_out))
        row = dict(tokens=T, backend="pallas", mode="sweep", config=cfg, max_abs_diff_vs_first=diff)
        if not a.chain:
            row["gate_up_ms"], row["down_ms"] = median_ms(gu, (xs, sizes), a.iters), median_ms(down, (hs, sizes), a.iters)
            row["ms"] = row["gate_up_ms"] + row["down_ms"]
            row["touched_weight_gb_s"] = need / (row["ms"] / 1e3) / 1e9
            print(f"T={T:5d} pallas {cfg:32s} {row['ms']:9.3f} ms (gate/up {row['gate_up_ms']:.3f}, down "
                  f"{row['down_ms']:.3f})  {row['touched_weight_gb_s']:8.1f} GB/s  diff {diff:.3g}", flush=True)
        rows.append(row)
        write(rows)
    if a.chain:
        for _ in range(a.rounds):
            for cfg in times:
                times[cfg].append(median_ms(progs[cfg][2], (xs, sizes), a.iters) / a.chain)
        for row in rows:
            if row.get("config") in times:
                ms = statistics.median(times[row["config"]])
                row.update(ms=ms, chain=a.chain, rounds=[round(t, 4) for t in times[row["config"]]],
                           touched_weight_gb_s=need / (ms / 1e3) / 1e9)
                print(f"T={T:5d} pallas {row['config']:32s} {ms:9.3f} ms a layer ({a.chain} chained, rounds "
                      f"{row['rounds']})  {row['touched_weight_gb_s']:8.1f} GB/s  diff {row['max_abs_diff_vs_first']:.3g}",
                      flush=True)
        write(rows)
    return rows


def dump(a, E, k, D, I, dtype, rows, partial: bool):
    """Write the JSON (after every sweep row too, marked partial: a probe cut off by its time limit
    keeps what it measured)."""
    import jax
    import jax.numpy as jnp

    res = dict(shape=dict(experts=E, top_k=k, hidden=D, expert_size=I, dtype=str(jnp.dtype(dtype))),
               devices=a.devices, expert_groups=a.expert_groups, platform=jax.devices()[0].platform,
               device_kind=jax.devices()[0].device_kind, jax=jax.__version__, partial=partial, rows=rows)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
