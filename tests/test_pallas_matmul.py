"""The weight-streaming Pallas matmul (jvllm.ops.pallas_matmul) in interpret mode against the XLA
formulation: grouped launches, the float16 path for fp8 weights, the tile and split choice, the
fallback, bad inputs, and the kernels' Triton lowering (traced for the cuda platform on this CPU:
what the GPU build would compile)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jvllm.ops import pallas_matmul as pm

FP8 = jnp.float8_e4m3fn


def _weights(K, Ns, wdtype, seed=0):
    out = []
    for i, N in enumerate(Ns):
        kw, ks = jax.random.split(jax.random.PRNGKey(seed * 31 + i))
        w = (jax.random.normal(kw, (N, K), jnp.float32) * (3.0 if wdtype == FP8 else 0.05)).astype(wdtype)
        s = jax.random.uniform(ks, (N,), minval=0.005, maxval=0.02) if wdtype == FP8 else None
        out.append((w, s))
    return out


def _x(M, K, seed=0, dtype=jnp.bfloat16, scale=1.0):
    return (jax.random.normal(jax.random.PRNGKey(1000 + seed), (M, K), jnp.float32) * scale).astype(dtype)


def _close(y, ref):
    y, ref = np.asarray(y, np.float32), np.asarray(ref, np.float32)
    assert y.shape == ref.shape
    # the float32 sums run in another order: at most about one bfloat16 rounding step apart
    np.testing.assert_allclose(y, ref, rtol=2 ** -7, atol=2 ** -7 * float(np.abs(ref).max()))


# (M, K, [N_i]): one weight and groups (q/k/v-like, gate/up-like); M across row tiles 16, 32, 64
@pytest.mark.parametrize("M,K,Ns", [(1, 256, [128]), (17, 512, [256, 128, 128]), (64, 256, [384, 384]),
                                    (5, 1024, [128])])
def test_fp8_groups_match_xla(M, K, Ns):
    x = _x(M, K, seed=M)
    ws = _weights(K, Ns, FP8, seed=M)
    ys = pm.matmuls(x, [w for w, _ in ws], [s for _, s in ws], interpret=True)
    assert [y.shape for y in ys] == [(M, N) for N in Ns] and all(y.dtype == jnp.bfloat16 for y in ys)
    for y, (w, s) in zip(ys, ws):
        _close(y, pm.reference(x, w, s))


def test_float16_path_keeps_large_and_tiny_rows():
    """x is scaled per row into float16: rows of 3e4 (past nothing in bf16, near float16's limit)
    and of 1e-6 come out like the float32 product."""
    K = 256
    (w, s), = _weights(K, [128], FP8)
    x = jnp.concatenate([_x(1, K, 1, scale=3e4), _x(1, K, 2, scale=1e-6), _x(1, K, 3)])
    y = pm.matmul(x, w, s, interpret=True)
    want = (x.astype(jnp.float32) @ w.astype(jnp.float32).T) * s
    for r in range(3):
        np.testing.assert_allclose(np.asarray(y[r], np.float32), np.asarray(want[r]), rtol=2 ** -7,
                                   atol=2 ** -7 * float(jnp.abs(want[r]).max()))
    assert np.isfinite(np.asarray(y, np.float32)).all()


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_weights_in_x_dtype_and_no_scale(dtype):
    x = _x(3, 256, dtype=dtype)
    (w, _), = _weights(256, [256], dtype)
    _close(pm.matmul(x, w, interpret=True), pm.reference(x, w))


def test_tiles_split_k_until_the_grid_is_full():
    t = pm.tiles(8, 4096, [4096, 1024, 1024])  # 48 column tiles: 8 splits of 4 K steps
    assert (t.bm, t.splits) == (16, 8)
    assert pm.tiles(8, 4096, [14336, 14336]).splits == 2  # 224 column tiles
    assert pm.tiles(1, 8192, [65536]).splits == 1
    assert pm.tiles(1, 512, [128]).splits == 1  # 4 K steps: no split keeps MIN_SPLIT_STEPS
    assert pm.tiles(17, 4096, [4096]).bm == 32 and pm.tiles(64, 4096, [4096]).bm == 64
    assert pm.tiles(1, 4096, [100]) is None and pm.tiles(1, 200, [128]) is None


def test_untileable_shapes_fall_back_to_xla():
    for K, N in [(256, 100), (200, 128)]:
        x = _x(3, K)
        (w, s), = _weights(K, [N], FP8)
        jaxpr = str(jax.make_jaxpr(functools.partial(pm.matmul, interpret=True))(x, w, s))
        assert "pallas_call" not in jaxpr
        np.testing.assert_array_equal(np.asarray(pm.matmul(x, w, s), np.float32),
                                      np.asarray(pm.reference(x, w, s), np.float32))
    (w, s), = _weights(256, [128], FP8)
    assert "pallas_call" in str(jax.make_jaxpr(functools.partial(pm.matmul, interpret=True))(_x(3, 256), w, s))


def test_bad_inputs_are_errors_naming_the_value():
    x = _x(4, 256)
    (w, s), = _weights(256, [128], FP8)
    with pytest.raises(ValueError, match=r"x must be \[M, K\] and each w \[N, K\]"):
        pm.matmul(x[:, :128], w, s)
    with pytest.raises(ValueError, match="scale has shape"):
        pm.matmul(x, w, s[:5])
    with pytest.raises(ValueError, match="w's dtype int8"):
        pm.matmul(x, w.astype(jnp.int8))
    with pytest.raises(ValueError, match="one scale .* per weight"):
        pm.matmuls(x, [w, w], [s])
    assert pm.matmul(x[:0], w, s).shape == (0, 128)


@pytest.mark.parametrize("M,wdtype,Ns", [(1, FP8, (1024,)), (24, FP8, (1024, 256, 256)), (8, jnp.bfloat16, (512,))])
def test_lowers_to_triton_for_cuda(M, wdtype, Ns):
    """The kernels lower through jax's Triton backend (cuda platform, traced on this CPU; jax assumes
    compute capability 9.0 without a GPU): catches constructs the Triton lowering refuses."""
    K = 4096
    args = [jax.ShapeDtypeStruct((M, K), jnp.bfloat16)] + [jax.ShapeDtypeStruct((N, K), wdtype) for N in Ns]
    f = (lambda x, *ws: pm.matmuls(x, ws, [jnp.ones((w.shape[0],)) for w in ws], interpret=False)) if wdtype == FP8 \
        else (lambda x, *ws: pm.matmuls(x, ws, interpret=False))
    text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in text


def test_decode_probe_runs_tiny():
    """benchmarks/probes/fp8_decode_probe.py --tiny (interpret mode): every kernel it sweeps runs
    and matches the float32 product (rel_err), so the GPU sweep measures working kernels."""
    import json
    import os
    import subprocess
    import sys
    import tempfile

    probes = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "probes")
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "p.json")
        env = dict(os.environ, PYTHONPATH=os.path.join(probes, "..", "..") + os.pathsep + os.environ.get("PYTHONPATH", ""))
        p = subprocess.run([sys.executable, "fp8_decode_probe.py", "--tiny", "--out", out], cwd=probes, env=env,
                           capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stderr[-2000:]
        rows = json.load(open(out))["rows"]
    assert {r["kind"] for r in rows} == {"xla_bf16", "xla_fp8", "pm", "ft_bf16", "cand"}
    assert not [r for r in rows if "error" in r]
    assert all(r["rel_err"] < (0.05 if r.get("conv") == "a8" else 0.01) for r in rows)
