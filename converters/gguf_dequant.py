"""GGUF tensor bytes -> float32 numpy arrays.

Unquantized types (F32, F16, F64) are reinterpreted in place and cast. Q8_0 (the built-in model's
embedding), Q4_0 and Q4_1 (its projections) have kernels here that write each pass straight into
the result (no per-row-group temporaries and concatenation as in gguf's kernels, which take
about three times as long on the built-in model); they do the same float32 operations in the same
order as the `gguf` package's kernels (Q8_0 `q * d`, Q4_0 `d * (q - 8)`, Q4_1 `d * q + m`, each
a separate rounding: no fused multiply-add), so the result is bit-identical (tests check every
type against `gguf.quants.dequantize`). Every other block type goes through
`gguf.quants.dequantize`. The result has the numpy shape given (the reverse of GGUF's dimension
order) and dtype float32.
"""
from __future__ import annotations

import numpy as np

_PLAIN = {"F32": np.float32, "F16": np.float16, "F64": np.float64}
_CHUNK_BLOCKS = 1 << 16  # blocks per numpy pass: bounds the float32 temporaries (~8 MiB each)


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


# type -> (bytes per block, values per block, kernel(blocks, out) writing float32 into out)
_KERNELS = {"Q8_0": (34, 32, _q8_0), "Q4_0": (18, 32, _q4_0), "Q4_1": (20, 32, _q4_1)}


def _blocks(raw: np.ndarray, type_size: int, block: int, fn) -> np.ndarray:
    if raw.size % type_size:
        raise ValueError(f"{raw.size} bytes are not a whole number of {type_size}-byte blocks")
    blocks = raw.reshape(-1, type_size)
    out = np.empty((blocks.shape[0], block), np.float32)
    for i in range(0, blocks.shape[0], _CHUNK_BLOCKS):
        fn(blocks[i:i + _CHUNK_BLOCKS], out[i:i + _CHUNK_BLOCKS])
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
