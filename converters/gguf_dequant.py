"""GGUF tensor bytes -> float32 numpy arrays.

Unquantized types (F32, F16, F64) are reinterpreted in place and cast. Q8_0 (SmolLM2's embedding),
Q4_0 and Q4_1 (its projections), Q5_0 / Q5_1 and the K-quants of a Q4_K_M / Q5_K_M file (Q4_K,
Q5_K, Q6_K; the built-in Gemma 3 mixes Q8_0, Q5_0, Q4_K and Q6_K) have kernels here that write each pass straight into the result (no per-row-group
temporaries and concatenation as in gguf's kernels; benchmarks/README.md has the speed-ups); they do
the same float32 operations in the same order as the `gguf` package's kernels (Q8_0 `q * d`, Q4_0
`d * (q - 8)`, Q4_1 / Q5_1 `d * q + m`, Q5_0 `d * (q - 16)`, Q4_K / Q5_K `(d * sc) * q - dmin * m`, Q6_K `(d * sc) * (q - 32)`,
each a separate rounding: no fused multiply-add), so the result is bit-identical (tests check every
type against `gguf.quants.dequantize`). Every other block type goes through
`gguf.quants.dequantize`. The result has the numpy shape given (the reverse of GGUF's dimension
order) and dtype float32.
"""
from __future__ import annotations

import numpy as np

_PLAIN = {"F32": np.float32, "F16": np.float16, "F64": np.float64}
_CHUNK_BLOCKS = 1 << 16  # 32-value blocks per numpy pass: bounds the temporaries (~8 MiB of float32)


def _scale(blocks: np.ndarray, at: int) -> np.ndarray:
    return blocks[:, at:at + 2].copy().view(np.float16).astype(np.float32)  # (n, 1)


def _q8_0(blocks, out):  # 2-byte f16 d, 32 int8
    np.copyto(out, blocks[:, 2:].view(np.int8), casting="unsafe")
    out *= _scale(blocks, 0)


def _nibbles(qs, out):  # 16 bytes -> 32 values: the low nibbles first, then the high ones (ggml order)
    np.bitwise_and(qs, np.uint8(0x0F), out=out[:, :16], casting="unsafe")
    np.right_shift(qs, np.uint8(4), out=out[:, 16:], casting="unsafe")


def _q4_0(blocks, out):  # 2-byte f16 d, 16 bytes of 4-bit q: d * (q - 8)
    _nibbles(blocks[:, 2:], out)
    out -= np.float32(8)
    out *= _scale(blocks, 0)


def _q4_1(blocks, out):  # 2-byte f16 d, 2-byte f16 m, 16 bytes of 4-bit q: d * q + m
    _nibbles(blocks[:, 4:], out)
    out *= _scale(blocks, 0)
    out += _scale(blocks, 2)


def _fifth_bits(qh):  # 4 bytes (a little-endian uint32): bit j is value j's 5th bit -> [n, 32] of 0 / 16
    return np.unpackbits(qh, axis=1, bitorder="little") << np.uint8(4)


def _q5_0(blocks, out):  # 2-byte f16 d, 4 bytes of 5th bits, 16 bytes of nibbles: d * (q - 16)
    _nibbles(blocks[:, 6:], out)
    out += _fifth_bits(blocks[:, 2:6])
    out -= np.float32(16)
    out *= _scale(blocks, 0)


def _q5_1(blocks, out):  # 2-byte f16 d, 2-byte f16 m, 4 bytes of 5th bits, 16 bytes of nibbles: d * q + m
    _nibbles(blocks[:, 8:], out)
    out += _fifth_bits(blocks[:, 4:8])
    out *= _scale(blocks, 0)
    out += _scale(blocks, 2)


_SHIFT2 = np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)  # Q6_K: 4 high-bit pairs per qh byte
_SHIFT1 = np.arange(8, dtype=np.uint8).reshape(1, 8, 1)  # Q5_K: bit j of qh is sub-block j's


def _k_scales(blocks):  # K-quant super-block: d, dmin, 12 bytes of 6-bit scales / mins -> [n, 8] float32 each
    d, dmin = _scale(blocks, 0), _scale(blocks, 2)
    q = blocks[:, 4:16].reshape(-1, 3, 4)
    a, b, c = q[:, 0], q[:, 1], q[:, 2]
    sc = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 2) & 0x30)], axis=1)
    mn = np.concatenate([b & 0x3F, (c >> 4) | ((b >> 2) & 0x30)], axis=1)
    return d * sc.astype(np.float32), dmin * mn.astype(np.float32)


def _q4_k(blocks, out):  # 144 bytes: d, dmin, scales[12], qs[128]; per 32 values d_j * q - m_j
    dj, mj = _k_scales(blocks)
    o = out.reshape(-1, 4, 2, 32)  # 4 groups of 32 bytes: low nibbles (sub-block 2g), then high (2g + 1)
    qs = blocks[:, 16:].reshape(-1, 4, 32)
    np.bitwise_and(qs, np.uint8(0x0F), out=o[:, :, 0], casting="unsafe")
    np.right_shift(qs, np.uint8(4), out=o[:, :, 1], casting="unsafe")
    o = out.reshape(-1, 8, 32)
    o *= dj[:, :, None]
    o -= mj[:, :, None]


def _q5_k(blocks, out):  # 176 bytes: d, dmin, scales[12], qh[32] (bit j: sub-block j's 5th bit), qs[128]
    dj, mj = _k_scales(blocks)
    o = out.reshape(-1, 4, 2, 32)  # low nibbles as Q4_K's; the 5th bit added as 16 (exact in float32)
    qs = blocks[:, 48:].reshape(-1, 4, 32)
    np.bitwise_and(qs, np.uint8(0x0F), out=o[:, :, 0], casting="unsafe")
    np.right_shift(qs, np.uint8(4), out=o[:, :, 1], casting="unsafe")
    o = out.reshape(-1, 8, 32)
    o += ((blocks[:, 16:48].reshape(-1, 1, 32) >> _SHIFT1) & np.uint8(0x01)) << np.uint8(4)
    o *= dj[:, :, None]
    o -= mj[:, :, None]


def _q6_k(blocks, out):  # 210 bytes: ql[128], qh[64], scales[16] int8, d; (6-bit q - 32) * d * scale_j per 16
    o = out.reshape(-1, 2, 2, 64)  # per 128 values: the low nibbles of ql's 64 bytes, then the high ones
    ql = blocks[:, :128].reshape(-1, 2, 64)
    np.bitwise_and(ql, np.uint8(0x0F), out=o[:, :, 0], casting="unsafe")
    np.right_shift(ql, np.uint8(4), out=o[:, :, 1], casting="unsafe")
    o = out.reshape(-1, 2, 4, 32)  # the 2 high bits, 4 per byte of qh, added as 16 * h (exact in float32)
    o += ((blocks[:, 128:192].reshape(-1, 2, 1, 32) >> _SHIFT2) & np.uint8(0x03)) << np.uint8(4)
    out -= np.float32(32)
    dj = _scale(blocks, 208) * blocks[:, 192:208].view(np.int8).astype(np.float32)
    o = out.reshape(-1, 16, 16)
    o *= dj[:, :, None]


# type -> (bytes per block, values per block, kernel(blocks, out) writing float32 into out)
_KERNELS = {"Q8_0": (34, 32, _q8_0), "Q4_0": (18, 32, _q4_0), "Q4_1": (20, 32, _q4_1),
            "Q5_0": (22, 32, _q5_0), "Q5_1": (24, 32, _q5_1),
            "Q4_K": (144, 256, _q4_k), "Q5_K": (176, 256, _q5_k), "Q6_K": (210, 256, _q6_k)}


def _blocks(raw: np.ndarray, type_size: int, block: int, fn) -> np.ndarray:
    if raw.size % type_size:
        raise ValueError(f"{raw.size} bytes are not a whole number of {type_size}-byte blocks")
    blocks = raw.reshape(-1, type_size)
    out = np.empty((blocks.shape[0], block), np.float32)
    step = _CHUNK_BLOCKS * 32 // block
    for i in range(0, blocks.shape[0], step):
        fn(blocks[i:i + step], out[i:i + step])
    return out.reshape(-1)


def dequantize(raw: np.ndarray, qtype, shape: tuple[int, ...]) -> np.ndarray:
    """`raw`: the tensor's bytes (uint8); `qtype`: a gguf.GGMLQuantizationType. Raises
    NotImplementedError when the installed gguf cannot dequantize `qtype`, ValueError when the
    byte count does not match `shape`."""
    n = int(np.prod(shape, dtype=np.int64))
    name = qtype.name
    if name in _PLAIN:
        a = raw.view(_PLAIN[name])
    elif name in _KERNELS:
        a = _blocks(raw, *_KERNELS[name])
    else:
        import gguf

        a = gguf.quants.dequantize(raw, qtype)
    if a.size != n:
        raise ValueError(f"GGUF {name} data holds {a.size} values, shape {shape} needs {n}")
    return np.asarray(a, dtype=np.float32).reshape(shape)
