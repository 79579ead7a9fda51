"""The weight-streaming Pallas matmul (jvllm.ops.pallas_matmul) in interpret mode against the XLA
formulation, the launch checks, and the kernels'
Triton lowering (traced for the cuda platform on this CPU: what the GPU build would compile)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jvllm.ops import pallas_matmul as pm

FP8 = jnp.float8_e4m3fn


def _operands(M, K, N, wdtype, seed=0):
    kx, kw, ks = jax.random.split(jax.random.PRNGKey(seed), 3)
    x = jax.random.normal(kx, (M, K), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(kw, (K, N), jnp.float32) * (3.0 if wdtype == FP8 else 0.05)).astype(wdtype)
    scale = jax.random.uniform(ks, (N,), minval=0.005, maxval=0.02) if wdtype == FP8 else None
    return x, w, scale


def _close(y, ref):
    y, ref = np.asarray(y, np.float32), np.asarray(ref, np.float32)
    assert y.shape == ref.shape and y.dtype == ref.dtype
    # the float32 sums run in another order: at most about one bfloat16 rounding step apart
    np.testing.assert_allclose(y, ref, rtol=2 ** -7, atol=2 ** -7 * float(np.abs(ref).max()))


# (K, N) of Llama / Gemma projections scaled down: hidden 64 / 640 (Gemma's 5 * 2^7), head dims, MLP
SHAPES = [(64, 96), (640, 256), (256, 1024), (1024, 64), (96, 640)]


# each shape once, with M cycling through 1, 17 and 64 (row blocks of 16, 32 and 64; every M with
# every shape cost 15 interpret-mode runs for no new path), plus the odd M of a partial row block
@pytest.mark.parametrize("M,K,N", [((1, 17, 64)[i % 3], K, N) for i, (K, N) in enumerate(SHAPES)] + [(3, 640, 256), (40, 96, 640)])
def test_fp8_decode_form_matches_xla(M, K, N):
    x, w, scale = _operands(M, K, N, FP8, seed=M)
    y = pm.matmul(x, w, scale, interpret=True)
    assert y.dtype == jnp.bfloat16
    _close(y, pm.reference(x, w, scale))


@pytest.mark.parametrize("M,K,N", [(1, 256, 128), (16, 640, 96), (100, 128, 256)])
def test_bf16_weights_and_no_scale(M, K, N):
    x, w, _ = _operands(M, K, N, jnp.bfloat16)
    _close(pm.matmul(x, w, interpret=True), pm.reference(x, w))


@pytest.mark.parametrize("launch", [pm.Launch(16, 32, 16, 4), pm.Launch(32, 64, 64, 2, num_warps=8, num_stages=2),
                                    pm.Launch(16, 16, 32, 1)])
def test_explicit_launches_split_k(launch):
    x, w, scale = _operands(5, 256, 128, FP8)
    _close(pm.matmul(x, w, scale, launch=launch, interpret=True), pm.reference(x, w, scale))


def test_decode_launch_splits_k_only_when_the_grid_is_small():
    assert pm.decode_launch(1, 4096, 28672).split_k == 2  # 224 column blocks (bn 128): 448 programs
    assert pm.decode_launch(1, 8192, 65536).split_k == 1  # 512 column blocks already
    small = pm.decode_launch(1, 4096, 1024)  # 8 column blocks: MAX_SPLIT_K splits (64 programs)
    assert (small.bm, small.bn, small.bk, small.split_k) == (16, 128, 256, pm.MAX_SPLIT_K)
    assert pm.decode_launch(64, 4096, 4096).bm == 64 and pm.decode_launch(17, 4096, 4096).bm == 32
    assert pm.decode_launch(1, 48, 4096).split_k == 1  # three 16-row K steps: no even split
    assert pm.decode_launch(1, 4096, 100) is None and pm.decode_launch(1, 40, 64) is None


def test_untileable_shapes_fall_back_to_xla():
    """N (or K) that no power-of-two block >= 16 divides: the XLA formulation, no pallas_call."""
    for K, N in [(64, 100), (40, 64)]:
        x, w, scale = _operands(3, K, N, FP8)
        jaxpr = str(jax.make_jaxpr(functools.partial(pm.matmul, interpret=True))(x, w, scale))
        assert "pallas_call" not in jaxpr
        np.testing.assert_array_equal(np.asarray(pm.matmul(x, w, scale), np.float32),
                                      np.asarray(pm.reference(x, w, scale), np.float32))
    x, w, scale = _operands(3, 64, 96, FP8)
    assert "pallas_call" in str(jax.make_jaxpr(functools.partial(pm.matmul, interpret=True))(x, w, scale))


def test_bad_inputs_are_errors_naming_the_value():
    x, w, scale = _operands(4, 64, 96, FP8)
    with pytest.raises(ValueError, match=r"x must be \[M, K\] and w \[K, N\]"):
        pm.matmul(x[:, :32], w, scale)
    with pytest.raises(ValueError, match="scale has shape"):
        pm.matmul(x, w, scale[:5])
    with pytest.raises(ValueError, match="w's dtype int8"):
        pm.matmul(x, w.astype(jnp.int8))
    with pytest.raises(ValueError, match="does not tile w\\[64, 96\\]"):
        pm.matmul(x, w, scale, launch=pm.Launch(16, 64, 16))
    for bad in (dict(bm=8), dict(bn=48), dict(split_k=0), dict(num_warps=3), dict(num_stages=0)):
        kw = dict(bm=16, bn=16, bk=16) | bad
        with pytest.raises(ValueError, match=f"Launch.{next(iter(bad))}"):
            pm.Launch(**kw)
    assert pm.matmul(x[:0], w, scale).shape == (0, 96)


@pytest.mark.parametrize("M,wdtype", [(1, FP8), (24, FP8), (8, jnp.bfloat16)])
def test_lowers_to_triton_for_cuda(M, wdtype):
    """The kernels lower through jax's Triton backend (cuda platform, traced on this CPU; jax assumes
    compute capability 9.0 without a GPU): catches constructs the Triton lowering refuses."""
    K, N = 4096, 1024
    f = functools.partial(pm.matmul, interpret=False)
    args = [jax.ShapeDtypeStruct((M, K), jnp.bfloat16), jax.ShapeDtypeStruct((K, N), wdtype)]
    if wdtype == FP8:
        args.append(jax.ShapeDtypeStruct((N,), jnp.float32))
    text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in text
