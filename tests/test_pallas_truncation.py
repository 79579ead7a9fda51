"""The sampler's Pallas truncation kernel (interpret mode on CPU) against the XLA radix search:
the same per-row threshold keys and the same drawn ids."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jvllm import sampling as S
from jvllm.ops.pallas_truncation import thresholds


def _batch(R, V, seed):
    rng = np.random.default_rng(seed)
    kinds = rng.integers(0, 6, R)  # 0 none, 1 top_k, 2 top_p, 3 both, 4 greedy with top_p, 5 min_p + top_p
    temp = np.where(kinds == 4, 0.0, rng.uniform(0.5, 1.5, R)).astype(np.float32)
    top_k = np.where((kinds == 1) | (kinds == 3), rng.integers(1, V, R), V).astype(np.int32)
    top_p = np.where(np.isin(kinds, (2, 3, 4, 5)), rng.uniform(0.05, 0.99, R), 1.0).astype(np.float32)
    min_p = np.where(kinds == 5, 0.05, 0.0).astype(np.float32)
    keys = np.stack([np.zeros(R), np.arange(R) + seed], 1)
    return S.SamplingBatch(jnp.asarray(temp), jnp.asarray(top_k), jnp.asarray(top_p), jnp.asarray(min_p),
                           jnp.asarray(keys, jnp.uint32), jnp.full((R,), 7, jnp.int32), jnp.asarray(False))


def _processed(logits, sb):
    """x, mx, e, u and greedy as `jvllm.sampling._draw` computes them before the search."""
    greedy = sb.temperature <= 0.0
    x = logits / jnp.where(greedy, 1.0, jnp.maximum(sb.temperature, 1e-5))[:, None]
    mx = jnp.max(x, axis=-1)
    e = jnp.exp(x - mx[:, None])
    drop = e < sb.min_p[:, None]
    x = jnp.where(drop, -jnp.inf, x)
    return x, mx, jnp.where(drop, 0.0, e), S._ukey(x), greedy


@pytest.mark.parametrize("bits,bv,search", [(4, 64, 1), (4, 16, 2), (2, 128, 2), (1, 64, 1)])
def test_thresholds_equal_xla_search(bits, bv, search):
    R, V = 12, 1000  # V not a multiple of bv: the padded tail must not count
    for seed in range(2):
        logits = jnp.asarray(np.random.default_rng(seed).normal(0, 3, (R, V)).astype(np.float32))
        if seed == 1:  # many exact ties
            logits = jnp.round(logits)
        sb = _batch(R, V, seed)
        x, mx, e, u, greedy = _processed(logits, sb)
        v = S.SamplerVariant(search, logprobs=False)
        want = S._thresholds(x, mx, e, u, sb, v, S.SamplerImpl(), greedy)
        use_k, use_p = (sb.top_k < V) & ~greedy, (sb.top_p < 1.0) & ~greedy
        got = jax.jit(functools.partial(thresholds, two=search == 2, bits=bits, bv=bv, interpret=True))(
            x, mx, sb.top_k, sb.top_p, use_k, use_p)
        want = np.where(np.asarray(use_k | use_p), np.asarray(want), 0)
        np.testing.assert_array_equal(np.asarray(got), want, err_msg=f"seed {seed}")
        assert np.all(np.asarray(got)[~np.asarray(use_k | use_p)] == 0)


def test_kernel_sampler_draws_the_same_ids():
    R, V = 16, 777
    logits = jnp.asarray(np.random.default_rng(3).normal(0, 2, (R, V)).astype(np.float32))
    sb = _batch(R, V, 5)
    v = S.SamplerVariant(2, logprobs=True)
    ref = jax.jit(functools.partial(S.sample, variant=v, impl=S.SamplerImpl()))(logits, sb)
    got = jax.jit(functools.partial(S.sample, variant=v, impl=S.SamplerImpl(threshold_kernel=True)))(logits, sb)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(ref[0]))
    np.testing.assert_array_equal(np.asarray(got[1][2]), np.asarray(ref[1][2]))
    # below threshold_kernel_min_rows the XLA search runs (same ids either way)
    small = S.SamplerImpl(threshold_kernel=True, threshold_kernel_min_rows=R + 1)
    got2 = jax.jit(functools.partial(S.sample, variant=v, impl=small))(logits, sb)
    np.testing.assert_array_equal(np.asarray(got2[0]), np.asarray(ref[0]))


def test_kernel_rejects_bad_launch_and_impl():
    x = jnp.zeros((2, 64), jnp.float32)
    z = jnp.zeros((2,), jnp.float32)
    i = jnp.zeros((2,), jnp.int32)
    b = jnp.zeros((2,), bool)
    with pytest.raises(ValueError, match="bits must be 1, 2 or 4, got 3"):
        thresholds(x, z, i, z, b, b, two=False, bits=3, interpret=True)
    with pytest.raises(ValueError, match="bv must be a power of two >= 16, got 48"):
        thresholds(x, z, i, z, b, b, two=False, bv=48, interpret=True)
    with pytest.raises(ValueError, match="threshold_kernel excludes"):
        S.SamplerImpl(threshold_kernel=True, fixed_order_sums=True)
