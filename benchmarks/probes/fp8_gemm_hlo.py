"""Does XLA turn jvllm's fp8 projection into an fp8 GEMM, and how fast is each formulation?

Compiles one dense projection (default: Llama-3-8B's gate_proj, 4096 -> 14336) at a few token
counts in four formulations and reads each optimized HLO:

  bf16         x @ w in bfloat16 (the baseline)
  fp8          jvllm's `quantization="fp8"` on fp8-capable GPUs (jvllm.quantization.fp8.Fp8Channel,
               W8A8): x quantized per token to float8_e4m3fn, an fp8 x fp8 dot with float32
               accumulation, both scales after
  fp8_wonly    jvllm's fp8 elsewhere (Fp8Channel(activations=False)): the float8 weight converted
               to bfloat16 inside the dot, the per-channel scale after it
  int8         jvllm's `quantization="int8"` (weight-only, jvllm.quantization.int8.Int8Channel)

For each: whether the optimized HLO calls cuBLASLt's fp8 GEMM (`__cublas$lt$matmul$f8`), the
custom-call targets and fusion kinds it holds (a Triton GEMM fusion `__triton_gemm` is how XLA
fuses a dequantize into the GEMM), and the median time of `--iters` calls with the weight-read
bandwidth (small T: bound by the weight bytes) and FLOP rate (large T).

    python benchmarks/probes/fp8_gemm_hlo.py [--tokens 8,256,2048] [--d 4096] [--i 14336] [--out probe.json]
    python benchmarks/probes/fp8_gemm_hlo.py --tiny      # CPU smoke run (no fp8 GEMM exists there)
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))  # the repository root

F8_GEMM = "__cublas$lt$matmul$f8"


def formulations():
    import jax.numpy as jnp

    from jvllm.quantization.fp8 import Fp8Channel
    from jvllm.quantization.int8 import Int8Channel

    class P:  # what a module's nnx.Param gives the projection: `[...]` reads the value
        def __init__(self, v):
            self.v = v

        def __getitem__(self, _):
            return self.v

    spec = "td,di->ti"

    def bf16(x, w, s):
        return jnp.einsum(spec, x, w)

    def fp8(x, w, s):
        return Fp8Channel()(spec, x, P(w), P(s))

    def fp8_wonly(x, w, s):
        return Fp8Channel(activations=False)(spec, x, P(w), P(s))

    def int8(x, w, s):
        return Int8Channel()(spec, x, P(w), P(s))

    return {"bf16": (bf16, None), "fp8": (fp8, Fp8Channel()), "fp8_wonly": (fp8_wonly, Fp8Channel()),
            "int8": (int8, Int8Channel())}


def hlo_facts(text: str) -> dict:
    calls = sorted(set(re.findall(r'custom_call_target="([^"]+)"', text)))
    kinds = sorted(set(re.findall(r'"kind":"(__[a-z_]+)"', text)) | set(re.findall(r"kind=k(\w+)", text)))
    return dict(f8_gemm=F8_GEMM in text, custom_calls=calls, fusion_kinds=kinds,
                f8_dot=bool(re.search(r"= f8e4m3fn\[[^\]]*\][^\n]*\bdot\(|dot\([^\n]*f8e4m3fn", text)))


def main(argv=None):
    import jax
    import jax.numpy as jnp
    import numpy as np

    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="8,256,2048", help="token counts (B1 decode bucket, W1 decode, P1 prefill)")
    ap.add_argument("--d", type=int, default=4096, help="input dim")
    ap.add_argument("--i", type=int, default=14336, help="output dim")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--tiny", action="store_true", help="small shapes, few iterations (CPU smoke run)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if a.tiny:
        a.tokens, a.d, a.i, a.iters = "8,64", 256, 512, 3
    key = jax.random.split(jax.random.key(0), 2)
    w = (jax.random.normal(key[0], (a.d, a.i), jnp.float32) * 0.02).astype(jnp.bfloat16)
    res = dict(device=str(jax.devices()[0].device_kind), backend=jax.default_backend(), d=a.d, i=a.i, results={})
    for name, (fn, proj) in formulations().items():
        if proj is None:
            wq, s = w, None
        else:
            wq, s = jax.jit(lambda w: proj.quantize(w, 1))(w)
        jfn = jax.jit(fn)
        for T in (int(t) for t in a.tokens.split(",")):
            x = jax.random.normal(key[1], (T, a.d), jnp.float32).astype(jnp.bfloat16)
            exe = jfn.lower(x, wq, s).compile()
            facts = hlo_facts(exe.as_text())
            exe(x, wq, s).block_until_ready()
            ts = []
            for _ in range(a.iters):
                t0 = time.perf_counter()
                exe(x, wq, s).block_until_ready()
                ts.append(time.perf_counter() - t0)
            dt = float(np.median(ts))
            wbytes = wq.nbytes + (0 if s is None else s.nbytes)
            row = dict(**facts, ms=dt * 1e3, weight_gb_per_s=wbytes / dt / 1e9, tflops=2 * T * a.d * a.i / dt / 1e12)
            res["results"][f"{name}[T={T}]"] = row
            print(f"{name:10s} T={T:5d}  f8 GEMM {str(facts['f8_gemm']):5s}  {dt * 1e3:8.3f} ms  "
                  f"{row['weight_gb_per_s']:8.1f} GB/s  {row['tflops']:7.2f} TFLOP/s  calls {facts['custom_calls']}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
