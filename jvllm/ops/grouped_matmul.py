"""Mixture-of-experts FFN as grouped matmuls over tokens sorted by expert (`jax.lax.ragged_dot`).

    y = moe_ffn(x[T, D], top_idx[T, k], top_w[T, k], w_gate[E, D, I], w_up[E, D, I], w_down[E, I, D])

Every (token, choice) pair becomes one row of a static [T * k, D] buffer, sorted by expert; the
group sizes (rows per expert) are *values* computed on device, so one compiled program serves
every routing. Three ragged_dot calls (gate, up, down) do the expert work: never a Python loop over
experts, never a dense all-experts product. The rows are then weighted, put back in token order
and summed over the k choices (a reshape, not a scatter-add, so the sum order is fixed).

Expert parallelism (`expert_parallel_ffn`): the experts' leading dimension is sharded over the
mesh axis; each device takes the rows of its own experts (contiguous in the sorted buffer: rotated
to the front from their offset), runs the same grouped matmuls on them and the per-device partial
outputs are summed with one psum. Tokens are *gathered*, not sent by all-to-all: after attention's
all-reduce every tensor-parallel device already holds all T tokens, so no token has to move, and
the psum replaces the all-reduce a tensor-parallel MLP needs anyway. (An all-to-all pays off when
tokens are sharded over the devices, i.e. data-parallel attention, which jvllm does not run.)

Backends (`backend=`, fixed at model construction): "xla" is `jax.lax.ragged_dot`; "pallas" is
jvllm's own Pallas kernel (`jvllm.ops.pallas_grouped_matmul`: Triton on GPUs, the interpreter
elsewhere, so on CPU it is for tests only); "tokamax" is `tokamax.ragged_dot` (same signature; its
Pallas kernels need the Pallas API of the jax it was released with). Hazard: upstream XLA lowers
ragged_dot on CUDA GPUs by expanding it to a zero-padded dense product over every group (its own
PRs say so), i.e. a dense all-experts product in disguise that reads every expert's weights each
step; "auto" therefore takes "pallas" on GPUs. All compute the same thing.

Hazards: a step's padding tokens must be passed as `valid=False`, else they are routed like real
ones (at batch 1 in a bucket of 8 they would double the experts read). Rows past the sum of the
group sizes (padding, other devices' experts) are set to 0 here after the matmuls rather than
trusting each backend to leave them 0.
"""
from __future__ import annotations

import sys

import jax
import jax.numpy as jnp


def sort_by_expert(top_idx: jax.Array, num_experts: int, valid: jax.Array | None = None):
    """(order [T*k], group_sizes [E] int32): row r of the sorted buffer is pair order[r] of the
    flattened [T, k] choices (token order[r] // k); stable, so ties keep token order. Tokens with
    `valid[t]` False (a step's padding) are sorted past every group and counted in none, so the
    grouped matmuls neither compute them nor read an expert for them (their outputs are 0)."""
    if valid is not None:
        top_idx = jnp.where(valid[:, None], top_idx, num_experts)
    flat = top_idx.reshape(-1).astype(jnp.int32)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.zeros((num_experts,), jnp.int32).at[flat].add(1, mode="drop")
    return order, sizes


BACKENDS = ("xla", "pallas", "tokamax")


def ragged_dot_fn(backend: str):
    """The grouped matmul `f(lhs [M, K], rhs [G, K, N], group_sizes [G]) -> [M, N]` of `backend`;
    ValueError naming it when unknown, ImportError naming the package when tokamax is absent."""
    if backend == "xla":
        return jax.lax.ragged_dot
    if backend == "pallas":
        from jvllm.ops.pallas_grouped_matmul import grouped_matmul

        return grouped_matmul
    if backend == "tokamax":
        try:
            import tokamax
        except ImportError as e:
            raise ImportError(f"moe_backend 'tokamax' needs the tokamax package (pip install tokamax): {e}") from None
        from absl import flags

        # tokamax reads its options from absl flags and, if nobody parsed them, parses sys.argv on
        # first use, which fails on any program's own arguments (pytest's, jvllm's CLI): parse
        # none, so tokamax keeps its defaults
        if not flags.FLAGS.is_parsed():
            flags.FLAGS([sys.argv[0] if sys.argv else "jvllm"])
        return tokamax.ragged_dot
    raise ValueError(f"unknown grouped-matmul backend {backend!r}; known: {', '.join(BACKENDS)}")


# Named scopes (they reach the HLO op names and so the kernels of a profile): the expert matmuls
# and the routing around them (sort, gathers, combine), which benchmarks/probes/moe_profile_share.py
# sums; SparseMoE puts the router under ROUTING_SCOPE too.
GMM_SCOPE, ROUTING_SCOPE = "moe_grouped_matmul", "moe_routing"


def _expert_mlp(xs, w_gate, w_up, w_down, sizes, backend):
    dot = ragged_dot_fn(backend)
    with jax.named_scope(GMM_SCOPE):
        g = dot(xs, w_gate, sizes)
        u = dot(xs, w_up, sizes)
        y = dot((jax.nn.silu(g) * u).astype(xs.dtype), w_down, sizes)
    return jnp.where((jnp.arange(xs.shape[0]) < jnp.sum(sizes))[:, None], y, 0)


def _combine(ys, order, top_w, T: int, k: int):
    """Sorted rows [T*k, D] -> weighted sum over each token's k choices [T, D]."""
    # sorted position of each (token, choice) pair: the inverse permutation (a scatter, not a sort)
    inv = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    y = ys[inv].reshape(T, k, -1)
    w = top_w.astype(jnp.float32)[..., None]
    return jnp.sum(y.astype(jnp.float32) * w, axis=1)


def moe_ffn(x, top_idx, top_w, w_gate, w_up, w_down, valid=None, *, backend: str = "xla"):
    """SwiGLU experts on one device. x [T, D]; top_idx/top_w [T, k]; weights [E, ...]; `valid`
    [T] bool or None (all valid). Returns [T, D] in float32 (the caller casts); 0 for invalid tokens."""
    T, k = top_idx.shape
    with jax.named_scope(ROUTING_SCOPE):
        order, sizes = sort_by_expert(top_idx, w_gate.shape[0], valid)
        xs = x[order // k]
    ys = _expert_mlp(xs, w_gate, w_up, w_down, sizes, backend)
    with jax.named_scope(ROUTING_SCOPE):
        return _combine(ys, order, top_w, T, k)


def expert_parallel_ffn(x, top_idx, top_w, w_gate, w_up, w_down, valid=None, *, mesh, axis: str,
                        backend: str = "xla"):
    """`moe_ffn` with the experts sharded over `axis` of `mesh` (the number of experts must be a
    multiple of the axis size); x and the routing are replicated. Same result as `moe_ffn` up to
    the float32 summation order of the psum."""
    from jax.sharding import PartitionSpec as P

    n = int(dict(mesh.shape)[axis])
    E = w_gate.shape[0]
    if E % n:
        raise ValueError(f"expert parallelism: {E} experts do not split over {n} devices of mesh axis {axis!r}")
    T, k = top_idx.shape
    M = T * k
    if valid is None:
        valid = jnp.ones((T,), bool)

    def local(x, top_idx, top_w, valid, wg, wu, wd):
        El = wg.shape[0]
        with jax.named_scope(ROUTING_SCOPE):
            order, sizes = sort_by_expert(top_idx, E, valid)
            e0 = jax.lax.axis_index(axis) * El
            local_sizes = jax.lax.dynamic_slice_in_dim(sizes, e0, El)
            start = jnp.sum(jnp.where(jnp.arange(E) < e0, sizes, 0))  # first row of this device's experts
            # this device's rows rotated to the front; _expert_mlp zeroes the rows past them
            rows = (jnp.arange(M) + start) % M
            xs = x[(order // k)[rows]]
        ys = _expert_mlp(xs, wg, wu, wd, local_sizes, backend)
        with jax.named_scope(ROUTING_SCOPE):
            ys = jnp.zeros_like(ys).at[rows].set(ys)  # back to sorted positions (others' rows are 0)
            y = _combine(ys, order, top_w, T, k)
        return jax.lax.psum(y, axis)

    ex = P(axis, None, None)
    return jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P(), P(), ex, ex, ex), out_specs=P(),
                         check_vma=False)(x, top_idx, top_w, valid, w_gate, w_up, w_down)


def tensor_parallel_ffn(x, top_idx, top_w, w_gate, w_up, w_down, valid=None, *, mesh, axis: str,
                        backend: str = "xla"):
    """`moe_ffn` with every expert's hidden dimension sharded over `axis` (Megatron-style: gate
    and up split on their output, down on its input); each device runs all experts on its slice
    and one psum sums the partial outputs. GSPMD is not trusted to split ragged_dot itself."""
    from jax.sharding import PartitionSpec as P

    n = int(dict(mesh.shape)[axis])
    if w_gate.shape[2] % n:
        raise ValueError(f"tensor parallelism: expert size {w_gate.shape[2]} does not split over {n} devices "
                         f"of mesh axis {axis!r}")

    if valid is None:
        valid = jnp.ones((top_idx.shape[0],), bool)

    def local(x, top_idx, top_w, valid, wg, wu, wd):
        return jax.lax.psum(moe_ffn(x, top_idx, top_w, wg, wu, wd, valid, backend=backend), axis)

    col, row = P(None, None, axis), P(None, axis, None)
    return jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P(), P(), col, col, row), out_specs=P(),
                         check_vma=False)(x, top_idx, top_w, valid, w_gate, w_up, w_down)
