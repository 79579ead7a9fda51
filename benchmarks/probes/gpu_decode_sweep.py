"""Decode attention launch/layout sweep on the GPU: jvllm's ragged Pallas kernel at Llama-3-8B
attention shapes (32 heads, 8 KV heads, head_dim 128, bf16) over page size (block_size 16/32/64),
pages per inner step, warps, pipeline stages and `prefetch_ids`, for the W1 decode case (256
decodes at context 800, the step that bounds W1) and B1 (one decode at context 768), plus the
W1-like mixed step (16-token query tiles) at each page size, since the page size is an engine-wide
choice. Every output is checked against the XLA reference (`paged_attention`).

    python benchmarks/probes/gpu_decode_sweep.py [--out $OUT/gpu_decode_sweep.json] [--tiny]

Figures per configuration: median ms over 20 calls (dispatch included), max |err|, KV read GB/s.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: gpu_kernels
from gpu_kernels import D, KH, case_inputs, timeit  # noqa: E402  (same shapes, inputs and timing)

from jvllm.ops.attention import paged_attention  # noqa: E402
from jvllm.ops.pallas_attention import ragged_paged_attention  # noqa: E402


def configs(bs, case, tiny):
    if case == "W1_mixed_2048":
        return [dict(num_warps=4, num_stages=2)]
    if case == "B1_decode_768":
        return [dict(num_warps=4, num_stages=2), dict(num_warps=4, num_stages=3),
                dict(num_warps=4, num_stages=2, prefetch_ids=True)]
    out = []
    # session 4's sweep (h200_gpu_decode_sweep_dcbef8f.json): 1 stage won at 128 keys; now also
    # 256 keys per inner step, 8 and 2 warps at 1 stage
    for chunk in (64, 128, 256):
        for w, s in ((4, 1), (4, 2), (4, 3), (8, 1), (8, 2), (2, 1)):
            out.append(dict(pages_per_block=max(1, chunk // bs), num_warps=w, num_stages=s))
    out += [dict(pages_per_block=max(1, 128 // bs), num_warps=4, num_stages=st, prefetch_ids=True) for st in (1, 2)]
    return out[:2] + out[-1:] if tiny else out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "gpu_decode_sweep.json"))
    ap.add_argument("--tiny", action="store_true", help="CPU dry run: small cases, interpret mode")
    ap.add_argument("--block-sizes", default="16,32,64")
    a = ap.parse_args()
    interp = dict(interpret=True) if a.tiny else {}
    iters = 1 if a.tiny else 20
    rng = np.random.default_rng(0)
    mixed = [(0, 600), (0, 900), (1024, 300)] + [(int(c), 1) for c in rng.integers(300, 1200, 40)]
    cases = {"decode_256x800": ([(799, 1)] * 256, 256, 256, 1),
             "B1_decode_768": ([(767, 1)], 8, 8, 1),
             "W1_mixed_2048": (mixed, 2048, 256, 16)}
    if a.tiny:
        cases = {k: ([(s // 16, max(1, n // 16)) for s, n in sp][:8], max(8, T // 16), 8, Qt)
                 for k, (sp, T, R, Qt) in cases.items()}
    scale = D ** -0.5
    res = dict(device=str(jax.devices()[0].device_kind), jax=jax.__version__, cases={})
    ok = True
    t0 = time.time()
    for bs in [int(b) for b in a.block_sizes.split(",")]:
        for name, (spans, T, R, Qt) in cases.items():
            md, q, kp, vp = case_inputs(spans, T, R, Qt, (256 if a.tiny else 4096) // bs, bs=bs)
            valid = np.asarray(md.positions) >= 0
            ref = jax.jit(lambda q, kp, vp, md: paged_attention(q, kp, vp, md, scale=scale, kv_chunk_blocks=max(1, 256 // bs)))(q, kp, vp, md)
            ref = np.asarray(ref.astype(jnp.float32))[valid]
            kv = sum((s + n) * KH * D * 2 * 2 for s, n in spans)
            cfgs = configs(bs, name, a.tiny)
            for cf in cfgs:
                key = f"{name}/bs{bs}_P{cf.get('pages_per_block', 'auto')}_w{cf['num_warps']}_s{cf['num_stages']}" + \
                      ("_pf" if cf.get("prefetch_ids") else "")
                try:
                    f = jax.jit(lambda q, kp, vp, md, cf=cf: ragged_paged_attention(q, kp, vp, md, scale=scale, **cf, **interp))
                    t, out = timeit(f, q, kp, vp, md, iters=iters)
                    err = float(np.abs(np.asarray(out.astype(jnp.float32))[valid] - ref).max())
                    ok &= err < 0.05
                    res["cases"][key] = dict(ms=t * 1e3, max_abs_err=err, kv_read_GBps=kv / t / 1e9, **cf, block_size=bs)
                except Exception as e:  # one failing configuration must not hide the others
                    res["cases"][key] = dict(error=f"{type(e).__name__}: {str(e)[:400]}", **cf, block_size=bs)
                print(key, {k: round(v, 4) if isinstance(v, float) else v for k, v in res["cases"][key].items()
                            if k in ("ms", "max_abs_err", "kv_read_GBps", "error")}, f"[{time.time() - t0:.0f}s]", flush=True)
                res["all_match_reference"] = ok
                os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
                json.dump(res, open(a.out, "w"), indent=1)  # after every configuration: a time limit keeps what ran
    best = {}
    for k, v in res["cases"].items():
        c = k.split("/")[0]
        if "ms" in v and (c not in best or v["ms"] < res["cases"][best[c]]["ms"]):
            best[c] = k
    print("best:", {c: (k, round(res['cases'][k]['ms'], 4)) for c, k in best.items()})
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
