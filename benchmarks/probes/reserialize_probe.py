"""Does an executable that JAX's persistent cache served survive jax's serialize_executable round
trip on this backend? On XLA:CPU (jax 0.10.2) it does not: the copy lacks its kernels and fails
at its first call ("Function ... not found"), which is why jvllm keeps JAX's cache off on CPU and
never stores such an executable there (jvllm.compilation.executable_cache.compile_for_cache). On
accelerators jvllm keeps JAX's cache on and stores what it served; this probe checks that holds.

    python benchmarks/probes/reserialize_probe.py [--out $OUT/reserialize.json]

One process: compile a small program (JAX's cache stores it), clear jax's in-memory caches,
compile again (JAX's cache serves it), then serialize, load and call both. Prints one JSON object.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    import jax
    import jax.numpy as jnp
    from jax.experimental import serialize_executable as se

    jax.config.update("jax_compilation_cache_dir", tempfile.mkdtemp(prefix="jvllm_reser_"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    hits = []
    jax.monitoring.register_event_listener(
        lambda ev, **kw: hits.append(ev) if ev == "/jax/compilation_cache/cache_hits" else None)

    def f(x):
        for _ in range(4):
            x = jnp.tanh(x @ x.T + jnp.broadcast_to(x.sum(0), x.shape)[:, : x.shape[0]])
        return x.sum(1)

    x = jnp.ones((64, 256), jnp.float32)
    want = f(x)
    fresh = jax.jit(f).lower(x).compile()
    jax.clear_caches()
    served = jax.jit(f).lower(x).compile()
    out = dict(probe="reserialize", backend=jax.default_backend(), device_kind=jax.devices()[0].device_kind,
               jax=jax.__version__, served_by_jax_cache=len(hits) == 1)
    for name, exe in (("fresh", fresh), ("served", served)):
        try:
            copy = se.deserialize_and_load(*se.serialize(exe), execution_devices=jax.devices()[:1])
            out[f"{name}_copy_ok"] = bool(jnp.allclose(copy(x), want, rtol=1e-3, atol=1e-3))
        except Exception as e:  # the hazard itself: recorded, not fatal
            out[f"{name}_copy_ok"] = False
            out[f"{name}_error"] = f"{type(e).__name__}: {e}"[:300]
    print(json.dumps(out, indent=1))
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
