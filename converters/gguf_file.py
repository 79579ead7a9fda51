"""A GGUF file's header, read once: metadata values, the tensor table, and each tensor's bytes.

The format (ggml docs/gguf.md, versions 2 and 3): magic `GGUF`, u32 version, u64 tensor count,
u64 metadata count; then `key (string), u32 type, value` per metadata entry; then per tensor
`name, u32 n_dims, u64 dims[n_dims] (fastest-moving first), u32 ggml type, u64 offset`; the data
section starts at the next multiple of `general.alignment` (32 by default) and each offset is
relative to it.

Why not `gguf.GGUFReader`: it builds a numpy view per array element, so a 49k-token vocabulary
costs seconds per reader. Here strings are decoded straight from the mapped bytes and numeric
arrays are one `np.frombuffer`, so the header of a model file reads in a fraction of a second.
Tensor bytes stay in the memory map until `tensor_bytes` is called.

Hazard: `GGUFFile` keeps the file mapped (read-only) while it is alive; arrays returned by
`tensor_bytes` are views of that map.
"""
from __future__ import annotations

import dataclasses
import mmap
import os
import struct

import numpy as np

from .name_map import CheckpointError

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9


@dataclasses.dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]   # ggml order: fastest-moving dimension first (reverse of numpy's)
    ggml_type: int           # gguf.GGMLQuantizationType value
    offset: int              # absolute byte offset in the file
    nbytes: int

    @property
    def numpy_shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.shape))


class GGUFFile:
    """Parsed header of one GGUF file. `fields` maps metadata keys to Python values (str, int,
    float, bool, or a list of those); `tensors` lists the tensor table in
    file order. Raises CheckpointError naming the file for a bad magic, an unsupported version,
    a header that runs past the end of the file, or an unknown value/tensor type."""

    def __init__(self, path: str):
        self.path = path
        try:
            with open(path, "rb") as f:
                self.size = os.fstat(f.fileno()).st_size
                if self.size == 0:
                    raise CheckpointError(f"{path}: cannot read GGUF file (empty file)")
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as e:
            raise CheckpointError(f"{path}: cannot read GGUF file ({e})") from None
        self._buf = memoryview(self._map)
        try:
            self._parse()
        except (struct.error, IndexError, ValueError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path}: cannot read GGUF file: header cut short or corrupt "
                                  f"({type(e).__name__}: {e})") from None

    def _parse(self):
        b = self._buf
        if bytes(b[:4]) != GGUF_MAGIC:
            raise CheckpointError(f"{self.path}: not a GGUF file (magic {bytes(b[:4])!r}, expected {GGUF_MAGIC!r})")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", b, 4)
        if version not in SUPPORTED_VERSIONS:
            raise CheckpointError(f"{self.path}: GGUF version {version} is not supported "
                                  f"(supported: {', '.join(map(str, SUPPORTED_VERSIONS))})")
        self.version = version
        pos = 24
        fields = {}
        for _ in range(n_kv):
            key, pos = self._string(pos)
            (vtype,), pos = struct.unpack_from("<I", b, pos), pos + 4
            fields[key], pos = self._value(vtype, pos, key)
        self.fields = fields
        self.metadata_end = pos  # the header up to here: magic, version, counts and every metadata entry
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        infos = []
        for _ in range(n_tensors):
            name, pos = self._string(pos)
            (n_dims,), pos = struct.unpack_from("<I", b, pos), pos + 4
            dims = struct.unpack_from(f"<{n_dims}Q", b, pos)
            pos += 8 * n_dims
            ttype, offset = struct.unpack_from("<IQ", b, pos)
            pos += 12
            try:
                qt = GGMLQuantizationType(ttype)
            except ValueError:
                raise CheckpointError(f"{self.path}: tensor {name!r} has unknown ggml type id {ttype}") from None
            block, type_size = GGML_QUANT_SIZES[qt]
            count = int(np.prod(dims, dtype=np.int64)) if dims else 1
            if count % block:
                raise CheckpointError(f"{self.path}: tensor {name!r} has {count} values, not a multiple of "
                                      f"the {qt.name} block size {block}")
            infos.append((name, tuple(int(d) for d in dims), ttype, int(offset), count // block * type_size))
        align = int(fields.get("general.alignment", 32))
        if align <= 0 or align & (align - 1):
            raise CheckpointError(f"{self.path}: general.alignment {align} is not a power of two")
        self.data_start = (pos + align - 1) // align * align
        self.tensors = [GGUFTensorInfo(n, s, t, self.data_start + o, nb) for n, s, t, o, nb in infos]

    def _string(self, pos: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", self._buf, pos)
        end = pos + 8 + n
        if end > self.size:
            raise ValueError(f"string of {n} bytes at offset {pos} runs past the end of the file")
        return bytes(self._buf[pos + 8:end]).decode("utf-8"), end

    def _value(self, vtype: int, pos: int, key: str):
        if vtype in _SCALAR:
            fmt = _SCALAR[vtype]
            return struct.unpack_from(fmt, self._buf, pos)[0], pos + struct.calcsize(fmt)
        if vtype == _STRING:
            return self._string(pos)
        if vtype == _ARRAY:
            itype, n = struct.unpack_from("<IQ", self._buf, pos)
            pos += 12
            if itype in _NUMPY:
                dt = np.dtype(_NUMPY[itype]).newbyteorder("<")
                end = pos + n * dt.itemsize
                if end > self.size:
                    raise ValueError(f"array {key!r} of {n} items runs past the end of the file")
                return np.frombuffer(self._buf[pos:end], dt).tolist(), end
            out = []
            for _ in range(n):
                v, pos = self._value(itype, pos, key)
                out.append(v)
            return out, pos
        raise CheckpointError(f"{self.path}: metadata {key!r} has unknown GGUF value type {vtype}")

    def metadata_bytes(self) -> bytes:
        """The header's raw bytes up to the tensor table (every metadata key and value)."""
        return bytes(self._buf[:self.metadata_end])

    def get(self, key: str, default=None):
        return self.fields.get(key, default)

    def tensor_bytes(self, t: GGUFTensorInfo) -> np.ndarray:
        """The tensor's raw bytes (uint8 view of the map). CheckpointError when the file is
        shorter than the tensor table says (a truncated download)."""
        if t.offset + t.nbytes > self.size:
            raise CheckpointError(f"{self.path}: truncated GGUF file: tensor {t.name!r} ends at byte "
                                  f"{t.offset + t.nbytes}, file has {self.size}")
        return np.frombuffer(self._buf, np.uint8, t.nbytes, t.offset)
