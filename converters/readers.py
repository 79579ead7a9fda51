"""Lazy tensor readers: HF safetensors (single or sharded), PyTorch .bin/.pt state dicts.

Each reader yields `(name, loader)` pairs; calling a loader reads one tensor as a numpy array
(float32 for bf16 sources, since numpy has no bf16 arithmetic worth trusting across versions).
Safetensors files are parsed here, not through torch: the header is validated against the file
size, so a truncated download is a `CheckpointError` naming the file and the byte counts.
"""
from __future__ import annotations

import json
import os
import struct
from typing import Iterator

import ml_dtypes
import numpy as np

from .name_map import CheckpointError
from .quantization import quantized_dtype_error

_ST_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,  # pre-quantized checkpoints (converters.quantization)
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}


def _to_float(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float32) if a.dtype == ml_dtypes.bfloat16 else a


def read_safetensors(path: str) -> Iterator[tuple[str, callable]]:
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header)")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8 or n > 100 * 2**20:
            raise CheckpointError(f"{path}: corrupt safetensors header length {n} (file is {size} bytes)")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path}: corrupt safetensors header ({e})") from None
    header.pop("__metadata__", None)
    data_start = 8 + n
    end = max((v["data_offsets"][1] for v in header.values()), default=0)
    if data_start + end > size:
        raise CheckpointError(f"{path}: truncated safetensors file: header needs {data_start + end} bytes, "
                              f"file has {size}")
    mm = np.memmap(path, dtype=np.uint8, mode="r") if size else None
    for name, info in header.items():
        dt = _ST_DTYPES.get(info["dtype"])
        quant = quantized_dtype_error(path, name, info["dtype"])
        if quant is not None:
            raise quant
        if dt is None:
            raise CheckpointError(f"{path}: tensor {name!r} has unsupported dtype {info['dtype']}")
        b0, b1 = info["data_offsets"]
        shape = tuple(info["shape"])
        if (b1 - b0) != int(np.prod(shape)) * np.dtype(dt).itemsize:
            raise CheckpointError(f"{path}: tensor {name!r} byte range {b0}:{b1} does not match shape {shape} "
                                  f"{info['dtype']}")

        def load(b0=b0, b1=b1, dt=dt, shape=shape):
            return _to_float(np.frombuffer(mm[data_start + b0: data_start + b1], dtype=dt).reshape(shape))

        yield name, load


def read_torch(path: str) -> Iterator[tuple[str, callable]]:
    from .deps import require_torch

    torch = require_torch(f"reading the PyTorch checkpoint {path}")
    try:
        sd = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # zip errors, pickle errors, EOF ...
        raise CheckpointError(f"{path}: cannot read PyTorch checkpoint ({type(e).__name__}: {e})") from None
    if isinstance(sd, dict) and "state_dict" in sd and isinstance(sd["state_dict"], dict):
        sd = sd["state_dict"]
    if not isinstance(sd, dict):
        raise CheckpointError(f"{path}: expected a state dict, found {type(sd).__name__}")
    for name, t in sd.items():
        if not hasattr(t, "numpy"):
            raise CheckpointError(f"{path}: entry {name!r} is not a tensor ({type(t).__name__})")
        yield name, (lambda t=t: (t.float() if t.dtype == torch.bfloat16 else t).numpy())


def _sharded(folder: str, index_name: str, reader) -> Iterator:
    with open(os.path.join(folder, index_name)) as f:
        index = json.load(f)
    files = sorted(set(index["weight_map"].values()))
    for fn in files:
        p = os.path.join(folder, fn)
        if not os.path.isfile(p):
            raise CheckpointError(f"{folder}: shard {fn!r} named in {index_name} is missing")
        yield from reader(p)


def hf_tensor_stream(folder: str) -> Iterator[tuple[str, callable]]:
    """All weight tensors of an HF checkpoint folder (safetensors preferred over .bin)."""
    ls = set(os.listdir(folder))
    if "model.safetensors.index.json" in ls:
        return _sharded(folder, "model.safetensors.index.json", read_safetensors)
    if "model.safetensors" in ls:
        return read_safetensors(os.path.join(folder, "model.safetensors"))
    if "pytorch_model.bin.index.json" in ls:
        return _sharded(folder, "pytorch_model.bin.index.json", read_torch)
    for fn in ("pytorch_model.bin", "model.pt", "pytorch_model.pt"):
        if fn in ls:
            return read_torch(os.path.join(folder, fn))
    st = sorted(f for f in ls if f.endswith(".safetensors"))
    if st:
        return (x for f in st for x in read_safetensors(os.path.join(folder, f)))
    raise CheckpointError(f"{folder}: no weights found (model.safetensors, model.safetensors.index.json, "
                          f"pytorch_model.bin or .pt)")


def safetensors_names(folder: str) -> list[str] | None:
    """The tensor names of a safetensors checkpoint folder from its index or file header (no
    tensor is read); None for a folder without safetensors."""
    ls = set(os.listdir(folder))
    if "model.safetensors.index.json" in ls:
        with open(os.path.join(folder, "model.safetensors.index.json")) as f:
            return list(json.load(f)["weight_map"])
    if "model.safetensors" not in ls:
        return None
    with open(os.path.join(folder, "model.safetensors"), "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > 100 * 2**20:
            raise CheckpointError(f"{folder}/model.safetensors: corrupt safetensors header length {n}")
        return [k for k in json.loads(f.read(n)) if k != "__metadata__"]


HEAD_TENSORS = ("lm_head.weight", "embed_out.weight")  # an untied LM head (GPT-NeoX names it embed_out)


def has_head_tensor(folder: str, config: dict) -> bool:
    """Whether the safetensors checkpoint in `folder` (config.json's dict `config`) holds an LM
    head of its own, under the text decoder's names for a multimodal wrapper. False when unknown."""
    names = safetensors_names(folder) or []
    renamed = (n for n, _ in text_decoder_stream(((n, None) for n in names), config))
    return any(n in HEAD_TENSORS for n in renamed)


MTP_LAYER_FIELDS = ("num_nextn_predict_layers", "num_mtp_layers")  # DeepSeek-V3 / GLM-4.5; transformers' name


def mtp_layers_skipped(stream, config: dict) -> Iterator[tuple[str, callable]]:
    """`stream` without the multi-token-prediction layers that DeepSeek-V3-style checkpoints store
    after the decoder stack (`model.layers.{n}.` for n >= num_hidden_layers, when config.json
    declares such layers: a field of MTP_LAYER_FIELDS > 0); they serve speculative decoding, which
    jvllm does not take from them, so they are not read. Any other checkpoint's stream unchanged."""
    import re

    n_mtp = max(int(config.get(f) or 0) for f in MTP_LAYER_FIELDS)
    layers = config.get("num_hidden_layers")
    if not n_mtp or not isinstance(layers, int):
        yield from stream
        return
    pat = re.compile(r"model\.layers\.(\d+)\.")
    for name, load in stream:
        m = pat.match(name)
        if m is None or int(m.group(1)) < layers:
            yield name, load


def text_decoder_stream(stream, config: dict) -> Iterator[tuple[str, callable]]:
    """`stream` as its text decoder's tensors when `config` (config.json) names a multimodal
    architecture served text-only (`jvllm.models.registry.TextOnly`): names renamed, the vision
    tower's tensors skipped unread; any other checkpoint's stream unchanged."""
    from jvllm.models.registry import arch_of_model_type, text_only

    wrapper = text_only((config.get("architectures") or [None])[0] or arch_of_model_type(config.get("model_type", "")))
    if wrapper is None:
        yield from stream
        return
    for name, load in stream:
        new = wrapper.rename(name)
        if new is not None:
            yield new, load
