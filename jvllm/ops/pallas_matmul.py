"""A weight-streaming matmul: one Pallas kernel (Triton lowering on NVIDIA GPUs; `interpret=True`
runs the same kernel on CPU for tests).

    y[M, N] = (x[M, K] @ w[K, N]) * scale[N]      (scale optional)

x is a float activation (bfloat16 on GPUs; float32 / float16 accepted); w is x's dtype or
float8_e4m3fn (`jvllm.quantization.fp8.Fp8Channel`'s layout: the fp8 value times a float32 scale
per output channel). The weight tile is converted to x's dtype in registers, products accumulate in
float32, the scale multiplies the float32 result, the output is x's dtype. That is the arithmetic of
the XLA path (`reference`), up to the order of the float32 sums.

Use: fp8 weight-only decode (small M): each program owns a [bm, bn] output block and walks its
share of K in `bk` steps, loading [bk, bn] weight tiles (row-contiguous, so wide coalesced loads)
and converting them in registers, so the 1-byte weights cross HBM once. When the N (and M) blocks
alone are too few programs to fill the GPU, K is split over `split_k` programs whose float32
partial sums are added (and scaled) by a second, tiny XLA reduction. The launch (`Launch`) comes
from `decode_launch(M, K, N)` unless given. Shapes that no power-of-two block >= 16 divides (K or N)
fall back to `reference`, decided at trace time from static shapes. (Batch-invariant mode's
fixed-tile matmul is `jvllm.ops.fixed_tile_matmul`: its tiles never depend on M and it has no
split-K.)

Grid: (M blocks, N blocks, K splits), M fastest: programs launched together share a weight tile,
so at larger M the weights are read from HBM about once and the repeats hit L2.

Hazards (Triton): blocks are powers of two >= 16 (a dot needs >= 16 rows, so M is padded to bm);
every window is in bounds (the interpreter clamps out-of-bounds slices where the GPU would read past
the array, so in-bounds windows keep both equal); float8_e4m3fn casts need compute capability
>= 8.9. The launch defaults are a starting point; benchmarks/probes/fp8_matmul.py sweeps them.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from jvllm.ops.pallas_grouped_matmul import _pow2_divisor

TARGET_PROGRAMS = 264  # decode launches split K until about 2 programs per SM of an H200 (132 SMs)
MAX_SPLIT_K = 8
_WARPS = (1, 2, 4, 8, 16)


def _pow2(v) -> bool:
    return isinstance(v, int) and v >= 16 and v & (v - 1) == 0


@dataclasses.dataclass(frozen=True)
class Launch:
    """Tile sizes (powers of two >= 16), K splits and Triton launch options of one matmul."""

    bm: int
    bn: int
    bk: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self):
        for f in ("bm", "bn", "bk"):
            if not _pow2(getattr(self, f)):
                raise ValueError(f"Launch.{f} must be a power of two >= 16, got {getattr(self, f)!r}")
        if not isinstance(self.split_k, int) or not 1 <= self.split_k <= 64:
            raise ValueError(f"Launch.split_k must be an integer in [1, 64], got {self.split_k!r}")
        if self.num_warps not in _WARPS:
            raise ValueError(f"Launch.num_warps must be one of {_WARPS}, got {self.num_warps!r}")
        if not isinstance(self.num_stages, int) or not 1 <= self.num_stages <= 8:
            raise ValueError(f"Launch.num_stages must be an integer in [1, 8], got {self.num_stages!r}")

    def check(self, K: int, N: int):
        """ValueError unless the tiles cover [K, N] exactly (bk * split_k divides K, bn divides N)."""
        if N % self.bn or K % (self.bk * self.split_k):
            raise ValueError(f"launch {self} does not tile w[{K}, {N}]: bn={self.bn} must divide N={N} and "
                             f"bk * split_k = {self.bk * self.split_k} must divide K={K}")


def row_block(M: int) -> int:
    """Rows per program of a decode launch: the smallest of 16, 32, 64 holding M (64 above)."""
    return 16 if M <= 16 else 32 if M <= 32 else 64


def decode_launch(M: int, K: int, N: int) -> Launch | None:
    """The small-M launch for x[M, K] @ w[K, N], or None when no power-of-two block >= 16 divides
    K or N (`matmul` then falls back to XLA). Column tiles of up to 128 (128 fp8 bytes: one cache line
    per weight row), K steps of up to 256, then K split in powers of two (at most MAX_SPLIT_K, each
    split a whole number of K steps) until the grid reaches TARGET_PROGRAMS."""
    bn, bk = _pow2_divisor(N, 128), _pow2_divisor(K, 256)
    if bn is None or bk is None:
        return None
    bm = row_block(M)
    programs = -(-M // bm) * (N // bn)
    split = 1
    while split < MAX_SPLIT_K and programs * split < TARGET_PROGRAMS and (K // bk) % (2 * split) == 0:
        split *= 2
    return Launch(bm, bn, bk, split, num_warps=4, num_stages=4)


def reference(x: jax.Array, w: jax.Array, scale: jax.Array | None = None) -> jax.Array:
    """The XLA formulation (Fp8Channel's weight-only path): convert w to x's dtype inside the dot,
    float32 accumulation, scale the float32 result, cast to x's dtype."""
    y = jnp.dot(x, w.astype(x.dtype), preferred_element_type=jnp.float32)
    return (y if scale is None else y * scale.astype(jnp.float32)).astype(x.dtype)


def _kernel(*refs, bm: int, bn: int, bk: int, nk: int, Mp: int, scaled: bool):
    from jax.experimental import pallas as pl

    x_ref, w_ref, *rest = refs
    s_ref, o_ref = rest if scaled else (None, rest[0])
    m0 = pl.program_id(0) * bm
    n0 = pl.program_id(1) * bn
    split = pl.program_id(2)

    def body(kk, acc):
        k0 = pl.multiple_of((split * nk + kk) * bk, bk)
        a = x_ref[pl.ds(m0, bm), pl.ds(k0, bk)]
        b = w_ref[pl.ds(k0, bk), pl.ds(n0, bn)]
        return acc + jnp.dot(a, b.astype(a.dtype), preferred_element_type=jnp.float32)

    acc = lax.fori_loop(0, nk, body, jnp.zeros((bm, bn), jnp.float32))
    if scaled:
        acc = acc * s_ref[pl.ds(n0, bn)].astype(jnp.float32)[None, :]
    o_ref[pl.ds(split * Mp + m0, bm), pl.ds(n0, bn)] = acc.astype(o_ref.dtype)


def _check(x, w, scale):
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0]:
        raise ValueError(f"pallas matmul: x must be [M, K] and w [K, N]; got x {x.shape}, w {w.shape}")
    if w.dtype not in (x.dtype, jnp.float8_e4m3fn):
        raise ValueError(f"pallas matmul: w's dtype {w.dtype} must be x's ({x.dtype}) or float8_e4m3fn")
    if scale is not None and scale.shape != (w.shape[1],):
        raise ValueError(f"pallas matmul: scale has shape {scale.shape}, expected ({w.shape[1]},)")


def _launch(x, w, scale, launch: Launch, interpret: bool | None):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    M, K = x.shape
    N = w.shape[1]
    launch.check(K, N)
    bm, S = launch.bm, launch.split_k
    Mp = -(-M // bm) * bm
    xp = x if Mp == M else jnp.pad(x, ((0, Mp - M), (0, 0)))
    scaled_in_kernel = scale is not None and S == 1
    out_dtype = x.dtype if S == 1 else jnp.float32
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    kernel = functools.partial(_kernel, bm=bm, bn=launch.bn, bk=launch.bk, nk=K // (launch.bk * S), Mp=Mp,
                               scaled=scaled_in_kernel)
    whole = lambda shape: pl.BlockSpec(shape, lambda i, j, s: (0,) * len(shape))  # noqa: E731
    operands = (xp, w) + ((scale.astype(jnp.float32),) if scaled_in_kernel else ())
    out = pl.pallas_call(
        kernel,
        grid=(Mp // bm, N // launch.bn, S),
        in_specs=[whole(a.shape) for a in operands],
        out_specs=whole((S * Mp, N)),
        out_shape=jax.ShapeDtypeStruct((S * Mp, N), out_dtype),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=launch.num_warps, num_stages=launch.num_stages),
        name=f"jvllm_matmul_bm{bm}_bn{launch.bn}_bk{launch.bk}_s{S}",
    )(*operands)
    if S == 1:
        return out[:M]
    y = jnp.sum(out.reshape(S, Mp, N)[:, :M], axis=0)
    return (y if scale is None else y * scale.astype(jnp.float32)).astype(x.dtype)


def matmul(x: jax.Array, w: jax.Array, scale: jax.Array | None = None, *, launch: Launch | None = None,
           interpret: bool | None = None) -> jax.Array:
    """(x[M, K] @ w[K, N]) * scale[N] in x's dtype (module docstring: the decode form). `launch`
    None takes `decode_launch(M, K, N)`, and shapes it cannot tile fall back to `reference`; a given
    launch that does not tile the shape is a ValueError. `interpret` None = interpret unless the
    default backend is a GPU."""
    _check(x, w, scale)
    if x.shape[0] == 0:
        return jnp.zeros((0, w.shape[1]), x.dtype)
    if launch is None:
        launch = decode_launch(x.shape[0], *w.shape)
        if launch is None:
            return reference(x, w, scale)
    return _launch(x, w, scale, launch, interpret)
