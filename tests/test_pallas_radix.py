"""The sampler's threshold-search pass as a Pallas kernel (jvllm.ops.pallas_radix), run in
interpret mode on CPU: its sums against XLA's, whole draws against a full sort, its Triton lowering."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jvllm import sampling
from jvllm.ops import pallas_radix as pr
from jvllm.sampling import SamplerImpl, sample
from tests.test_sampling import _mixed_batch, _sorted_oracle

KERNEL = SamplerImpl(4, False, search_kernel=True, argmax_kernel=True)


@pytest.mark.parametrize("R,V,n,chunk", [(3, 1000, 15, 128), (5, 4099, 3, 128), (2, 700, 1, 256), (1, 64, 15, 128)])
def test_pass_sums_match_xla(R, V, n, chunk):
    """Each candidate's sum over the row (tails past V masked), split over programs or not."""
    rng = np.random.default_rng(R * V + n)
    k = jnp.asarray(rng.integers(-2**31, 2**31 - 1, size=(R, V)), jnp.int32)
    w = jnp.asarray(rng.random((R, V)).astype(np.float32))
    c = jnp.asarray(rng.integers(-2**31, 2**31 - 1, size=(R, n)), jnp.int32)
    c = c.at[:, 0].set(k[:, V // 2])  # a candidate equal to a key: >= keeps it
    got, want = pr.pass_sums(k, w, c, chunk=chunk), pr.reference(k, w, c)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-4)
    ones = pr.pass_sums(k, jnp.ones_like(w), c, chunk=chunk)  # counts: exact in float32
    np.testing.assert_array_equal(np.asarray(ones), np.asarray(pr.reference(k, jnp.ones_like(w), c)))


def test_signed_key_keeps_the_order():
    x = jnp.asarray([-jnp.inf, -3.0, -0.0, 0.0, 1e-30, 2.5, jnp.inf], jnp.float32)
    k = np.asarray(pr.signed_key(sampling._ukey(x)))
    assert np.all(np.diff(k) > 0)


def test_splits_fill_the_gpu_and_keep_chunks():
    assert pr.splits(256, 128256) == 4  # 1,024 programs
    assert pr.splits(1, 128256) == 16  # 251 chunks: 16 ranges of >= 8
    assert pr.splits(4, 3000) == 1  # 6 chunks: no split
    assert pr.splits(2048, 128256) == 1


@pytest.mark.parametrize("bits", [4, 2])
def test_search_equals_xla_search(bits):
    rng = np.random.default_rng(bits)
    x = jnp.asarray(rng.normal(0, 2, (6, 2500)).astype(np.float32))
    u = sampling._ukey(x)
    e = jnp.exp(x - jnp.max(x, axis=1, keepdims=True))
    for w, target in [(e, 0.9 * jnp.sum(e, axis=1)), (jnp.ones_like(e), jnp.asarray([1, 2, 50, 700, 2499, 2500.0]))]:
        want = sampling._radix_search(u, w, target, bits)
        got = sampling._radix_search(u, w, target, bits, kernel=True)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_kernel_sampler_matches_full_sort():
    """top_k of any size, narrow to nearly full nuclei, both, min_p: the full sort's tokens."""
    fn = jax.jit(functools.partial(sample, impl=KERNEL))
    logits, sb = _mixed_batch(96, 3000, 0)
    tok, _ = fn(logits, sb, None)
    want, _, _ = _sorted_oracle(logits, sb)
    np.testing.assert_array_equal(np.asarray(tok), np.asarray(want))


def test_lowers_to_triton_for_cuda():
    """The kernel lowers through jax's Triton backend at W1's sampler shape (traced on this CPU)."""
    R, V = 256, 128256
    args = (jax.ShapeDtypeStruct((R, V), jnp.int32), jax.ShapeDtypeStruct((R, V), jnp.float32),
            jax.ShapeDtypeStruct((R, 15), jnp.int32))
    text = jax.jit(lambda k, w, c: pr.pass_sums(k, w, c, interpret=False)).trace(*args).lower(
        lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1 and "grid_x = 256" in text and "grid_y = 4" in text


def test_bad_inputs_are_refused():
    k = jnp.zeros((2, 8), jnp.int32)
    with pytest.raises(ValueError, match="int32"):
        pr.pass_sums(k.astype(jnp.float32), jnp.zeros((2, 8)), jnp.zeros((2, 3), jnp.int32))
    with pytest.raises(ValueError, match=r"cands \(3, 3\)"):
        pr.pass_sums(k, jnp.zeros((2, 8)), jnp.zeros((3, 3), jnp.int32))
    with pytest.raises(ValueError, match="power of two"):
        pr.pass_sums(k, jnp.zeros((2, 8)), jnp.zeros((2, 3), jnp.int32), chunk=96)
    with pytest.raises(ValueError, match="fixed_order_sums"):
        SamplerImpl(4, False, fixed_order_sums=True, search_kernel=True)


def test_rows_beyond_int32_offsets_take_xla(monkeypatch):
    """R * V >= 2**31 (e.g. 8,192 rows of a 262k vocabulary) would overflow the kernels' int32
    offsets: the sampler traces XLA's reductions there instead (no kernel in the program)."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # the kernels' Triton form, not interpret
    R, V = 8192, 262144
    x = jax.ShapeDtypeStruct((R, V), jnp.float32)
    text = jax.jit(lambda x: sampling.row_argmax(x, KERNEL)).trace(x).lower(lowering_platforms=("cuda",)).as_text()
    assert "triton" not in text
    small = jax.ShapeDtypeStruct((8, V), jnp.float32)
    text = jax.jit(lambda x: sampling.row_argmax(x, KERNEL)).trace(small).lower(lowering_platforms=("cuda",)).as_text()
    assert "triton" in text
    u = jax.ShapeDtypeStruct((R, V), jnp.uint32)
    w = jax.ShapeDtypeStruct((R, V), jnp.float32)
    tgt = jax.ShapeDtypeStruct((R,), jnp.float32)
    f = functools.partial(sampling._radix_search, bits=4, kernel=True)
    assert "triton" not in jax.jit(f).trace(u, w, tgt).lower(lowering_platforms=("cuda",)).as_text()
