"""Mixture-of-experts FFN for decode-sized steps: every (token, choice) pair reads its own
expert's weights, with no sort by expert and no tile table. Two Pallas kernels (Triton lowering on
NVIDIA GPUs; `interpret=True` runs them on CPU for tests); the decode path of
`jvllm.ops.grouped_matmul`'s "pallas" backend.

    y = decode_ffn(x [T, D], pairs [T*k] int32, top_w [T, k], w_gate [E, D, I], w_up [E, D, I],
                   w_down [E, I, D]) -> [T, D] float32

`pairs[t*k + c]` is the (local) expert of token t's choice c, or -1 for a pair computed by no
expert (a padding token; on a sharded mesh, an expert of another device). Such pairs read no
weights and add 0. Result: sum_c top_w[t, c] * down(silu(x_t @ gate) * up), float32.

Why: the sorted path (`moe_ffn`) pays a sort, a scatter, a tile-table search, two gathers and an
inverse permutation per layer, a dozen small kernels whose launches, not bytes, bound a batch-1
step (8 experts' weights, 75 MB per Qwen3-30B-A3B layer, stream in ~25 us). Here a layer is the
router, these two kernels and one XLA reduction.

Kernels (grid (pair, column tile)): `gate_up` streams x_t's row against the expert's gate and up
column tiles, applies silu(g) * u in float32 and stores the pair's hidden row [I] in x's dtype;
`down` streams that row against the expert's down tile and stores a float32 [D] row. The k
choices are then weighted and summed in one XLA fusion, in choice order (the order of the sorted
path's combine). A Triton dot needs 16 rows: each program loads a 16-row window whose first row is
its own (the rest masked to 0, never read from memory) and stores only that row.

Hazards: a pair sharing its expert with another pair of the step reads the weights again (no
dedupe), so the cost grows with T*k: `fits` bounds it by MAX_PAIRS and by the expert count (a
batch-1 step of Mixtral's 8 experts in a bucket of 8 tokens takes the sorted path). MAX_PAIRS is
an estimate, not a measured crossover (benchmarks/README.md). Shapes with no power-of-two tile
>= 16 dividing D and I, or weights of 2**31 elements or more (Triton's int32 offsets), do not fit.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from jvllm.ops.pallas_grouped_matmul import _pow2_divisor

MAX_PAIRS = 64  # T * k at most (Qwen3-30B-A3B: 8 tokens of top-8)
WINDOW = 16  # rows of a Triton dot


@dataclasses.dataclass(frozen=True)
class Launch:
    bn: int  # columns per program
    bk: int  # K step
    num_warps: int = 4
    num_stages: int = 4


GATE_UP = Launch(bn=64, bk=128)
DOWN = Launch(bn=64, bk=128)


def _fit(launch: Launch, K: int, N: int) -> Launch | None:
    bn, bk = _pow2_divisor(N, launch.bn), _pow2_divisor(K, launch.bk)
    return None if bn is None or bk is None else dataclasses.replace(launch, bn=bn, bk=bk)


def fits(pairs: int, experts: int, D: int, I: int) -> bool:
    """Whether a step of `pairs` (token, choice) pairs over `experts` experts (all devices') takes
    this path: at most MAX_PAIRS and at most one pair per expert (beyond that, repeats are certain:
    at pairs == experts a fully valid step reads ~1.6x the distinct experts' bytes), and Triton
    tiles for D and I (the local expert size). Static shapes: decided once per compiled program."""
    return (0 < pairs <= min(MAX_PAIRS, experts) and experts * D * I < 2 ** 31  # Triton's int32 offsets
            and _fit(GATE_UP, D, I) is not None and _fit(DOWN, I, D) is not None)


def _pick(meta, i):
    lane = lax.broadcasted_iota(jnp.int32, meta.shape, 0)
    return jnp.sum(jnp.where(lane == i, meta, 0))  # vector -> scalar, Triton-safe


def _gate_up_kernel(meta_ref, x_ref, wg_ref, wu_ref, h_ref, *, bn: int, bk: int, nk: int):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    meta = meta_ref[...]                                    # [2] int32: expert (-1: none), token
    e, t = _pick(meta, 0), _pick(meta, 1)
    p, n0 = pl.program_id(0), pl.program_id(1) * bn
    first = lax.broadcasted_iota(jnp.int32, (WINDOW, bk), 0) == 0

    @pl.when(e >= 0)
    def _():
        def body(kk, acc):
            g, u = acc
            k0 = pl.multiple_of(kk * bk, bk)
            a = plgpu.load(x_ref.at[pl.ds(t, WINDOW), pl.ds(k0, bk)], mask=first, other=0)
            bg = wg_ref[pl.ds(e, 1), pl.ds(k0, bk), pl.ds(n0, bn)].reshape(bk, bn)
            bu = wu_ref[pl.ds(e, 1), pl.ds(k0, bk), pl.ds(n0, bn)].reshape(bk, bn)
            return (g + jnp.dot(a, bg, preferred_element_type=jnp.float32),
                    u + jnp.dot(a, bu, preferred_element_type=jnp.float32))

        zero = jnp.zeros((WINDOW, bn), jnp.float32)
        g, u = lax.fori_loop(0, nk, body, (zero, zero))
        h = g / (1.0 + jnp.exp(-g)) * u
        mine = lax.broadcasted_iota(jnp.int32, (WINDOW, bn), 0) == 0
        plgpu.store(h_ref.at[pl.ds(p, WINDOW), pl.ds(n0, bn)], h.astype(h_ref.dtype), mask=mine)


def _down_kernel(meta_ref, h_ref, wd_ref, y_ref, *, bn: int, bk: int, nk: int):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    meta = meta_ref[...]
    e = _pick(meta, 0)
    p, n0 = pl.program_id(0), pl.program_id(1) * bn
    first = lax.broadcasted_iota(jnp.int32, (WINDOW, bk), 0) == 0

    @pl.when(e >= 0)
    def _():
        def body(kk, acc):
            k0 = pl.multiple_of(kk * bk, bk)
            a = plgpu.load(h_ref.at[pl.ds(p, WINDOW), pl.ds(k0, bk)], mask=first, other=0)
            b = wd_ref[pl.ds(e, 1), pl.ds(k0, bk), pl.ds(n0, bn)].reshape(bk, bn)
            return acc + jnp.dot(a, b, preferred_element_type=jnp.float32)

        acc = lax.fori_loop(0, nk, body, jnp.zeros((WINDOW, bn), jnp.float32))
        mine = lax.broadcasted_iota(jnp.int32, (WINDOW, bn), 0) == 0
        plgpu.store(y_ref.at[pl.ds(p, WINDOW), pl.ds(n0, bn)], acc, mask=mine)


def _call(kernel, launch: Launch, meta, ins, out_shape, N: int, K: int, name: str, interpret: bool):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    P = meta.shape[0]
    return pl.pallas_call(
        functools.partial(kernel, bn=launch.bn, bk=launch.bk, nk=K // launch.bk),
        grid=(P, N // launch.bn),
        in_specs=[pl.BlockSpec((None, 2), lambda p, n: (p, 0))]
                 + [pl.BlockSpec(tuple(a.shape), lambda p, n, nd=a.ndim: (0,) * nd) for a in ins],
        out_specs=pl.BlockSpec(out_shape.shape, lambda p, n: (0, 0)),
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=launch.num_warps, num_stages=launch.num_stages),
        name=f"{name}_bn{launch.bn}_bk{launch.bk}",
    )(meta, *ins)


def expert_rows(x, pairs, top_w, w_gate, w_up, w_down, *, gate_up: Launch = GATE_UP, down: Launch = DOWN,
                interpret: bool | None = None):
    """The two kernels: [T*k, D] float32, row p = down(silu(x @ gate) * up) of pair p's expert;
    rows of pairs -1 are not written (hold anything: `combine` masks them). `gate_up` / `down`
    override the launches (probes). ValueError when the shapes do not fit or disagree."""
    T, D = x.shape
    k = top_w.shape[1]
    E, D2, I = w_gate.shape
    P = T * k
    if top_w.shape[0] != T or pairs.shape != (P,) or D2 != D or w_up.shape != w_gate.shape \
            or w_down.shape != (E, I, D):
        raise ValueError(f"decode_ffn: x {x.shape}, pairs {pairs.shape}, top_w {top_w.shape}, w_gate "
                         f"{w_gate.shape}, w_up {w_up.shape}, w_down {w_down.shape} disagree")
    lg, ld = _fit(gate_up, D, I), _fit(down, I, D)
    if P > MAX_PAIRS or lg is None or ld is None:
        raise ValueError(f"decode_ffn: {P} pairs (at most {MAX_PAIRS}) over D={D}, I={I} do not fit its tiles")
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    pairs = pairs.astype(jnp.int32)
    meta = jnp.stack([pairs, jnp.arange(P, dtype=jnp.int32) // k], axis=1)
    h = _call(_gate_up_kernel, lg, meta, (x, w_gate, w_up), jax.ShapeDtypeStruct((P, I), x.dtype), I, D,
              "jvllm_moe_decode_gate_up", interpret)
    return _call(_down_kernel, ld, meta, (h, w_down), jax.ShapeDtypeStruct((P, D), jnp.float32), D, I,
                 "jvllm_moe_decode_down", interpret)


def combine(rows, pairs, top_w):
    """[T*k, D] rows -> [T, D] float32: weighted sum over each token's k choices in choice order;
    rows of pairs -1 count 0 (masked, not multiplied: unwritten rows may hold NaN)."""
    T, k = top_w.shape
    y = jnp.where((pairs >= 0)[:, None], rows, 0.0).reshape(T, k, -1)
    return jnp.sum(y * top_w.astype(jnp.float32)[..., None], axis=1)


def decode_ffn(x, pairs, top_w, w_gate, w_up, w_down, **launch):
    """The module docstring's y [T, D] float32: `combine` of `expert_rows` (keywords: its launches)."""
    return combine(expert_rows(x, pairs, top_w, w_gate, w_up, w_down, **launch), pairs, top_w)
