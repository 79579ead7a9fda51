"""GGUF tensor bytes -> float32 numpy arrays.

Unquantized types (F32, F16, F64) are reinterpreted in place and cast; every block type goes
through the `gguf` package's vectorized numpy kernels (`gguf.quants.dequantize`), whose output
is the reference (tests check bit-identity per type). The result has the numpy shape given
(the reverse of GGUF's dimension order) and dtype float32.
"""
from __future__ import annotations

import numpy as np

_PLAIN = {"F32": np.float32, "F16": np.float16, "F64": np.float64}


def dequantize(raw: np.ndarray, qtype, shape: tuple[int, ...]) -> np.ndarray:
    """`raw`: the tensor's bytes (uint8); `qtype`: a gguf.GGMLQuantizationType. Raises
    NotImplementedError when the installed gguf cannot dequantize `qtype`, ValueError when the
    byte count does not match `shape`."""
    import gguf

    n = int(np.prod(shape, dtype=np.int64))
    if qtype.name in _PLAIN:
        a = raw.view(_PLAIN[qtype.name])
    else:
        a = gguf.quants.dequantize(raw, qtype)
    if a.size != n:
        raise ValueError(f"GGUF {qtype.name} data holds {a.size} values, shape {shape} needs {n}")
    return np.asarray(a, dtype=np.float32).reshape(shape)
