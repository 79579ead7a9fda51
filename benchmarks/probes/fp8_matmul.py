"""The Llama-3-8B projections alone, per token count: ms and effective weight GB/s (weight bytes /
time) of (a) XLA's bf16 dot, (b) XLA's fp8 weight-only dot (jvllm's "xla" backend), (c) the Pallas
weight-streaming kernel (jvllm.ops.pallas_matmul.matmul) at its default launch and over a small
launch sweep, and (d) batch-invariant mode's bf16 fixed-tile matmul (jvllm.ops.fixed_tile_matmul) against XLA's bf16 dot at
larger token counts. One JSON.

    python benchmarks/probes/fp8_matmul.py [--tokens 1,4,8,16,32,64] [--inv-tokens 1,16,64,256,1024,2048]
        [--sweep 64x256x4x4,128x128x4x4,...] [--tiny] [--out $OUT/fp8_matmul.json]

Shapes (K x N): qkv 4096x6144, o 4096x4096, gate_up 4096x28672, down 14336x4096, and the engine's
unfused k/v 4096x1024 and gate/up 4096x14336. Timing: median of --iters calls after a warm call,
each jax.block_until_ready. --tiny: small shapes in interpret mode (a CPU smoke test). Sweep entries
are bn x bk x num_warps x num_stages; split_k is decode_launch's for that bn/bk (the sweep is kept
to a few configs, the compiles dominate).
"""
from __future__ import annotations

import argparse
import json
import os
import time

from probe_timing import median_ms

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096),
          "kv": (4096, 1024), "gate": (4096, 14336)}
TINY = {"qkv": (64, 192), "down": (128, 64)}


def _split(M, K, N, bn, bk):
    from jvllm.ops import fixed_tile_matmul as ftm
    from jvllm.ops import pallas_matmul as pm

    programs, s = -(-M // pm.row_block(M)) * (N // bn), 1
    while s < pm.MAX_SPLIT_K and programs * s < pm.TARGET_PROGRAMS and (K // bk) % (2 * s) == 0:
        s *= 2
    return s


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="1,4,8,16,32,64")
    ap.add_argument("--inv-tokens", default="1,16,64,256,1024,2048")
    ap.add_argument("--sweep", default="64x256x4x4,128x128x4x4,128x256x8x3,32x512x4x4")
    ap.add_argument("--sweep-tokens", default="1,8", help="token counts the launch sweep runs at")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "fp8_matmul.json"))
    a = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from jvllm.ops import fixed_tile_matmul as ftm
    from jvllm.ops import pallas_matmul as pm

    interpret = True if a.tiny else None
    shapes = TINY if a.tiny else SHAPES
    toks = [int(t) for t in a.tokens.split(",")]
    inv_toks = [int(t) for t in a.inv_tokens.split(",")] if a.inv_tokens else []
    sweep = [tuple(int(v) for v in c.split("x")) for c in a.sweep.split(",") if c]
    if a.tiny:
        inv_toks, sweep = [t for t in inv_toks if t <= 64], [(16, 32, 4, 2)]
    xla_bf16 = jax.jit(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype))
    xla_fp8 = jax.jit(pm.reference)
    rows, t0 = [], time.perf_counter()
    for name, (K, N) in shapes.items():
        kw, ks = jax.random.split(jax.random.PRNGKey(K + N))
        wb = (jax.random.normal(kw, (K, N), jnp.float32) * 0.02).astype(jnp.bfloat16)
        w8 = (wb.astype(jnp.float32) * 100).astype(jnp.float8_e4m3fn)
        scale = jnp.full((N,), 0.01, jnp.float32)
        del kw, ks

        def row(kind, M, ms, wbytes, **extra):
            r = dict(shape=name, K=K, N=N, tokens=M, kind=kind, ms=round(ms, 4),
                     weight_gb_s=round(wbytes / ms / 1e6, 1), **extra)
            rows.append(r)
            print(json.dumps(r), flush=True)

        for M in toks:
            x = jax.random.normal(jax.random.PRNGKey(M), (M, K), jnp.float32).astype(jnp.bfloat16)
            row("xla_bf16", M, median_ms(xla_bf16, (x, wb), a.iters), 2 * K * N)
            row("xla_fp8", M, median_ms(xla_fp8, (x, w8, scale), a.iters), K * N)
            L = pm.decode_launch(M, K, N)
            f = jax.jit(lambda x, w, s, L=L: pm.matmul(x, w, s, launch=L, interpret=interpret))
            row("pallas_fp8", M, median_ms(f, (x, w8, scale), a.iters), K * N, launch=str(L))
            if M in [int(t) for t in a.sweep_tokens.split(",")]:
                for bn, bk, warps, stages in sweep:
                    if N % bn or K % bk:
                        continue
                    L = pm.Launch(pm.row_block(M), bn, bk, _split(M, K, N, bn, bk), warps, stages)
                    f = jax.jit(lambda x, w, s, L=L: pm.matmul(x, w, s, launch=L, interpret=interpret))
                    try:
                        row("pallas_fp8_sweep", M, median_ms(f, (x, w8, scale), a.iters), K * N, launch=str(L))
                    except Exception as e:  # a launch Triton refuses (shared memory): record, go on
                        rows.append(dict(shape=name, tokens=M, kind="pallas_fp8_sweep", launch=str(L),
                                         error=f"{type(e).__name__}: {str(e)[:200]}"))
        for M in inv_toks:
            x = jax.random.normal(jax.random.PRNGKey(M), (M, K), jnp.float32).astype(jnp.bfloat16)
            if M not in toks:
                row("xla_bf16", M, median_ms(xla_bf16, (x, wb), a.iters), 2 * K * N)
            f = jax.jit(lambda x, w: ftm.fixed_tile_matmul(x, w, interpret=interpret))
            ms = median_ms(f, (x, wb), a.iters)
            row("pallas_bf16_invariant", M, ms, 2 * K * N, launch=str(ftm.tiles(K, N)),
                tflops=round(2 * M * K * N / ms / 1e9, 1))
        del wb, w8
    out = dict(probe="fp8_matmul", jax=jax.__version__, device=str(jax.devices()[0].device_kind),
               seconds=round(time.perf_counter() - t0, 1), rows=rows)
    with open(a.out, "w") as fh:
        json.dump(out, fh, indent=1)
    print(f"wrote {a.out} ({len(rows)} rows, {out['seconds']} s)")


if __name__ == "__main__":
    main()
