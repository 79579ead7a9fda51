"""The tail of the sampler's top-p rejection draw on GPUs: one Pallas program per row (Triton
lowering; `interpret=True` runs the same kernel on CPU for tests) finishing the rows the XLA
rounds left unresolved, with a device-side loop (an XLA `while` on a GPU copies its predicate to
the host every trip, which would block the dispatcher).

    finish(x [R, V] f32, g [R, V] f32, mx [R], target [R], low [R], tok [R] i32) -> tok [R] i32

Per row with tok >= 0: tok, untouched (the program exits at once). Per row with tok < 0: rounds of
    j = argmax over {x > low} of x + g      (first index of the largest, as jnp.argmax)
    above = sum of exp(x - mx) over {x > x_j}
    accept j if above < target, else low = x_j
until one is accepted (`jvllm.sampling` gives why this draws the Gumbel-max token of the top-p
set). Each round reads the row twice in BLOCK-wide steps. A row without any x > low (impossible
for inputs the sampler builds: its best token is always accepted) returns the first index.
Hazards (Triton): int32 offsets, so each launch takes at most (2**31 - 1) // V rows (more rows: one
launch per such slice); rounds are sequential per row, so a
narrow nucleus over a flat row takes several (each rejection drops every token at or below the
rejected one, so their count grows like a binary search's, not like the vocabulary).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

BLOCK = 2048
NUM_WARPS = 4


def _kernel(x_ref, g_ref, mx_ref, target_ref, low_ref, tok_ref, o_ref, *, V: int, B: int):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    r = pl.program_id(0)
    nb = -(-V // B)
    mx, target = mx_ref[r], target_ref[r]
    neg = jnp.float32(-jnp.inf)

    def block(i):
        idx = i * B + lax.broadcasted_iota(jnp.int32, (B,), 0)
        m = idx < V
        xb = plgpu.load(x_ref.at[r, pl.ds(i * B, B)], mask=m, other=neg)
        return idx, m, xb

    def best_above(low):
        def body(i, c):
            best, bi, bx = c
            idx, m, xb = block(i)
            gb = plgpu.load(g_ref.at[r, pl.ds(i * B, B)], mask=m, other=0.0)
            s = jnp.where(m & (xb > low), xb + gb, neg)
            top = jnp.max(s)
            first = jnp.min(jnp.where(s == top, idx, jnp.int32(2**31 - 1)))
            xf = jnp.max(jnp.where(idx == first, xb, neg))
            up = top > best
            return jnp.where(up, top, best), jnp.where(up, first, bi), jnp.where(up, xf, bx)

        return lax.fori_loop(0, nb, body, (neg, jnp.int32(0), neg))

    def mass_above(xj):
        def body(i, acc):
            _, m, xb = block(i)
            return acc + jnp.sum(jnp.where(m & (xb > xj), jnp.exp(xb - mx), 0.0))

        return lax.fori_loop(0, nb, body, jnp.float32(0.0))

    def round_(c):
        low, tok, _ = c
        best, j, xj = best_above(low)
        ok = (best == neg) | (mass_above(xj) < target)
        return jnp.where(ok, low, xj), jnp.where(ok, j, tok), ok.astype(jnp.int32)

    tok0 = tok_ref[r]
    _, tok, _ = lax.while_loop(lambda c: c[2] == 0, round_, (low_ref[r], tok0, (tok0 >= 0).astype(jnp.int32)))
    o_ref[r] = tok


def finish(x, g, mx, target, low, tok, *, interpret: bool | None = None):
    """The token of every row (module docstring); `interpret` None = interpret unless the default
    backend is a GPU. ValueError on shapes that do not match. Rows past the int32 offset limit go
    to further launches of the same kernel."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    R, V = x.shape
    if g.shape != (R, V) or any(a.shape != (R,) for a in (mx, target, low, tok)):
        raise ValueError(f"finish: x and g must be [R, V] and the row values [R]; got x {x.shape}, g {g.shape}, "
                         f"mx {mx.shape}, target {target.shape}, low {low.shape}, tok {tok.shape}")
    step = (2**31 - 1) // V
    if R > step:
        return jnp.concatenate([finish(x[i:i + step], g[i:i + step], mx[i:i + step], target[i:i + step],
                                       low[i:i + step], tok[i:i + step], interpret=interpret) for i in range(0, R, step)])
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    f32 = jnp.float32
    return pl.pallas_call(
        functools.partial(_kernel, V=V, B=min(BLOCK, max(16, 1 << (V - 1).bit_length()))),
        grid=(R,),
        out_shape=jax.ShapeDtypeStruct((R,), jnp.int32),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=1),
        name="jvllm_top_p_rejection_tail",
    )(x.astype(f32), g.astype(f32), mx.astype(f32), target.astype(f32), low.astype(f32), tok.astype(jnp.int32))
