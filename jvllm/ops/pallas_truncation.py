"""The sampler's truncation thresholds (top_k / top_p) as one Pallas kernel (Triton lowering on
NVIDIA GPUs; `interpret=True` runs the same kernel on CPU for tests). `SamplerImpl.threshold_kernel`
selects it in `jvllm.sampling` instead of the XLA search.

Contract: `thresholds(x, mx, top_k, top_p, use_k, use_p, two=)` -> t [R] uint32, per row the
threshold key of `jvllm.sampling._thresholds` without the kernel (the same exact radix search: the largest key t
with sum(w where key >= t) >= target, w = 1 for top_k rows (target top_k) and exp(x - mx) for
top_p rows (target top_p * the row's mass); with `two`, rows using both search again for top_p
over the top_k-kept mass and keep the larger key); 0 for rows with neither (greedy rows too: the
caller passes use_k = use_p = False for them, and such rows cost nothing). x: the temperature-scaled
logits with min_p-dropped tokens at -inf, f32 [R, V]; mx [R] their row maxima.

Why: XLA runs each of the search's 32 / bits passes as its own row reduction over [R, V] with
2**bits - 1 outputs, reading the keys and the weights from memory every pass. Here one program per
row makes every pass (the row's mass, then the search's passes) over its row in `bv`-token blocks:
it reads x only, derives the key and the weight in registers and keeps 2**bits per-lane partial
sums of [bv] until the pass ends (one cross-lane reduction per pass, not per block).
Hazards: the weights use Triton's exp and the sums a blocked order, so on a GPU a threshold may
differ from the XLA search's where a candidate's mass equals the target to the last bit (the kept
set then differs by tokens of that mass; the interpreter uses XLA's exp and matches it otherwise).
One program per row: with few rows (a small batch) the row's passes run on one SM each.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

INT_MIN = -(2 ** 31)
PARAMS = 8  # per-row f32 parameters: mx, top_k, top_p, flags (bit 0 top_k, bit 1 top_p), padding


def launch_defaults(R: int) -> dict:
    """Block size and Triton launch parameters (not yet tuned: benchmarks/probes/sampler_speed.py
    --kernel-sweep measures them)."""
    return dict(bv=1024, bits=4, num_warps=8, num_stages=3)


def _signed_key(x):
    """float32 -> int32 whose signed order is the float order (`jvllm.sampling._ukey` is this with
    the sign bit flipped, as uint32)."""
    b = lax.bitcast_convert_type(x, jnp.int32)
    return b ^ ((b >> 31) & 0x7FFFFFFF)


def _umax(a, b):
    """max of two int32 scalars holding uint32 bits, in unsigned order."""
    return jnp.where((a ^ INT_MIN) > (b ^ INT_MIN), a, b)


def _kernel(par_ref, x_ref, out_ref, *, V: int, bv: int, nb: int, bits: int, two: bool):
    par = par_ref[...]                                      # [PARAMS] f32 of this row
    lane = lax.broadcasted_iota(jnp.int32, par.shape, 0)
    pick = lambda i: jnp.sum(jnp.where(lane == i, par, 0.0))  # noqa: E731  (vector -> scalar, Triton-safe)
    mx, kf, p = pick(0), pick(1), pick(2)
    flags = pick(3).astype(jnp.int32)
    use_k, use_p = (flags & 1) != 0, (flags & 2) != 0
    n = 1 << bits
    j = lax.broadcasted_iota(jnp.int32, (n,), 0)

    def block(b):
        xb = x_ref[pl.ds(pl.multiple_of(b * bv, bv), bv)]
        valid = b * bv + lax.broadcasted_iota(jnp.int32, (bv,), 0) < V
        return _signed_key(xb), jnp.where(valid, jnp.exp(xb - mx), 0.0), valid

    def mass(t=None):
        """sum of the weights exp(x - mx) (of keys >= t)."""
        def body(b, acc):
            us, e, _ = block(b)
            return acc + (e if t is None else jnp.where(us >= (t ^ INT_MIN), e, 0.0))
        return jnp.sum(lax.fori_loop(0, nb, body, jnp.zeros((bv,), jnp.float32)))

    def search(count, target):
        def one_pass(i, t):
            shift = 32 - bits - bits * i
            cs = (t | (j << shift)) ^ INT_MIN                 # the candidates as signed keys

            def body(b, acc):
                us, e, valid = block(b)
                w = jnp.where(count, valid.astype(jnp.float32), e)
                return acc + jnp.where(us[None, :] >= cs[:, None], w[None, :], 0.0)

            sums = jnp.sum(lax.fori_loop(0, nb, body, jnp.zeros((n, bv), jnp.float32)), axis=1)
            digit = jnp.sum(jnp.where((j >= 1) & (sums >= target), 1, 0))
            return t | (digit << shift)

        return lax.fori_loop(0, 32 // bits, one_pass, jnp.int32(0))

    out_ref[...] = jnp.zeros(out_ref.shape, jnp.int32)

    @pl.when(use_k | use_p)
    def _():
        t = search(use_k, jnp.where(use_k, kf, p * mass()))
        if two:
            t2 = search(False, p * mass(t))
            t = jnp.where(use_k & use_p, _umax(t, t2), t)
        out_ref[...] = jnp.broadcast_to(t, out_ref.shape)


def thresholds(x: jax.Array, mx: jax.Array, top_k: jax.Array, top_p: jax.Array, use_k: jax.Array,
               use_p: jax.Array, *, two: bool, bv: int | None = None, bits: int | None = None,
               num_warps: int | None = None, num_stages: int | None = None,
               interpret: bool | None = None) -> jax.Array:
    """Per-row threshold keys [R] uint32 (see the module docstring). Launch parameters left None
    take `launch_defaults`; `interpret` None = interpret unless the default backend is a GPU."""
    from jax.experimental.pallas import triton as plgpu

    R, V = x.shape
    d = launch_defaults(R)
    bv, bits = bv or d["bv"], bits or d["bits"]
    if bits not in (1, 2, 4):
        raise ValueError(f"thresholds: bits must be 1, 2 or 4, got {bits}")
    if bv < 16 or bv & (bv - 1):
        raise ValueError(f"thresholds: bv must be a power of two >= 16, got {bv}")
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    nb = -(-V // bv)
    xp = jnp.pad(x.astype(jnp.float32), ((0, 0), (0, nb * bv - V)), constant_values=-jnp.inf)
    flags = use_k.astype(jnp.float32) + 2.0 * use_p.astype(jnp.float32)
    zero = jnp.zeros((R,), jnp.float32)
    par = jnp.stack([mx.astype(jnp.float32), top_k.astype(jnp.float32), top_p.astype(jnp.float32), flags]
                    + [zero] * (PARAMS - 4), axis=1)
    out = pl.pallas_call(
        functools.partial(_kernel, V=V, bv=bv, nb=nb, bits=bits, two=two),
        grid=(R,),
        in_specs=[pl.BlockSpec((None, PARAMS), lambda r: (r, 0)),
                  pl.BlockSpec((None, nb * bv), lambda r: (r, 0))],
        out_specs=pl.BlockSpec((None, PARAMS), lambda r: (r, 0)),
        out_shape=jax.ShapeDtypeStruct((R, PARAMS), jnp.int32),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps or d["num_warps"],
                                             num_stages=num_stages or d["num_stages"]),
        name=f"jvllm_truncation_bv{bv}_r{bits}" + ("_two" if two else ""),
    )(par, xp)
    return lax.bitcast_convert_type(out[:, 0], jnp.uint32)
