"""Per-call time of the sampler on logits already on the device, the build before (its
jvllm/sampling.py, read from git or a file) against this tree's, in one process, and whether the
two draw the same ids. Prints one JSON object (and writes it with --out).

    python benchmarks/probes/sampler_speed.py --R 256 --V 128256 --reps 3 [--base e64adcb | --old-file f.py]

Cases: greedy (argmax, the reference cost), temperature 0.8 alone, + top_p 0.95, + top_k 50,
+ min_p 0.05, + top_k 50 and top_p 0.95, + top_k 1000 (past the group select: the radix search).
Logits: N(0, --scale) per token (a random-weight model's flat rows by default; --scale 4 gives
peaked rows). The old sampler runs as each platform ran it
(`branchless`: True on GPUs, False elsewhere) and both ways with --both-old; the new one in its
smallest variant for the case with this platform's `SamplerImpl`, and with --impls any of gpu
(radix 4, no conds), gpu2 / gpu1 (radix 2 / 1, no conds), gpu_r0 / gpu_r2 (top-p: no XLA round
before the Pallas tail / two), gpu_g32 / gpu_g128 (top_k <= 64: groups of 32 / 128 tokens), cpu
(radix 1, conds), tpu (radix 4, conds). Times are medians of --reps calls after one untimed call
(compile), each ending with block_until_ready. On a GPU: `--impls gpu2,gpu1` says whether fewer candidate sums per pass (more
passes) would be faster there. `--parts` also times the pieces of a top_p draw as separate
programs (pre-pass, one threshold search per radix width, Gumbel noise + argmax). A build whose
sampler has `SamplerImpl` runs as its platform's impl; --both-old applies to older builds only.
"""
from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time

CASES = {
    "greedy": dict(temperature=0.0),
    "temperature": dict(temperature=0.8),
    "top_p": dict(temperature=0.8, top_p=0.95),
    "top_k": dict(temperature=0.8, top_k=50),
    "min_p": dict(temperature=0.8, min_p=0.05),
    "top_k_top_p": dict(temperature=0.8, top_k=50, top_p=0.95),
    "top_k_1000": dict(temperature=0.8, top_k=1000),
}
IMPLS = {"gpu": dict(radix_bits=4), "gpu2": dict(radix_bits=2), "gpu1": dict(radix_bits=1),
         "gpu_r0": dict(rejection_rounds=0), "gpu_r2": dict(rejection_rounds=2),
         "gpu_g32": dict(top_k_group=32), "gpu_g128": dict(top_k_group=128),
         "cpu": dict(radix_bits=1, branchy=True), "tpu": dict(radix_bits=4, branchy=True)}


def load_old(base: str | None, old_file: str | None):
    if old_file is None:
        root = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True, check=True).stdout.strip()
        src = subprocess.run(["git", "-C", root, "show", f"{base}:jvllm/sampling.py"], capture_output=True, text=True,
                             check=True).stdout
        fd, old_file = tempfile.mkstemp(suffix="_old_sampling.py")
        with os.fdopen(fd, "w") as f:
            f.write(src)
    spec = importlib.util.spec_from_file_location("old_sampling", old_file)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses with string annotations look their module up
    spec.loader.exec_module(mod)
    return mod


def batch(mod, R: int, V: int, case: dict):
    import jax.numpy as jnp
    import numpy as np

    return mod.SamplingBatch(
        temperature=jnp.full((R,), case.get("temperature", 1.0), jnp.float32),
        top_k=jnp.full((R,), case.get("top_k", V), jnp.int32), top_p=jnp.full((R,), case.get("top_p", 1.0), jnp.float32),
        min_p=jnp.full((R,), case.get("min_p", 0.0), jnp.float32),
        key_data=jnp.asarray(np.stack([np.zeros(R), np.arange(R)], 1), jnp.uint32),
        counter=jnp.full((R,), 3, jnp.int32), want_logprobs=jnp.asarray(False))


def timed(fn, *args, reps: int) -> tuple[float, object]:
    import jax

    out = jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t)
    ts.sort()
    return ts[len(ts) // 2], out


def time_parts(mod, logits, reps: int) -> dict:
    """ms per call of the pieces of a temperature 0.8 + top_p 0.95 draw, each its own jitted program
    (so each pays one launch and one read of its inputs: an upper bound on its share when fused)."""
    import jax
    import jax.numpy as jnp

    R, V = logits.shape
    sb = batch(mod, R, V, dict(temperature=0.8, top_p=0.95))

    def pre(x):
        x = x / 0.8
        mx = jnp.max(x, axis=-1)
        e = jnp.exp(x - mx[:, None])
        return mod._ukey(x), e, 0.95 * jnp.sum(e, axis=-1)

    out = {"pre_ms": 1e3 * timed(jax.jit(pre), logits, reps=reps)[0]}
    u, e, target = jax.jit(pre)(logits)
    for bits in (4, 2, 1):
        f = jax.jit(functools.partial(mod._radix_search, bits=bits))
        out[f"search_radix{bits}_ms"] = 1e3 * timed(f, u, e, target, reps=reps)[0]
    noise = jax.jit(lambda x: jnp.argmax(x + mod._gumbel(sb, V), axis=-1))
    out["gumbel_argmax_ms"] = 1e3 * timed(noise, logits, reps=reps)[0]
    out["argmax_ms"] = 1e3 * timed(jax.jit(lambda x: jnp.argmax(x, axis=-1)), logits, reps=reps)[0]
    print(json.dumps(out), file=sys.stderr, flush=True)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--R", type=int, default=256)
    ap.add_argument("--V", type=int, default=128256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--scale", type=float, default=1.0, help="logits ~ N(0, scale)")
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated of {','.join(CASES)}")
    ap.add_argument("--impls", default="", help=f"new-sampler impls besides this platform's: {','.join(IMPLS)}")
    ap.add_argument("--both-old", action="store_true", help="the old sampler with branchless True and False (builds before SamplerImpl)")
    ap.add_argument("--base", default="e64adcb", help="git revision of the old jvllm/sampling.py")
    ap.add_argument("--old-file", default=None, help="the old jvllm/sampling.py as a file (no git)")
    ap.add_argument("--parts", action="store_true",
                    help="also time the draw's parts: the pre-pass (temperature, max, exp, keys), one threshold "
                         "search per radix width, the Gumbel noise + argmax")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jvllm import sampling as new
    from jvllm.sampling import SamplerImpl, SamplerVariant

    old = load_old(a.base, a.old_file)
    platform = jax.default_backend()
    cases = [c for c in a.cases.split(",") if c]
    bad = [c for c in cases if c not in CASES]
    if bad:
        raise SystemExit(f"unknown cases {bad}; choose from {list(CASES)}")
    logits = jnp.asarray(np.random.default_rng(0).normal(0, a.scale, (a.R, a.V)).astype(np.float32))
    old_modes = [True, False] if a.both_old else [platform == "gpu"]
    impls = {"platform": SamplerImpl.for_platform(platform)}
    for name in (i for i in a.impls.split(",") if i):
        impls[name] = SamplerImpl(**IMPLS[name])
    argmax = jax.jit(lambda x: jnp.argmax(x, axis=-1).astype(jnp.int32))
    rows = []
    for c in cases:
        case = CASES[c]
        row = dict(case=c, **case)
        if c == "greedy":
            row["argmax_ms"] = 1e3 * timed(argmax, logits, reps=a.reps)[0]
        k, p = case.get("top_k", a.V) < a.V, case.get("top_p", 1.0) < 1.0
        if hasattr(old, "SamplerImpl"):  # a build with SamplerImpl: its platform impl, smallest variant
            oi = old.SamplerImpl.for_platform(platform)
            ov = old.SamplerVariant(2, True) if oi.branchy else old.SamplerVariant(
                2 if (k and p) else 1 if (k or p) else 0, logprobs=False)
            f = jax.jit(functools.partial(old.sample, variant=ov, impl=oi))
            s, (tok_old, _) = timed(f, logits, batch(old, a.R, a.V, case), None, reps=a.reps)
            row["old_platform_ms"] = 1e3 * s
        else:
            for bl in old_modes:
                f = jax.jit(functools.partial(old.sample, branchless=bl))
                s, (tok_old, _) = timed(f, logits, batch(old, a.R, a.V, case), None, reps=a.reps)
                row[f"old_branchless_{bl}_ms"] = 1e3 * s
        for name, impl in impls.items():
            v = SamplerVariant((2 if k else 0) | (1 if p else 0), logprobs=False,
                               wide_top_k=case.get("top_k", a.V) > impl.narrow_top_k)
            if impl.branchy:
                v = SamplerVariant(3, True)
            f = jax.jit(functools.partial(new.sample, variant=v, impl=impl))
            s, (tok_new, _) = timed(f, logits, batch(new, a.R, a.V, case), None, reps=a.reps)
            row[f"new_{name}_ms"] = 1e3 * s
            row[f"new_{name}_same_ids_as_old"] = bool(np.array_equal(np.asarray(tok_new), np.asarray(tok_old)))
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    parts = time_parts(new, logits, a.reps) if a.parts else None
    from jvllm.bench import device_info, versions

    out = dict(parts=parts, probe="sampler_speed", platform=platform, device=device_info(), versions=versions(), R=a.R, V=a.V,
               reps=a.reps, scale=a.scale, base=a.old_file or a.base, impls={n: vars(i) for n, i in impls.items()},
               cases=rows)
    text = json.dumps(out, indent=1)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
