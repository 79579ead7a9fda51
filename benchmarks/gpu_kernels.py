"""Attention kernels on the GPU: correctness against the XLA reference and time, at Llama-3-8B
attention shapes (32 heads, 8 KV heads, head_dim 128, 16-token pages, bf16).

    python benchmarks/gpu_kernels.py [--out $OUT/gpu_kernels.json] [--quick]

Cases: P1 (one 2048-token prefill), a W1-like mixed step (prefills, a continuation chunk and
decodes in one 2048-token batch), 256 decodes at context 800 (the end of W1), B1 (one decode at
context 768). Kernels: XLA tiles (`paged_attention`, the reference), jvllm's ragged Pallas kernel
(several launch configurations) and, for decode-only batches, JAX's Pallas paged-attention kernel.
Figures per kernel: median ms over repeated calls, max |err| vs the reference (bf16), and the
effective rate (causal TFLOP/s for prefill-heavy cases, KV read GB/s for decode cases).
Exits 1 when a kernel disagrees with the reference (max |err| > 0.05).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jvllm.ops.attention import example_metadata, paged_attention, pallas_decode_attention
from jvllm.ops.pallas_attention import ragged_paged_attention

H, KH, D, BS = 32, 8, 128, 16
ITERS = 0


def timeit(fn, *args, iters=20):
    iters = ITERS or iters
    out = fn(*args)
    jax.block_until_ready(out)
    ts = []
    for _ in range(iters):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t)
    return statistics.median(ts), out


def case_inputs(spans, T, R, Qt, W, seed=0, bs=BS):
    """Metadata, q and bf16 page pools for `spans` ((start, n) per request) with `bs`-token pages
    and block tables `W` wide (pages of a request scattered at random; 64 spare pages)."""
    need = sum(-(-(s + n) // bs) for s, n in spans)
    NB = need + 64
    md = example_metadata(spans, T=T, R=R, query_tile=Qt, block_size=bs, table_width=W, num_blocks=NB, seed=seed)
    md = jax.tree_util.tree_map(jnp.asarray, md)
    k = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(k[0], (T, H, D), jnp.bfloat16)
    kp = jax.random.normal(k[1], (KH, NB, bs, D), jnp.bfloat16)
    vp = jax.random.normal(k[2], (KH, NB, bs, D), jnp.bfloat16)
    return md, q, kp, vp


def causal_flops(spans):
    # QK^T and PV over the visible keys of every query: 4 * D * H per (query, key) pair
    return sum(4 * D * H * sum(s + i + 1 for i in range(n)) for s, n in spans)


def kv_bytes(spans):
    return sum((s + n) * KH * D * 2 * 2 for s, n in spans)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "gpu_kernels.json"))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--tiny", action="store_true", help="CPU dry run: small cases, Pallas interpret mode")
    a = ap.parse_args()
    interp = dict(interpret=True) if a.tiny else {}
    global ITERS
    ITERS = 1 if a.tiny else 0
    rng = np.random.default_rng(0)
    W = 256  # table width of max_model_len 4096
    mixed = [(0, 600), (0, 900), (1024, 300)] + [(int(c), 1) for c in rng.integers(300, 1200, 40)]
    cases = {
        "P1_prefill_2048": dict(spans=[(0, 2048)], T=2048, R=256, decode=False),
        "W1_mixed_2048": dict(spans=mixed, T=2048, R=256, decode=False),
        "decode_256x800": dict(spans=[(799, 1)] * 256, T=256, R=256, decode=True),
        "B1_decode_768": dict(spans=[(767, 1)], T=8, R=8, decode=True),
    }
    configs = [dict(pages_per_block=8, num_warps=4, num_stages=2), dict(pages_per_block=8, num_warps=8, num_stages=2),
               dict(pages_per_block=4, num_warps=4, num_stages=2), dict(pages_per_block=8, num_warps=4, num_stages=3)]
    if a.quick or a.tiny:
        configs = configs[:1]
    if a.tiny:
        cases = {k: dict(v, spans=[(s // 16, max(1, n // 16)) for s, n in v["spans"]][:8], T=max(8, v["T"] // 16),
                         R=8)
                 for k, v in cases.items()}
    results = dict(device=str(jax.devices()[0].device_kind), jax=jax.__version__, cases={})
    ok = True
    scale = D ** -0.5
    for name, c in cases.items():
        res = {}
        tiles = [1] if c["decode"] else [16, 32]
        for Qt in tiles:
            md, q, kp, vp = case_inputs(c["spans"], c["T"], c["R"], Qt, W)
            valid = np.asarray(md.positions) >= 0
            ref_fn = jax.jit(lambda q, kp, vp, md: paged_attention(q, kp, vp, md, scale=scale, kv_chunk_blocks=16))
            t_ref, ref = timeit(ref_fn, q, kp, vp, md)
            ref = np.asarray(ref.astype(jnp.float32))[valid]
            res[f"xla_Qt{Qt}"] = dict(ms=t_ref * 1e3)
            kernels = {f"ragged_Qt{Qt}_P{cf['pages_per_block']}_w{cf['num_warps']}_s{cf['num_stages']}":
                       (lambda cf: lambda q, kp, vp, md: ragged_paged_attention(q, kp, vp, md, scale=scale, **cf, **interp))(cf)
                       for cf in configs}
            if c["decode"]:
                kernels["ragged_split_auto"] = lambda q, kp, vp, md: ragged_paged_attention(
                    q, kp, vp, md, scale=scale, num_splits="auto", **interp)
                kernels["jax_pallas_decode"] = lambda q, kp, vp, md: pallas_decode_attention(q, kp, vp, md, scale=scale, **interp)
            for kname, f in kernels.items():
                try:
                    t, out = timeit(jax.jit(f), q, kp, vp, md)
                    err = float(np.abs(np.asarray(out.astype(jnp.float32))[valid] - ref).max())
                    res[kname] = dict(ms=t * 1e3, max_abs_err=err)
                    ok &= err < 0.05
                except Exception as e:  # report and go on: one failing config must not hide the others
                    res[kname] = dict(error=f"{type(e).__name__}: {str(e)[:800]}")
                    ok = False
        for v in res.values():
            if "ms" in v:
                v["causal_tflops"] = causal_flops(c["spans"]) / (v["ms"] * 1e-3) / 1e12
                v["kv_read_GBps"] = kv_bytes(c["spans"]) / (v["ms"] * 1e-3) / 1e9
        results["cases"][name] = res
        print(name, json.dumps({k: {kk: round(vv, 4) if isinstance(vv, float) else vv for kk, vv in v.items()}
                                for k, v in res.items()}), flush=True)
    results["all_match_reference"] = ok
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(results, f, indent=1)
    print("kernels match the XLA reference:", ok)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
