"""Fixed-order row reductions of batch-invariant mode (jvllm.ops.fixed_order): equal to XLA's within
rounding, and each row bit-equal whatever the number of rows (where XLA's log-softmax is not, on CPU)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jvllm.ops.fixed_order import log_softmax, tree_mean, tree_sum
from jvllm.sampling import SamplerImpl, SamplerVariant, SamplingBatch, logprob_outputs, sample

RNG = np.random.default_rng(3)
SLICES = [(8, 0), (8, 5), (16, 20), (1, 3), (37, 10)]  # (rows, first row) of 64


def _rows_equal(f, z):
    full = np.asarray(f(z))
    return all(np.array_equal(np.asarray(f(z[o:o + m])), full[o:o + m]) for m, o in SLICES)


@pytest.mark.parametrize("V", [256, 1000])
def test_fixed_order_rows_do_not_depend_on_the_batch(V):
    z = jnp.asarray(RNG.standard_normal((64, V)) * 3, jnp.float32)
    np.testing.assert_allclose(tree_sum(z), jnp.sum(z, -1), rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(tree_mean(z, keepdims=True), jnp.mean(z, -1, keepdims=True), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(log_softmax(z), jax.nn.log_softmax(z, -1), rtol=1e-5, atol=1e-5)
    assert _rows_equal(jax.jit(log_softmax), z)
    assert _rows_equal(jax.jit(lambda x: tree_sum(x, axis=-1)), z)
    assert tree_sum(z[:, :1]).shape == (64,) and np.array_equal(tree_sum(z.T, axis=0), tree_sum(z))


def test_xla_log_softmax_is_not_invariant_here():
    """The property above is not vacuous: XLA's own log-softmax changes rows with their number."""
    z = jnp.asarray(RNG.standard_normal((64, 256)) * 3, jnp.float32)
    assert not _rows_equal(jax.jit(lambda x: jax.nn.log_softmax(x, -1)), z)


def _batch(R, V):
    kinds = np.arange(R) % 4  # greedy, top_p, top_k, both
    return SamplingBatch(
        temperature=jnp.asarray(np.where(kinds == 0, 0.0, 0.9), jnp.float32),
        top_k=jnp.asarray(np.where(kinds >= 2, 20, V), jnp.int32),
        top_p=jnp.asarray(np.where(kinds % 2 == 1, 0.8, 1.0), jnp.float32),
        min_p=jnp.zeros((R,), jnp.float32),
        key_data=jnp.asarray(RNG.integers(0, 2**31, (R, 2)), jnp.uint32),
        counter=jnp.asarray(RNG.integers(0, 9, R), jnp.int32),
        want_logprobs=jnp.asarray(True))


@pytest.mark.parametrize("fixed", [True, False])
def test_sampler_rows_with_fixed_order_sums(fixed):
    """Tokens and logprobs of each row equal whatever rows are sampled beside it (fixed order);
    the default's logprobs are not (the test's own control)."""
    R, V = 40, 256
    z = jnp.asarray(RNG.standard_normal((R, V)) * 2, jnp.float32)
    sb = _batch(R, V)
    impl = SamplerImpl(radix_bits=1, branchy=True, fixed_order_sums=fixed, looped_passes=True)  # the CPU's
    f = jax.jit(lambda z, sb: sample(z, sb, variant=SamplerVariant(3, True), impl=impl))
    tok, lp = f(z, sb)
    same = True
    for m, o in [(8, 0), (8, 5), (16, 20), (1, 3)]:
        sub = jax.tree_util.tree_map(lambda a: a if a.ndim == 0 else a[o:o + m], sb)
        t2, lp2 = f(z[o:o + m], sub)
        same &= np.array_equal(t2, tok[o:o + m]) and all(np.array_equal(a, b[o:o + m]) for a, b in zip(lp2, lp))
    assert same == fixed


def test_logprob_outputs_fixed_order_matches():
    z = jnp.asarray(RNG.standard_normal((8, 300)), jnp.float32)
    t = jnp.asarray(RNG.integers(0, 300, 8), jnp.int32)
    for a, b in zip(logprob_outputs(z, t, fixed_order=True), logprob_outputs(z, t)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
