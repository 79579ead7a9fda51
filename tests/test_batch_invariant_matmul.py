"""The fixed-tile matmul of batch-invariant mode (jvllm.ops.fixed_tile_matmul), interpret mode on
CPU: equal to a float32 dot within rounding, and every row bit-equal whatever the number of rows and
the row's place among them (where XLA's dot is not)."""
import jax.numpy as jnp
import numpy as np
import pytest

from jvllm.ops.fixed_tile_matmul import Tiles, fixed_tile_matmul, tiles

RNG = np.random.default_rng(0)
SLICES = [(1, 0), (1, 77), (8, 3), (33, 100), (200, 50), (5, 295)]  # (rows, first row) of 300


@pytest.mark.parametrize("K,N,transposed", [(64, 256, False), (576, 1536, False), (64, 40, False), (96, 256, True)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_rows_bit_equal_whatever_the_batch(K, N, transposed, dtype):
    x = jnp.asarray(RNG.standard_normal((300, K)), dtype)
    w = jnp.asarray(RNG.standard_normal((N, K) if transposed else (K, N)) * 0.1, dtype)
    full = np.asarray(fixed_tile_matmul(x, w, w_transposed=transposed, out_dtype=jnp.float32))
    ref = np.asarray(jnp.dot(x.astype(jnp.float32), (w.T if transposed else w).astype(jnp.float32)))
    np.testing.assert_allclose(full, ref, rtol=1e-5, atol=1e-4)
    for m, off in SLICES:
        got = np.asarray(fixed_tile_matmul(x[off:off + m], w, w_transposed=transposed, out_dtype=jnp.float32))
        assert np.array_equal(got, full[off:off + m]), (m, off)


def test_xla_dot_is_not_invariant_here():
    """The property above is not vacuous on this backend: XLA's own dot changes rows with M."""
    x = jnp.asarray(RNG.standard_normal((300, 576)), jnp.float32)
    w = jnp.asarray(RNG.standard_normal((576, 1536)) * 0.1, jnp.float32)
    full = np.asarray(jnp.dot(x, w))
    assert any(not np.array_equal(np.asarray(jnp.dot(x[o:o + m], w)), full[o:o + m]) for m, o in SLICES)


def test_tiles_depend_on_k_and_n_only_and_bad_shapes():
    assert tiles(4096, 14336) == Tiles(bm=32, bn=128, bk=64)
    assert tiles(64, 40) == Tiles(bm=32, bn=32, bk=64)  # no pow2 divisor >= 16: shifted last tile
    assert fixed_tile_matmul(jnp.ones((3, 64), jnp.bfloat16), jnp.ones((64, 32), jnp.bfloat16)).dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="K=24 has no power-of-two divisor"):
        fixed_tile_matmul(jnp.ones((2, 24)), jnp.ones((24, 32)))
    with pytest.raises(ValueError, match="N=8 is below"):
        fixed_tile_matmul(jnp.ones((2, 32)), jnp.ones((32, 8)))
    with pytest.raises(ValueError, match="x has K=32"):
        fixed_tile_matmul(jnp.ones((2, 32)), jnp.ones((64, 32)))


@pytest.mark.parametrize("shape,transposed", [((4096, 1024), False), ((4096, 128256), True), ((64, 40), False)])
def test_lowers_to_triton_for_cuda(shape, transposed):
    """The kernel lowers through jax's Triton backend (cuda platform, traced on this CPU; jax
    assumes compute capability 9.0 without a GPU): catches constructs the Triton lowering refuses."""
    import functools

    import jax

    K, N = shape
    f = functools.partial(fixed_tile_matmul, w_transposed=transposed, out_dtype=jnp.float32, interpret=False)
    args = [jax.ShapeDtypeStruct((8, K), jnp.bfloat16),
            jax.ShapeDtypeStruct((N, K) if transposed else (K, N), jnp.bfloat16)]
    text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in text
