"""The ragged kernel's tiles of several queries, with q and the output in token rows
(`ragged_paged_attention(token_rows=True)`) against the gathered tile layout (XLA gathers q
into padded [tiles, KH, Qt*G, D] tiles and scatters the result back), per step shape.

    python benchmarks/probes/attention_token_rows.py [--layers 32] [--iters 20] [--tiny] [--out $OUT/attn_rows.json]

Shapes (Llama-3-8B heads, bfloat16, 16-token pages, query tile 16): "decode256" = 256 requests of
one new token each at contexts 256..767 (the W1 decode bucket as batch-invariant mode runs it:
one token per 16-query tile), "mixed" = 8 requests of 224 new tokens after 512 cached plus 192
one-token decodes (2048 tokens), "prefill2048" = one 2048-token prompt. Per shape and path: the
median ms of one program of `--layers` chained attention calls (each call's output is the next
one's q, so the layout copies cannot be hoisted), and whether the two paths' outputs are
bit-equal. --tiny: small float32 shapes for a CPU run (interpret mode; the figures mean nothing).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from probe_timing import median_ms


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "attn_rows.json"))
    a = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jvllm.ops.attention import example_metadata
    from jvllm.ops.pallas_attention import ragged_paged_attention

    if a.tiny:
        H, KH, D, bs, Qt, dtype, NB = 8, 2, 32, 4, 8, jnp.float32, 400
        shapes = {"decode16": ([(40 + i, 1) for i in range(16)], 16, 16),
                  "prefill64": ([(0, 64)], 64, 1)}
    else:
        H, KH, D, bs, Qt, dtype, NB = 32, 8, 128, 16, 16, jnp.bfloat16, 12000
        shapes = {"decode256": ([(256 + 2 * i, 1) for i in range(256)], 256, 256),
                  "mixed": ([(512, 224)] * 8 + [(300 + i, 1) for i in range(192)], 2048, 256),
                  "prefill2048": ([(0, 2048)], 2048, 1)}
    interpret = jax.default_backend() != "gpu"
    rng = np.random.default_rng(0)
    kp = jnp.asarray(rng.standard_normal((KH, NB, bs, D)), dtype)
    vp = jnp.asarray(rng.standard_normal((KH, NB, bs, D)), dtype)
    rows = []
    for name, (spans, T, R) in shapes.items():
        W = -(-max(s + n for s, n in spans) // bs)
        W = -(-W // 8) * 8
        md = example_metadata(spans, T=T, R=R, query_tile=Qt, block_size=bs, table_width=W, num_blocks=NB)
        md = jax.tree.map(jnp.asarray, md)
        q = jnp.asarray(rng.standard_normal((T, H, D)), dtype)
        outs = {}
        for tr in (False, True):
            def chain(q, kp, vp, md, tr=tr):
                for _ in range(a.layers):
                    q = ragged_paged_attention(q, kp, vp, md, scale=D ** -0.5, token_rows=tr, interpret=interpret)
                return q

            f = jax.jit(chain)
            ms = median_ms(f, (q, kp, vp, md), a.iters)
            outs[tr] = np.asarray(f(q, kp, vp, md).astype(jnp.float32))
            rows.append(dict(shape=name, tokens=T, token_rows=tr, layers=a.layers, ms=ms, ms_per_layer=ms / a.layers))
            print(f"{name:12s} token_rows={tr!s:5s} {ms:8.3f} ms  {1e3 * ms / a.layers:7.1f} us/layer", flush=True)
        valid = np.asarray(md.positions) >= 0
        same = bool(np.array_equal(outs[True][valid], outs[False][valid]))
        rows[-1]["bit_equal_to_gathered"] = rows[-2]["bit_equal_to_gathered"] = same
        print(f"{name:12s} bit-equal: {same}", flush=True)
    res = dict(heads=H, kv_heads=KH, head_dim=D, block_size=bs, query_tile=Qt, dtype=str(jnp.dtype(dtype)),
               platform=jax.devices()[0].platform, device_kind=jax.devices()[0].device_kind, jax=jax.__version__,
               jvllm_git=os.environ.get("JVLLM_GIT_COMMIT"), rows=rows)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as fh:
        json.dump(res, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
