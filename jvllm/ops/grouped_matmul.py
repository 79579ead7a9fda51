"""Mixture-of-experts FFN as grouped matmuls over tokens sorted by expert (`jax.lax.ragged_dot`).

    y = moe_ffn(x[T, D], top_idx[T, k], top_w[T, k], w_gate[E, D, I], w_up[E, D, I], w_down[E, I, D])

Every (token, choice) pair becomes one row of a static [T * k, D] buffer, sorted by expert; the
group sizes (rows per expert) are *values* computed on device, so one compiled program serves
every routing. Three ragged_dot calls (gate, up, down) do the expert work: never a Python loop over
experts, never a dense all-experts product. The rows are then weighted, put back in token order
and summed over the k choices (a reshape, not a scatter-add, so the sum order is fixed).

Sharded experts (`sharded_ffn`): the experts' leading dimension is split over one or more mesh
axes (expert parallelism) and/or each expert's hidden dimension over another (tensor
parallelism), as sharding.rules' presets say. Tokens reach the experts by "gather" (each device
takes the rows of its own experts from the replicated tokens; one psum) or "all_to_all" (each
device sends its share of the tokens to the experts' owners and back); ENGINE_ROUTING is the one
the engine uses and says why.

Backends (`backend=`, fixed at model construction): "xla" is `jax.lax.ragged_dot`; "pallas" is
jvllm's own Pallas kernel (`jvllm.ops.pallas_grouped_matmul`: Triton on GPUs, the interpreter
elsewhere, so on CPU it is for tests only); "tokamax" is `tokamax.ragged_dot` (same signature; its
Pallas kernels need the Pallas API of the jax it was released with). Hazard: upstream XLA lowers
ragged_dot on CUDA GPUs by expanding it to a zero-padded dense product over every group (its own
PRs say so), i.e. a dense all-experts product in disguise that reads every expert's weights each
step; "auto" therefore takes "pallas" on GPUs. All compute the same thing. The pallas backend's
decode-sized steps (`pallas_moe_decode.fits`: T * k small, at most one pair per expert) skip
the sort altogether: each (token, choice) pair reads its expert directly
(`jvllm.ops.pallas_moe_decode`), on one device and in the gather routing.

Hazards: a step's padding tokens must be passed as `valid=False`, else they are routed like real
ones (at batch 1 in a bucket of 8 they would double the experts read). Rows past the sum of the
group sizes (padding, other devices' experts) are set to 0 here after the matmuls rather than
trusting each backend to leave them 0.
"""
from __future__ import annotations

import sys

import jax
import jax.numpy as jnp

from jvllm.ops.activations import activation


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


def glu(g, u, act: str):
    """act(g) * u: SwiGLU (silu / swish) or GeGLU (gelu_pytorch_tanh, transformers' tanh
    approximation): any of `jvllm.ops.activations.NAMES`."""
    return activation(act)(g) * u


def _expert_mlp(xs, w_gate, w_up, w_down, sizes, backend, act):
    dot = ragged_dot_fn(backend)
    with jax.named_scope(GMM_SCOPE):
        g = dot(xs, w_gate, sizes)
        u = dot(xs, w_up, sizes)
        y = dot(glu(g, u, act).astype(xs.dtype), w_down, sizes)
    return jnp.where((jnp.arange(xs.shape[0]) < jnp.sum(sizes))[:, None], y, 0)


def _combine(ys, order, top_w, T: int, k: int):
    """Sorted rows [T*k, D] -> weighted sum over each token's k choices [T, D]."""
    # sorted position of each (token, choice) pair: the inverse permutation (a scatter, not a sort)
    inv = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    y = ys[inv].reshape(T, k, -1)
    w = top_w.astype(jnp.float32)[..., None]
    return jnp.sum(y.astype(jnp.float32) * w, axis=1)


def _decode_pairs(backend: str, top_idx, experts: int, w_gate):
    """Whether this step takes the direct decode path (`jvllm.ops.pallas_moe_decode`): the pallas
    backend at decode-sized T * k over `experts` (all devices'; static shapes: once per program)."""
    from jvllm.ops import pallas_moe_decode

    T, k = top_idx.shape
    return backend == "pallas" and pallas_moe_decode.fits(T * k, experts, w_gate.shape)


def _decode(x, top_idx, top_w, w_gate, w_up, w_down, valid, act, e0=0):
    """The decode path over experts [e0, e0 + E_local): other pairs (and invalid tokens) add 0."""
    from jvllm.ops import pallas_moe_decode as dec

    with jax.named_scope(ROUTING_SCOPE):
        local = top_idx.astype(jnp.int32) - e0
        keep = (local >= 0) & (local < w_gate.shape[0])
        if valid is not None:
            keep &= valid[:, None]
        pairs = jnp.where(keep, local, -1).reshape(-1)
    with jax.named_scope(GMM_SCOPE):
        rows = dec.expert_rows(x, pairs, top_w, w_gate, w_up, w_down, act=act)
    with jax.named_scope(ROUTING_SCOPE):
        return dec.combine(rows, pairs, top_w)


def moe_ffn(x, top_idx, top_w, w_gate, w_up, w_down, valid=None, *, backend: str = "xla", act: str = "silu"):
    """Gated experts (`glu` with `act`, the model's hidden_act) on one device. x [T, D]; top_idx/top_w [T, k]; weights [E, ...]; `valid`
    [T] bool or None (all valid). Returns [T, D] in float32 (the caller casts); 0 for invalid tokens.
    Decode-sized steps of the pallas backend skip the sort (`_decode`)."""
    T, k = top_idx.shape
    if _decode_pairs(backend, top_idx, w_gate.shape[0], w_gate):
        return _decode(x, top_idx, top_w, w_gate, w_up, w_down, valid, act)
    with jax.named_scope(ROUTING_SCOPE):
        order, sizes = sort_by_expert(top_idx, w_gate.shape[0], valid)
        xs = x[order // k]
    ys = _expert_mlp(xs, w_gate, w_up, w_down, sizes, backend, act)
    with jax.named_scope(ROUTING_SCOPE):
        return _combine(ys, order, top_w, T, k)


ROUTINGS = ("gather", "all_to_all")
# The routing the engine uses (jvllm.models.moe). Gather: attention is replicated over the "expert"
# axis and all-reduced over "tensor", so every device already holds all T tokens; each computes
# the rows of its own experts and one psum sums the partial outputs (it replaces the all-reduce a
# tensor-parallel MLP needs anyway). All-to-all sends each device's T/n tokens to the experts'
# owners and back at the dropless capacity (T/n * k rows to every peer), then all-gathers the
# tokens: k times the bytes of the psum. The choice rests on that count: fake CPU devices (the
# only measurement so far, benchmarks/probes/moe_grouped_matmul.py --routings) leaned to gather
# but are no model of a GPU interconnect; run the probe on GPUs before changing it. All-to-all
# pays off when tokens are sharded to begin with (data-parallel attention), which jvllm does not run.
ENGINE_ROUTING = "gather"


def _axes_size(mesh, axes) -> int:
    n = 1
    for a in axes:
        n *= int(dict(mesh.shape)[a])
    return n


def sharded_ffn(x, top_idx, top_w, w_gate, w_up, w_down, valid=None, *, mesh, expert_axes: tuple = (),
                hidden_axis: str | None = None, routing: str = ENGINE_ROUTING, backend: str = "xla",
                act: str = "silu"):
    """`moe_ffn` on `mesh` with the experts' leading dimension sharded over `expert_axes` (one mesh
    axis or several, major first, as in the weights' PartitionSpec) and each expert's hidden
    dimension over `hidden_axis` (gate/up split on their output, down on its input; None: whole).
    x, top_idx, top_w and valid are replicated; so is the [T, D] float32 result. `routing` is
    "gather" or "all_to_all" (module docstring of ENGINE_ROUTING). Same result as `moe_ffn` up to
    the float32 summation order. ValueError naming the numbers when the experts or their hidden
    dimension do not split, or an axis is not in the mesh. GSPMD is not trusted to split
    ragged_dot itself: the whole computation is one shard_map."""
    from jax.sharding import PartitionSpec as P

    expert_axes = tuple(expert_axes)
    for a in expert_axes + ((hidden_axis,) if hidden_axis else ()):
        if a not in dict(mesh.shape):
            raise ValueError(f"mixture of experts: mesh axis {a!r} is not in the mesh {dict(mesh.shape)}")
    if hidden_axis in expert_axes:
        raise ValueError(f"mixture of experts: mesh axis {hidden_axis!r} cannot split both the experts and their hidden dimension")
    if routing not in ROUTINGS:
        raise ValueError(f"unknown expert routing {routing!r}; known: {', '.join(ROUTINGS)}")
    n = _axes_size(mesh, expert_axes)
    E, I = w_gate.shape[0], w_gate.shape[2]
    if E % n:
        raise ValueError(f"expert parallelism: {E} experts do not split over {n} devices of mesh axes {expert_axes}")
    h = _axes_size(mesh, (hidden_axis,)) if hidden_axis else 1
    if I % h:
        raise ValueError(f"tensor parallelism: expert size {I} does not split over {h} devices of mesh axis {hidden_axis!r}")
    if valid is None:
        valid = jnp.ones((top_idx.shape[0],), bool)
    reduce_axes = expert_axes + ((hidden_axis,) if hidden_axis else ())
    ex = expert_axes if len(expert_axes) > 1 else (expert_axes[0] if expert_axes else None)
    col, row = P(ex, None, hidden_axis), P(ex, hidden_axis, None)
    if routing == "gather":
        def local(x, top_idx, top_w, valid, wg, wu, wd):
            y = _gather_local(x, top_idx, top_w, valid, wg, wu, wd, E=E, expert_axes=expert_axes, backend=backend,
                              act=act)
            return jax.lax.psum(y, reduce_axes)
    else:
        def local(x, top_idx, top_w, valid, wg, wu, wd):
            return _all_to_all_local(x, top_idx, top_w, valid, wg, wu, wd, n=n, expert_axes=expert_axes,
                                     hidden_axis=hidden_axis, backend=backend, act=act)
    return jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P(), P(), col, col, row), out_specs=P(),
                         check_vma=False)(x, top_idx, top_w, valid, w_gate, w_up, w_down)


def _shard_index(expert_axes):
    return jax.lax.axis_index(expert_axes) if expert_axes else 0


def _gather_local(x, top_idx, top_w, valid, wg, wu, wd, *, E, expert_axes, backend, act):
    """This device's partial output: all tokens, only the rows of its own experts (contiguous in
    the sorted buffer: rotated to the front from their offset; _expert_mlp zeroes the rest)."""
    T, k = top_idx.shape
    M, El = T * k, wg.shape[0]
    if _decode_pairs(backend, top_idx, E, wg):
        return _decode(x, top_idx, top_w, wg, wu, wd, valid, act, _shard_index(expert_axes) * El)
    with jax.named_scope(ROUTING_SCOPE):
        order, sizes = sort_by_expert(top_idx, E, valid)
        e0 = _shard_index(expert_axes) * El
        local_sizes = jax.lax.dynamic_slice_in_dim(sizes, e0, El)
        start = jnp.sum(jnp.where(jnp.arange(E) < e0, sizes, 0))  # first row of this device's experts
        rows = (jnp.arange(M) + start) % M
        xs = x[(order // k)[rows]]
    ys = _expert_mlp(xs, wg, wu, wd, local_sizes, backend, act)
    with jax.named_scope(ROUTING_SCOPE):
        ys = jnp.zeros_like(ys).at[rows].set(ys)  # back to sorted positions (others' rows are 0)
        return _combine(ys, order, top_w, T, k)


def _all_to_all_local(x, top_idx, top_w, valid, wg, wu, wd, *, n, expert_axes, hidden_axis, backend, act):
    """Device i of the n expert shards takes tokens [i*Tc, (i+1)*Tc) (Tc = ceil(T/n)), sends each
    (token, choice) pair to the shard owning its expert in a [n, Tc*k, D] buffer (the dropless
    capacity: every pair of the chunk may pick one shard), runs its experts on what it received,
    sends the rows back, combines its chunk and all-gathers the chunks over the expert axes."""
    T, k = top_idx.shape
    D, El = x.shape[1], wg.shape[0]
    Tc = -(-T // n)
    C = Tc * k
    pad = n * Tc - T
    with jax.named_scope(ROUTING_SCOPE):
        if pad:
            x = jnp.pad(x, ((0, pad), (0, 0)))
            top_idx, top_w = jnp.pad(top_idx, ((0, pad), (0, 0))), jnp.pad(top_w, ((0, pad), (0, 0)))
            valid = jnp.pad(valid, (0, pad))
        me = _shard_index(expert_axes)
        xc = jax.lax.dynamic_slice_in_dim(x, me * Tc, Tc)
        ic = jax.lax.dynamic_slice_in_dim(top_idx, me * Tc, Tc).reshape(-1)
        wc = jax.lax.dynamic_slice_in_dim(top_w, me * Tc, Tc)
        vc = jnp.repeat(jax.lax.dynamic_slice_in_dim(valid, me * Tc, Tc), k)
        dest = jnp.where(vc, ic // El, n)  # n: a padding pair, sent nowhere
        # slot of each pair in its destination's buffer: its rank among the pairs for that shard
        order = jnp.argsort(dest, stable=True)
        counts = jnp.zeros((n + 1,), jnp.int32).at[dest].add(1)
        first = jnp.cumsum(counts) - counts
        slot = jnp.zeros((C,), jnp.int32).at[order].set(jnp.arange(C, dtype=jnp.int32) - first[dest[order]])
        send_x = jnp.zeros((n, C, D), x.dtype).at[dest, slot].set(xc[jnp.arange(C) // k], mode="drop")
        send_e = jnp.full((n, C), El, jnp.int32).at[dest, slot].set(ic % El, mode="drop")
        recv_x = jax.lax.all_to_all(send_x, expert_axes, 0, 0, tiled=True).reshape(n * C, D)
        recv_e = jax.lax.all_to_all(send_e, expert_axes, 0, 0, tiled=True).reshape(n * C, 1)
        order2, sizes2 = sort_by_expert(recv_e, El, recv_e[:, 0] < El)
        xs = recv_x[order2]
    ys = _expert_mlp(xs, wg, wu, wd, sizes2, backend, act)
    with jax.named_scope(ROUTING_SCOPE):
        out = jnp.zeros_like(ys).at[order2].set(ys).reshape(n, C, D)
        back = jax.lax.all_to_all(out, expert_axes, 0, 0, tiled=True)  # [n, C, D]: my pairs, by owner
        ypair = jnp.where(vc[:, None], back[jnp.minimum(dest, n - 1), slot], 0).reshape(Tc, k, D)
        y = jnp.sum(ypair.astype(jnp.float32) * wc.astype(jnp.float32)[..., None], axis=1)
        if hidden_axis:
            y = jax.lax.psum(y, hidden_axis)
        y = jax.lax.all_gather(y, expert_axes, axis=0, tiled=True)
        return y[:T]
