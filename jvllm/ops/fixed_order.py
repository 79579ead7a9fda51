"""Row reductions whose summation order is fixed by the row length alone: batch-invariant mode's
RMSNorm, log-softmax and sampler sums (`jvllm.worker.batch_invariant`).

Why: XLA compiles `jnp.sum(x, axis=-1)` (and the sums inside `jax.nn.log_softmax`) per program, and
how it vectorizes or tiles the row loop can depend on the number of rows, so one row summed in a
batch of 8 and in a batch of 32 may round differently (it does on CPU: tests/test_batch_invariant_ops.py).

How: `tree_sum` adds the row's halves elementwise, log2(n) times (the row zero-padded to a power of
two): x[:, :h] + x[:, h:], then again on the result. Every step is an elementwise add, which XLA
never reassociates, so each row's result is the same binary tree of additions for any number of
rows, on every backend. Cost: the same n - 1 additions as a sum, in log2(n) elementwise passes
(which XLA fuses where it can).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def tree_sum(x: jax.Array, axis: int = -1, keepdims: bool = False) -> jax.Array:
    """The sum over `axis` as a fixed pairwise tree (see the module docstring); x's dtype."""
    x = jnp.moveaxis(x, axis, -1)
    n = x.shape[-1]
    p = 1 << max(0, (n - 1).bit_length())
    if p != n:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, p - n)])
    while x.shape[-1] > 1:
        h = x.shape[-1] // 2
        x = x[..., :h] + x[..., h:]
    out = x[..., 0]
    return jnp.expand_dims(out, axis) if keepdims else out


def tree_mean(x: jax.Array, axis: int = -1, keepdims: bool = False) -> jax.Array:
    return tree_sum(x, axis, keepdims) / x.shape[axis]


def log_softmax(z: jax.Array) -> jax.Array:
    """`jax.nn.log_softmax(z, axis=-1)` with the normalizer summed by `tree_sum` (the max is exact
    in any order)."""
    s = z - jax.lax.stop_gradient(jnp.max(z, axis=-1, keepdims=True))
    return s - jnp.log(tree_sum(jnp.exp(s), keepdims=True))
