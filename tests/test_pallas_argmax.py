"""Row argmax as a Pallas kernel (jvllm.ops.pallas_argmax), interpret mode on CPU: jnp.argmax's
ids, ties and rows of -inf included, and its Triton lowering."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jvllm.ops import pallas_argmax as pa


@pytest.mark.parametrize("R,V,chunk", [(3, 1000, 128), (5, 4099, 128), (1, 64, 128), (8, 20000, 256)])
def test_argmax_matches_jnp(R, V, chunk):
    rng = np.random.default_rng(R + V)
    x = rng.normal(size=(R, V)).astype(np.float32)
    x[0, 7] = x[0].max() + 1
    x[0, V - 3] = x[0, 7]  # a tie across chunks (and splits): the lowest index wins
    if R > 2:
        x[2, :] = -np.inf  # index 0, as jnp.argmax
    x = jnp.asarray(x)
    np.testing.assert_array_equal(np.asarray(pa.argmax(x, chunk=chunk)), np.asarray(jnp.argmax(x, axis=-1)))


def test_lowers_to_triton_for_cuda():
    args = (jax.ShapeDtypeStruct((256, 128256), jnp.float32),)
    text = jax.jit(lambda x: pa.argmax(x, interpret=False)).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match=r"float32, got \(2, 3\) bfloat16"):
        pa.argmax(jnp.zeros((2, 3), jnp.bfloat16))
