"""Mixture-of-experts FFN for decode-sized steps: every (token, choice) pair reads its own
expert's weights, with no sort by expert and no tile table. Two Pallas kernels (Triton lowering on
NVIDIA GPUs; `interpret=True` runs them on CPU for tests); the decode path of
`jvllm.ops.grouped_matmul`'s "pallas" backend.

    y = decode_ffn(x [T, D], pairs [T*k] int32, top_w [T, k], w_gate [E, D, I], w_up [E, D, I],
                   w_down [E, I, D]) -> [T, D] float32

`pairs[t*k + c]` is the (local) expert of token t's choice c, or -1 for a pair computed by no
expert (a padding token; on a sharded mesh, an expert of another device). Such pairs read no
weights and add 0. Result: sum_c top_w[t, c] * down(silu(x_t @ gate) * up), float32.

Why: the sorted path (`moe_ffn`) runs a sort, a scatter, a tile-table search, two gathers and an
inverse permutation around its grouped matmuls, about a dozen small kernels per layer for the few
experts a batch-1 step touches; here a layer is the router, these two kernels and one XLA
reduction (whether that is faster on a GPU: benchmarks/README.md).

Kernels (one `_kernel`, grid (pair, column tile)): `gate_up` streams x_t's row against the expert's gate and up
column tiles, applies act(g) * u (`grouped_matmul.glu`) in float32 and stores the pair's hidden row [I] in x's dtype;
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

from jvllm.ops.grouped_matmul import glu
from jvllm.ops.pallas_grouped_matmul import _pow2_divisor, pick

MAX_PAIRS = 64  # T * k at most (Qwen3-30B-A3B: 8 tokens of top-8)
WINDOW = 16  # rows of a Triton dot


@dataclasses.dataclass(frozen=True)
class Launch:
    bn: int  # columns per program
    bk: int  # K step
    num_warps: int = 4
    num_stages: int = 4


# 32-column tiles: a batch-1 step has few working pairs (top_k of them), so narrower tiles give
# more programs streaming weights at once; 256-deep K steps with 3 stages (chosen by
# `moe_figures.sh decode_tune`, benchmarks/README.md)
GATE_UP = Launch(bn=32, bk=256, num_warps=4, num_stages=3)
DOWN = Launch(bn=32, bk=256, num_warps=4, num_stages=3)


def _fit(launch: Launch, K: int, N: int) -> Launch | None:
    bn, bk = _pow2_divisor(N, launch.bn), _pow2_divisor(K, launch.bk)
    return None if bn is None or bk is None else dataclasses.replace(launch, bn=bn, bk=bk)


def fits(pairs: int, experts: int, w_shape: tuple[int, int, int]) -> bool:
    """Whether a step of `pairs` (token, choice) pairs over `experts` experts (all devices') takes
    this path with this device's gate weight of `w_shape` [E_local, D, I_local]: at most MAX_PAIRS
    and at most one pair per expert (beyond that, repeats are certain: at pairs == experts a fully
    valid step reads ~1.6x the distinct experts' bytes), Triton tiles for D and I, and fewer than
    2**31 weight elements (Triton's int32 offsets). Static shapes: decided once per program."""
    E, D, I = w_shape
    return (0 < pairs <= min(MAX_PAIRS, experts) and E * D * I < 2 ** 31
            and _fit(GATE_UP, D, I) is not None and _fit(DOWN, I, D) is not None)


def _kernel(meta_ref, a_ref, *refs, bn: int, bk: int, nk: int, act: str | None):
    """Program (pair, column tile): meta [2] = (expert or -1, the input row); refs are the weights
    (gate and up when `act` names the gate's activation, else down) then the output, of which the
    pair's own row is stored."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    w_refs, o_ref = refs[:-1], refs[-1]
    meta = meta_ref[...]
    e, row = pick(meta, 0), pick(meta, 1)
    p, n0 = pl.program_id(0), pl.program_id(1) * bn
    first = lax.broadcasted_iota(jnp.int32, (WINDOW, bk), 0) == 0

    @pl.when(e >= 0)
    def _():
        def body(kk, accs):
            k0 = pl.multiple_of(kk * bk, bk)
            a = plgpu.load(a_ref.at[pl.ds(row, WINDOW), pl.ds(k0, bk)], mask=first, other=0)
            return tuple(acc + jnp.dot(a, w[pl.ds(e, 1), pl.ds(k0, bk), pl.ds(n0, bn)].reshape(bk, bn),
                                       preferred_element_type=jnp.float32) for acc, w in zip(accs, w_refs))

        accs = lax.fori_loop(0, nk, body, tuple(jnp.zeros((WINDOW, bn), jnp.float32) for _ in w_refs))
        y = glu(accs[0], accs[1], act) if act else accs[0]
        mine = lax.broadcasted_iota(jnp.int32, (WINDOW, bn), 0) == 0
        plgpu.store(o_ref.at[pl.ds(p, WINDOW), pl.ds(n0, bn)], y.astype(o_ref.dtype), mask=mine)


def _call(launch: Launch, meta, ins, out_shape, N: int, K: int, act: str | None, name: str, interpret: bool):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    P = meta.shape[0]
    return pl.pallas_call(
        functools.partial(_kernel, bn=launch.bn, bk=launch.bk, nk=K // launch.bk, act=act),
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
                interpret: bool | None = None, act: str = "silu"):
    """The two kernels: [T*k, D] float32, row p = down(glu(x @ gate, x @ up, act)) of pair p's expert
    (`act`: the experts' hidden_act, `grouped_matmul.glu`);
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
    ids = jnp.arange(P, dtype=jnp.int32)
    h = _call(lg, jnp.stack([pairs, ids // k], axis=1), (x, w_gate, w_up), jax.ShapeDtypeStruct((P, I), x.dtype),
              I, D, act, "jvllm_moe_decode_gate_up", interpret)  # input row: the pair's token
    return _call(ld, jnp.stack([pairs, ids], axis=1), (h, w_down), jax.ShapeDtypeStruct((P, D), jnp.float32),
                 D, I, None, "jvllm_moe_decode_down", interpret)  # input row: the pair's hidden row


def combine(rows, pairs, top_w):
    """[T*k, D] rows -> [T, D] float32: weighted sum over each token's k choices in choice order;
    rows of pairs -1 count 0 (masked, not multiplied: unwritten rows may hold NaN)."""
    T, k = top_w.shape
    y = jnp.where((pairs >= 0)[:, None], rows, 0.0).reshape(T, k, -1)
    return jnp.sum(y * top_w.astype(jnp.float32)[..., None], axis=1)


def decode_ffn(x, pairs, top_w, w_gate, w_up, w_down, **launch):
    """The module docstring's y [T, D] float32: `combine` of `expert_rows` (keywords: its launches)."""
    return combine(expert_rows(x, pairs, top_w, w_gate, w_up, w_down, **launch), pairs, top_w)
