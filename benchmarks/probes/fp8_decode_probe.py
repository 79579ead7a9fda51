"""Which weight-streaming kernel reads fp8 weights fastest at decode sizes? The Llama-3-8B
projections, L distinct weights per shape called back to back inside one jitted program (as the
model's unrolled layers are, so the per-call dispatch is amortized over L and no weight sits in
L2 from the call before), per token count: device ms per projection and weight GB/s of

- xla_bf16 / xla_fp8: XLA's bf16 dot, and its fp8 weight-only dot (jvllm's "xla" backend);
- pm: `jvllm.ops.pallas_matmul.matmul` on the [N, K] weight (jvllm's "pallas" backend; the
  sweeps below were run against its earlier [K, N] kernel, replaced by the winner: nk, cvt16);
- ft_bf16: batch-invariant mode's bf16 fixed-tile kernel (a calibration: the bf16 kernel that
  session 12's trace saw at 3.2-3.9 TB/s);
- cand: one experimental kernel (below) over --cands: the weight stored [K, N] ("kn") or [N, K]
  ("nk", HF's [out, in]), the dot swapped or not (swap: the weight tile is the dot's left operand,
  out^T = w^T x^T, so the converted weight stays in registers and the few activation rows are the
  narrow side), row tile bm, column tile bn, K step bk, split count S, warps, stages.

Every kernel's output is checked against the float32 product (rel_err). One JSON, rewritten after
every shape.

    python benchmarks/probes/fp8_decode_probe.py [--tokens 1,8] [--layers 16] [--iters 10]
        [--cands kn:0:16:128:64:8:4:3,nk:1:16:128:128:8:4:3,...] [--shapes gate_up,qkv,down,o]
        [--chain] [--tiny] [--out $OUT/fp8_decode_probe.json]

A cand is layout:swap:bm:bn:bk:S:warps:stages[:conv[:pf[:epi]]] (conv: bf16 (default), cvt16,
bits16, a8, fma, tf32; pf: prefetch depth, default 0; epi: the scales and the cast inside the
kernel, S 1; see cand_matmul; S 0: the smallest power of two reaching TARGET_PROGRAMS programs
with >= MIN_STEPS K steps a split). Without --chain every layer reads the same x and only one
element of each output is used, so XLA drops most of a launch's prologue and epilogue kernels
(the per-row float16 scaling, the split sum): the kernel alone is timed. --chain feeds each
layer's whole output into the next layer's x, so those kernels run on the critical path as in
the model's decode step. --tiny: small shapes in interpret mode (a CPU
smoke test of the probe).
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import time

from probe_timing import median_ms

SHAPES = {"gate_up": (4096, 28672), "qkv": (4096, 6144), "down": (14336, 4096), "o": (4096, 4096)}
TINY = {"qkv": (256, 192), "down": (512, 64)}
# The first sweep (h200_fp8_decode_probe_b2230c9.json) tried swapped dots and more tiles in bf16;
# every fp8 kernel then took about bf16's time: the conversion, not the bytes, bounded them.
# The second (h200_fp8_decode_probe_f16_b2230c9.json) tried float16 conversions: little gain.
# Same time per K step whatever the bytes: the converted tile's load is not pipelined.
# The third (h200_fp8_decode_probe_prefetch_b2230c9.json): register prefetch loses; the [N, K]
# layout with a float16 cast won (gate_up 2.25 TB/s at 8 tokens).
# The fourth (h200_fp8_decode_probe_a8_b2230c9.json): an fp8 x fp8 dot (W8A8) no faster than the
# [N, K] float16 cast; the best reach about 2.3 TB/s in this harness at 8 tokens.
CANDS = ("nk:0:16:128:256:0:4:3:cvt16,kn:0:8:128:16:0:4:3:fma,kn:0:8:128:32:0:4:3:fma,kn:0:8:256:16:0:4:3:fma,"
         "kn:0:8:256:16:0:8:3:fma,kn:0:8:128:16:0:8:3:fma,kn:0:4:128:32:0:4:3:fma,kn:0:8:512:8:0:8:3:fma,"
         "nk:0:8:128:32:0:4:3:fma")
TARGET_PROGRAMS = 256  # S=0 ("auto"): the smallest power of two S giving this many programs
MIN_STEPS = 4  # ... as far as each split keeps this many bk steps


def _to_f16_bits(b):
    """float8_e4m3fn -> float16 by integer ops only: the sign to bit 15, exponent and mantissa
    shifted into place; the result is the fp8 value times 2**-8 exactly (biases 7 and 15),
    subnormals included."""
    import jax.numpy as jnp
    from jax import lax

    u = lax.bitcast_convert_type(b, jnp.uint8).astype(jnp.uint16)
    h = ((u & jnp.uint16(0x80)) << jnp.uint16(8)) | ((u & jnp.uint16(0x7F)) << jnp.uint16(7))
    return lax.bitcast_convert_type(h, jnp.float16)


def _kernel(x_ref, w_ref, *refs, M, bm, bn, bk, nk, nk_layout, swap, conv, pf, epi):
    from jax import lax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    (post_ref, o_ref) = refs if epi else (None, refs[0])
    m0, n0, s = pl.program_id(0) * bm, pl.program_id(1) * bn, pl.program_id(2)
    xmask = (m0 + lax.broadcasted_iota(jnp.int32, (bm, bk), 0)) < M
    dims = lambda lc, rc: (((lc,), (rc,)), ((), ()))  # noqa: E731
    k_of = lambda kk: pl.multiple_of((s * nk + kk) * bk, bk)  # noqa: E731

    def raw(kk):  # the fp8 weight tile of step kk: [bn, bk] (nk layout) or [bk, bn]
        k0 = k_of(kk)
        return w_ref[pl.ds(n0, bn), pl.ds(k0, bk)] if nk_layout else w_ref[pl.ds(k0, bk), pl.ds(n0, bn)]

    def step(kk, braw, acc):
        xw = x_ref.at[pl.ds(m0, bm), pl.ds(k_of(kk), bk)]
        if conv == "fma":  # no tensor cores: products in float32 registers, summed over the K step
            a = plgpu.load(xw, mask=xmask, other=0).astype(jnp.float32)
            b = braw.astype(jnp.float32)
            if nk_layout:
                return acc + jnp.sum(a[:, None, :] * b[None, :, :], axis=2)
            return acc + jnp.sum(a[:, :, None] * b[None, :, :], axis=1)
        a = xw[...] if conv == "a8" else plgpu.load(xw, mask=xmask, other=0)  # a8: x padded to bm rows
        if conv == "tf32":  # exact in TF32: bf16's 8 and e4m3's 4 significant bits fit its 11
            a = a.astype(jnp.float32)
        b = _to_f16_bits(braw) if conv == "bits16" else braw if conv == "a8" else braw.astype(a.dtype)
        if nk_layout:
            d = (lax.dot_general(b, a, dims(1, 1), preferred_element_type=jnp.float32) if swap
                 else lax.dot_general(a, b, dims(1, 1), preferred_element_type=jnp.float32))
        else:
            d = (lax.dot_general(b, a, dims(0, 1), preferred_element_type=jnp.float32) if swap
                 else jnp.dot(a, b, preferred_element_type=jnp.float32))
        return acc + d

    acc0 = jnp.zeros((bn, bm) if swap else (bm, bn), jnp.float32)
    if pf == 0:
        acc = lax.fori_loop(0, nk, lambda kk, acc: step(kk, raw(kk), acc), acc0)
    else:  # register prefetch: the tiles of the next pf steps are loaded before this step's dot
        def body(kk, carry):
            acc, *bufs = carry
            nxt = raw(jnp.minimum(kk + pf, nk - 1))
            return (step(kk, bufs[0], acc), *bufs[1:], nxt)

        acc = lax.fori_loop(0, nk, body, (acc0, *[raw(min(i, nk - 1)) for i in range(pf)]))[0]
    if swap:
        acc = acc.T
    rows = m0 + lax.broadcasted_iota(jnp.int32, (bm, bn), 0)
    if epi:  # S == 1: the scales and the cast here, the kernel's output is the projection's
        acc = (acc * post_ref[:, pl.ds(n0, bn)]).astype(o_ref.dtype)  # post [1, N]: the channel scales
    plgpu.store(o_ref.at[pl.ds(m0, bm), pl.ds(n0, bn)], acc, mask=rows < M)


def splits(M, K, N, bm, bn, bk, S):
    """S, or for S == 0 the module docstring's automatic split count."""
    if S:
        return S
    S = 1
    while -(-M // bm) * (N // bn) * S < TARGET_PROGRAMS and (K // bk) % (2 * S) == 0 and K // bk // (2 * S) >= MIN_STEPS:
        S *= 2
    return S


def cand_matmul(x, w, scale, *, layout, swap, bm, bn, bk, S, warps, stages, conv, pf, interpret, epi=False):
    """x [M, K] @ fp8 w ([K, N] or [N, K]) * scale [N] -> x.dtype: S float32 partials [S, M, N]
    stored by the kernel, summed and scaled by XLA. conv "bf16": the weight tile converted to x's
    dtype; "cvt16" / "bits16": x scaled per row by a power of two into float16 (exact for bf16
    values: its 8 significant bits fit, |x / rs| <= 256) and the weight converted to float16 by
    a cast / by `_to_f16_bits`, the row scale (and 2**8) applied to the float32 result; "a8": x
    quantized per row to float8_e4m3fn (absmax / 448, W8A8), an fp8 x fp8 dot; "fma": no dot,
    float32 multiply-adds (bm may be below 16); "tf32": x and the weight tile converted to float32
    in registers, a TF32 dot (exact for these inputs), no row scale. pf: register prefetch depth
    (0: none). epi (S must be 1; conv bf16, tf32 or fma: no row scale): the kernel multiplies by the
    channel scales and stores x.dtype itself, no XLA kernel after it."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    M, K = x.shape
    out_dtype = x.dtype
    N = w.shape[0] if layout == "nk" else w.shape[1]
    S = splits(M, K, N, bm, bn, bk, S)
    if N % bn or K % (bk * S) or (epi and (S != 1 or conv not in ("bf16", "tf32", "fma"))):
        raise ValueError(f"cand bn={bn} bk={bk} S={S} epi={epi} does not tile K={K} N={N}")
    kern = functools.partial(_kernel, M=M, bm=bm, bn=bn, bk=bk, nk=K // (bk * S), nk_layout=layout == "nk",
                             swap=swap, conv=conv, pf=pf, epi=epi)
    post = scale
    if conv == "a8":
        amax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=1, keepdims=True)
        rs = jnp.maximum(amax, 1e-12) / 448.0
        x = jnp.clip(x.astype(jnp.float32) / rs, -448.0, 448.0).astype(jnp.float8_e4m3fn)
        x = jnp.pad(x, ((0, -M % bm), (0, 0)))  # Triton cannot fill a masked fp8 load
        post = scale * rs
    elif conv not in ("bf16", "tf32"):
        amax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=1, keepdims=True)
        rs = jnp.exp2(jnp.ceil(jnp.log2(jnp.maximum(amax, 1e-30))) - 8)
        x = (x.astype(jnp.float32) / rs).astype(jnp.float16)
        post = scale * rs * (256.0 if conv == "bits16" else 1.0)
    full = lambda shape: pl.BlockSpec(shape, lambda i, j, s: (0,) * len(shape))  # noqa: E731
    out = pl.pallas_call(
        kern, grid=(-(-M // bm), N // bn, S),
        in_specs=[full(x.shape), full(w.shape)] + ([full((1, N))] if epi else []),
        out_specs=full((M, N)) if epi else pl.BlockSpec((pl.squeezed, M, N), lambda i, j, s: (s, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((M, N), out_dtype) if epi else jax.ShapeDtypeStruct((S, M, N), jnp.float32),
        interpret=interpret, compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=stages),
        name=f"probe_fp8_{layout}_sw{int(swap)}_bm{bm}_bn{bn}_bk{bk}_s{S}_{conv}{'_epi' if epi else ''}",
    )(x, w, *([post.reshape(1, N).astype(jnp.float32)] if epi else []))
    return out if epi else (jnp.sum(out, axis=0) * post).astype(out_dtype)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="1,8")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--cands", default=CANDS)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--chain", action="store_true")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "fp8_decode_probe.json"))
    a = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jvllm.ops import fixed_tile_matmul as ftm
    from jvllm.ops import pallas_matmul as pm

    interpret = True if a.tiny else None
    shapes = TINY if a.tiny else {k: SHAPES[k] for k in a.shapes.split(",")}
    L = 2 if a.tiny else a.layers
    iters = 2 if a.tiny else a.iters
    toks = [int(t) for t in a.tokens.split(",")]
    cands = []
    for c in a.cands.split(","):
        lay, sw, bm, bn, bk, S, wa, st, *rest = c.split(":")
        cands.append(dict(layout=lay, swap=sw == "1", bm=int(bm), bn=int(bn), bk=int(bk), S=int(S), warps=int(wa),
                          stages=int(st), conv=rest[0] if rest else "bf16", pf=int(rest[1]) if len(rest) > 1 else 0,
                          epi=len(rest) > 2 and rest[2] == "epi"))
    if a.tiny:
        cands = [dict(c, bn=min(c["bn"], 64), bk=min(c["bk"], 64)) for c in cands[:3] + cands[8:9]] + [
            dict(layout="nk", swap=False, bm=16, bn=32, bk=64, S=1, warps=4, stages=3, conv="tf32", pf=0, epi=True)]
    res = dict(probe="fp8_decode", jax=jax.__version__, device=str(jax.devices()[0].device_kind), layers=L,
               chain=a.chain, rows=[])
    t0 = time.perf_counter()

    def layered(f):  # f(x, w_l, s_l) for each of the L weights, one program; a scalar out of each
        return jax.jit(lambda x, ws, ss: jnp.stack([f(x, w, s)[-1, -1].astype(jnp.float32)
                                                    for w, s in zip(ws, ss)]))

    def chained(f):  # --chain: layer l's whole output feeds layer l+1's x, as in the model
        def run(x, ws, ss):
            K = x.shape[1]
            for w, s in zip(ws, ss):
                y = f(x, w, s)
                y = y[:, :K] if y.shape[1] >= K else jnp.pad(y, ((0, 0), (0, K - y.shape[1])))
                x = (x.astype(jnp.float32) + y.astype(jnp.float32) * 2.0 ** -10).astype(x.dtype)
            return x
        return jax.jit(run)

    timed = chained if a.chain else layered

    for name, (K, N) in shapes.items():
        keys = jax.random.split(jax.random.PRNGKey(K * 7 + N), L)
        wf = [jax.random.normal(k, (K, N), jnp.float32) * 0.02 for k in keys]
        amax = [jnp.max(jnp.abs(w), axis=0) for w in wf]
        sc = [m / 448.0 for m in amax]
        w8 = [(w / s).astype(jnp.float8_e4m3fn) for w, s in zip(wf, sc)]
        w8t = [w.T for w in w8]  # [N, K], materialized
        wb = [w.astype(jnp.bfloat16) for w in wf]
        del wf
        ones = [jnp.ones((N,), jnp.float32)] * L
        for M in toks:
            x = (jax.random.normal(jax.random.PRNGKey(M), (M, K), jnp.float32)).astype(jnp.bfloat16)
            want = np.asarray(jnp.dot(x.astype(jnp.float32), w8[0].astype(jnp.float32) * sc[0]))
            tol = np.abs(want).max()

            def row(kind, fn, ws, ss, wbytes, **extra):
                r = dict(shape=name, K=K, N=N, tokens=M, kind=kind, **extra)
                try:
                    y = np.asarray(jax.jit(fn)(x, ws[0], ss[0]).astype(jnp.float32))
                    r["rel_err"] = float(np.abs(y - (np.asarray(jnp.dot(x.astype(jnp.float32), wb[0].astype(
                        jnp.float32))) if kind in ("xla_bf16", "ft_bf16") else want)).max() / tol)
                    ms = median_ms(timed(fn), (x, ws, ss), iters) / L
                    r.update(ms=round(ms, 4), weight_gb_s=round(wbytes / ms / 1e6, 1))
                except Exception as e:  # a launch Triton refuses: record it, go on
                    r["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                res["rows"].append(r)
                print(json.dumps(r), flush=True)

            row("xla_bf16", lambda x, w, s: jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype),
                wb, ones, 2 * K * N)
            row("xla_fp8", lambda x, w, s: (jnp.dot(x, w.astype(x.dtype), preferred_element_type=jnp.float32) * s
                                            ).astype(x.dtype), w8, sc, K * N)  # the "xla" backend's [K, N] dot
            row("pm", lambda x, w, s: pm.matmul(x, w, s, interpret=interpret), w8t, sc, K * N,
                launch=str(pm.tiles(M, K, [N])))
            row("ft_bf16", lambda x, w, s: ftm.fixed_tile_matmul(x, w, interpret=interpret), wb, ones, 2 * K * N)
            for c in cands:
                f = functools.partial(cand_matmul, interpret=interpret, **c)
                row("cand", lambda x, w, s, f=f: f(x, w, s), w8t if c["layout"] == "nk" else w8, sc, K * N,
                    **dict(c, S=splits(M, K, N, c["bm"], c["bn"], c["bk"], c["S"])))
        del w8, w8t, wb
        res["seconds"] = round(time.perf_counter() - t0, 1)
        with open(a.out, "w") as fh:
            json.dump(res, fh, indent=1)
    print(f"wrote {a.out} ({len(res['rows'])} rows, {res['seconds']} s)")


if __name__ == "__main__":
    main()
