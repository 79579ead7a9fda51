"""The fp8 KV cache's number format: pages of float8_e4m3fn with one bfloat16 scale per
(KV head, token slot), kept beside the pages in a small pool of their own.

Why per-token-per-head scales: a token's K or V row is quantized when it is written, from that row
alone, so nothing has to be calibrated up front and a row never changes once written (prefix-cache
hits, preemption and chunked prefill read exactly what a fresh run would have written). Static
per-layer scales would make the pool exactly half the bytes but need calibration data, and the
range of K and V rows can differ by orders of magnitude across tokens and heads.

Why the smallest bfloat16 at or above amax / 448: a row's largest element then lands on e4m3's
largest value (within 2^-7, so it rounds to 448) instead of anywhere in the top binade, as a
power-of-two scale puts it (up to 6% off). Keys have outlier channels that dominate q . k, so this
raised the built-in models' teacher-forced agreement with float32 KV (tests/test_kv_fp8_models.py;
figures in benchmarks/README.md).
bfloat16 keeps the layout [kv_heads, num_blocks, block_size] that JAX's Pallas GPU paged-attention
kernel takes as `k_scales_pages` / `v_scales_pages`. A slot costs head_dim bytes + 2 bytes of scale
per KV head, against 2 * head_dim bytes in bfloat16 (`jvllm.memory.kv_cache.bytes_per_block`):
1.94x the tokens at head_dim 64, 1.97x at 128.

Readers fold the scales into the attention instead of materializing dequantized pages:
scores = (q . k_fp8) * k_scale and out = sum (p * v_scale) v_fp8 in float32, which equals attention
over the dequantized rows (an fp8 value times a bfloat16 scale is exact in float32).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

FP8 = jnp.dtype(jnp.float8_e4m3fn)
FP8_MAX = 448.0                       # the largest finite float8_e4m3fn
SCALE_DTYPE = jnp.dtype(jnp.bfloat16)
_MIN_SCALE = 2.0 ** -100              # an all-zero row (the null block, padding) gets this scale


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedPages:
    """One layer's K (or V) pool in fp8: `data` [kv_heads, num_blocks, block_size, head_dim]
    float8_e4m3fn and `scale` [kv_heads, num_blocks, block_size] bfloat16 (powers of two); the row
    of slot s of head h is data[h, s] * scale[h, s]. A pytree: jit, donation, shard_map and
    device_put treat both arrays alike (shardings split the KV-head axis of both)."""
    data: jax.Array
    scale: jax.Array

    @property
    def shape(self) -> tuple:
        """The pages' shape [kv_heads, num_blocks, block_size, head_dim] (as an unquantized pool's)."""
        return self.data.shape

    @property
    def dtype(self):
        return self.data.dtype

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes) + int(self.scale.nbytes)

    def block_rows(self, blocks):
        """(data [KH, *blocks.shape, block_size, head_dim], scale [KH, *blocks.shape, block_size])
        of the pool's blocks `blocks` (an int array of block ids)."""
        return self.data[:, blocks], self.scale[:, blocks]


def quantize(x) -> tuple[jax.Array, jax.Array]:
    """x [..., head_dim] -> (q [..., head_dim] float8_e4m3fn, scale [...] bfloat16) with
    q * scale ~= x: scale is the smallest bfloat16 >= max|row| / 448, so the row's largest element
    maps to 448 and each element keeps e4m3's 3 mantissa bits (relative error <= 2^-4) down to 2^-6
    of the scaled range. NaN / inf rows give NaN / zero rows (no error is raised inside a step)."""
    xf = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(xf), axis=-1)
    s = jnp.maximum(amax / FP8_MAX, _MIN_SCALE)
    # round s up to bfloat16 on its bits (drop 16 mantissa bits, carrying into the exponent)
    bits = jax.lax.bitcast_convert_type(s, jnp.int32)
    scale = jax.lax.bitcast_convert_type((bits + 0xFFFF) & ~0xFFFF, jnp.float32)
    q = jnp.clip(xf / scale[..., None], -FP8_MAX, FP8_MAX).astype(FP8)
    return q, scale.astype(SCALE_DTYPE)


def dequantize(q, scale, dtype=jnp.float32):
    """q [..., head_dim] fp8, scale [...] -> q * scale in `dtype` (exact in float32; one rounding in
    bfloat16)."""
    return (q.astype(jnp.float32) * scale.astype(jnp.float32)[..., None]).astype(dtype)


def write(pages: QuantizedPages, new, slot_mapping) -> QuantizedPages:
    """Quantize new rows [T, kv_heads, head_dim] and scatter them and their scales into `pages` at
    `slot_mapping` (flat slots block * block_size + offset; out-of-range slots, padding, dropped)."""
    kh, nb, bs, d = pages.data.shape
    q, s = quantize(new)
    data = pages.data.reshape(kh, nb * bs, d).at[:, slot_mapping].set(q.transpose(1, 0, 2), mode="drop")
    scale = pages.scale.reshape(kh, nb * bs).at[:, slot_mapping].set(s.T, mode="drop")
    return QuantizedPages(data.reshape(kh, nb, bs, d), scale.reshape(kh, nb, bs))
