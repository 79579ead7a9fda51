"""The top-p rejection tail kernel (`jvllm.ops.pallas_rejection`) in interpret mode against a
brute-force nucleus, its Triton lowering (cuda platform, traced on this CPU) and bad inputs."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jvllm.ops.pallas_rejection import finish


def _case(R, V, seed):
    rng = np.random.default_rng(seed)
    x = (rng.normal(0, 1, (R, V)) * rng.choice([0.05, 1.0, 4.0], (R, 1))).astype(np.float32)
    x[0, : V // 2] = -np.inf  # dropped by min_p / top_k
    x[1, :20] = x[1, 20:40]  # ties
    g = rng.gumbel(size=(R, V)).astype(np.float32)
    mx = x.max(1)
    e = np.exp(x - mx[:, None])
    top_p = rng.choice([0.05, 0.3, 0.9, 0.999], R).astype(np.float32)
    return x, g, mx, (top_p * e.sum(1)).astype(np.float32), e


def _nucleus_draw(x, g, e, target):
    """argmax of x + g over {j : sum(e where x > x_j) < target}, by brute force."""
    above = np.array([e[x > xj].sum() for xj in x])
    return int(np.argmax(np.where(np.isfinite(x) & (above < target), x + g, -np.inf)))


@pytest.mark.parametrize("R,V", [(12, 3000), (4, 700)])
def test_draws_the_nucleus_gumbel_max_token(R, V):
    """Rows from flat to peaked, nuclei from 5% to 99.9% of the mass (flat rows with a narrow
    nucleus take many rounds), ties and -inf tokens; rows already done (tok >= 0) are returned as
    they are; a row's `low` below its nucleus is a valid start."""
    x, g, mx, target, e = _case(R, V, R)
    tok = np.full(R, -1, np.int32)
    tok[2] = 17
    low = np.full(R, -np.inf, np.float32)
    above = np.array([e[3][x[3] > xj].sum() for xj in x[3]])
    low[3] = np.min(x[3][above >= target[3]])  # the best token outside the nucleus: x <= low is out anyway
    got = np.asarray(finish(*map(jnp.asarray, (x, g, mx, target, low, tok)), interpret=True))
    for r in range(R):
        want = 17 if r == 2 else _nucleus_draw(x[r], g[r], e[r], target[r])
        assert got[r] == want, (r, got[r], want)


def test_lowers_to_triton_for_cuda():
    args = [jax.ShapeDtypeStruct((256, 128256), jnp.float32)] * 2 + [jax.ShapeDtypeStruct((256,), jnp.float32)] * 3 \
        + [jax.ShapeDtypeStruct((256,), jnp.int32)]
    text = jax.jit(lambda *a: finish(*a, interpret=False)).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in text


def test_bad_shapes():
    x = jnp.zeros((2, 8))
    r = jnp.zeros((2,))
    with pytest.raises(ValueError, match=r"g \(2, 4\)"):
        finish(x, jnp.zeros((2, 4)), r, r, r, r.astype(jnp.int32))


def test_rows_past_the_int32_offsets_take_more_launches():
    """R * V >= 2**31 (Triton's int32 offsets): the rows are split over launches of at most
    (2**31 - 1) // V rows each (traced for the cuda platform)."""
    R, V = 2**16 + 3, 2**15
    big, row = jax.ShapeDtypeStruct((R, V), jnp.float32), jax.ShapeDtypeStruct((R,), jnp.float32)
    args = (big, big, row, row, row, jax.ShapeDtypeStruct((R,), jnp.int32))
    assert jax.eval_shape(finish, *args).shape == (R,)
    text = jax.jit(lambda *a: finish(*a, interpret=False)).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 2
