"""Quantized checkpoints: the two pre-quantized HF formats jvllm loads as they are, and a clear
refusal, naming what is supported, for every other one.

Loaded without requantizing (the values and scales are the checkpoint's):
  - `quantization_config.quant_method == "fp8"` (transformers' FineGrainedFP8 / DeepSeek-style):
    float8_e4m3 `weight` [out, in] and float32 `weight_scale_inv` [ceil(out/bo), ceil(in/bi)]
    (despite the name, the factor that dequantizes: w = weight * scale_inv per block), dynamic
    activations, `weight_block_size` [bo, bi]. Loaded as `fp8_block` (jvllm.quantization.fp8):
    the block scales repeated over each output block.
  - `quant_method == "compressed-tensors"` FP8-dynamic (llm-compressor's `*-FP8-dynamic`): one
    config group of 8-bit float weights with per-channel (`strategy: channel`) static scales
    `weight_scale` [out, 1] and dynamic per-token 8-bit float input activations. Loaded as `fp8`,
    which is exactly that scheme.
In both, only the LM head (and embeddings) may be left unquantized (`modules_to_not_convert` /
`ignore`); a KV-cache scheme, static activation scales, other bit widths or strategies are
refused by name. Checked from config.json first, before any weight is read.
"""
from __future__ import annotations

import functools

import ml_dtypes
import numpy as np

from .name_map import CheckpointError

SUPPORTED = ("jvllm loads unquantized checkpoints (float32, float16 or bfloat16 safetensors or PyTorch "
             ".bin/.pt), GGUF files (their quantized types, e.g. Q4_0, Q4_1, Q8_0, Q4_K, are dequantized "
             "to the model dtype on load) and two pre-quantized HF formats: quant_method 'fp8' (float8_e4m3 "
             "weights with block weight_scale_inv, dynamic activations) and 'compressed-tensors' FP8-dynamic "
             "(float8 weights with per-channel weight_scale, dynamic per-token activations); for any other "
             "use the model's unquantized checkpoint, optionally with quantization='fp8' or 'int8'")

# safetensors dtypes that only quantized checkpoints use (F8_E4M3 is read: the formats above)
QUANTIZED_ST_DTYPES = ("F8_E4M3", "F8_E5M2", "F8_E8M0", "F8_E4M3FNUZ", "F8_E5M2FNUZ", "F4", "F6_E2M3", "F6_E3M2")
# tensor-name suffixes of quantized linear layers (AWQ/GPTQ packed weights and their scales, fp8 scales)
QUANTIZED_SUFFIXES = (".qweight", ".qzeros", ".scales", ".g_idx", ".weight_scale", ".weight_scale_inv",
                      ".input_scale", ".weight_zero_point", ".weight_packed", ".SCB", ".absmax")


def _refuse(where: str, what: str):
    raise CheckpointError(f"{where}: the checkpoint is quantized ({what}); {SUPPORTED}")


def _only_head_left_out(where, method, names):
    bad = [n for n in (names or []) if "lm_head" not in n and "embed_tokens" not in n]
    if bad:
        _refuse(where, f"quant_method={method!r} leaves {bad[:4]} unquantized; jvllm quantizes every attention "
                       f"and MLP projection, only the LM head may stay unquantized")


def checkpoint_quant(config: dict, where: str):
    """The `jvllm.quantization.QuantConfig` of a pre-quantized checkpoint's config.json, None when
    it declares no quantization; CheckpointError naming what is found and what is supported."""
    from jvllm.quantization import QuantConfig

    q = config.get("quantization_config")
    if q is None:
        return None
    method = q.get("quant_method", "unknown") if isinstance(q, dict) else type(q).__name__
    if method == "fp8":
        act = q.get("activation_scheme", "dynamic")
        block = q.get("weight_block_size")
        if act != "dynamic":
            _refuse(where, f"quant_method='fp8' with activation_scheme={act!r}; only 'dynamic' is supported")
        if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
            _refuse(where, f"quant_method='fp8' with weight_block_size={block!r}; a [out, in] block size is needed")
        _only_head_left_out(where, method, q.get("modules_to_not_convert"))
        return QuantConfig("fp8_block", block_in=int(block[1]), from_checkpoint=True)
    if method == "compressed-tensors":
        groups = q.get("config_groups") or {}
        if q.get("kv_cache_scheme"):
            _refuse(where, "compressed-tensors with a kv_cache_scheme (quantized KV scales in the checkpoint)")
        if len(groups) != 1:
            _refuse(where, f"compressed-tensors with {len(groups)} config groups; FP8-dynamic has one")
        (g,) = groups.values()
        w, a = g.get("weights") or {}, g.get("input_activations") or {}
        want_w = dict(num_bits=8, type="float", strategy="channel", symmetric=True, dynamic=False)
        want_a = dict(num_bits=8, type="float", strategy="token", dynamic=True)
        for part, got, want in (("weights", w, want_w), ("input_activations", a, want_a)):
            off = {k: got.get(k) for k, v in want.items() if got.get(k) != v}
            if off:
                _refuse(where, f"compressed-tensors {part} {off}; FP8-dynamic needs {want}")
        _only_head_left_out(where, method, q.get("ignore"))
        return QuantConfig("fp8", from_checkpoint=True)
    _refuse(where, f"config.json has quantization_config with quant_method={method!r}")


def check_hf_config(config: dict, where: str):
    """Raise CheckpointError when config.json declares a quantization jvllm does not load."""
    checkpoint_quant(config, where)


def prequantized_stream(stream, config: dict):
    """The tensor stream of a pre-quantized checkpoint with each block `weight_scale_inv`
    [out blocks, in blocks] repeated over its output block ([out blocks * bo, in blocks]; the
    name map's `t_block_scale` crops it to the output size)."""
    q = config.get("quantization_config") or {}
    if q.get("quant_method") != "fp8":
        yield from stream
        return
    bo = int(q["weight_block_size"][0])
    for name, load in stream:
        if name.endswith(".weight_scale_inv"):
            yield name, (lambda load=load: np.repeat(np.asarray(load(), np.float32), bo, axis=0))
        else:
            yield name, load


def t_channel_scale(name, a, tgt, n_in):  # [out, 1] -> the output dims
    n = int(np.prod(tgt))
    if tuple(a.shape) not in ((n, 1), (n,)):
        raise CheckpointError(f"tensor {name!r}: shape {tuple(a.shape)} but a per-channel scale of this "
                              f"projection has shape ({n}, 1)")
    return np.asarray(a, np.float32).reshape(tgt)


def t_block_scale(name, a, tgt, n_in):  # [out (repeated blocks), in blocks] -> [.., in blocks, out dims]
    out, nb = int(np.prod(tgt[n_in:])), int(np.prod(tgt[:n_in]))
    if a.ndim != 2 or a.shape[1] != nb or a.shape[0] < out:
        raise CheckpointError(f"tensor {name!r}: block scales of shape {tuple(a.shape)} (output rows repeated) "
                              f"do not fit {nb} input blocks x {out} outputs of this projection")
    return np.ascontiguousarray(np.asarray(a[:out], np.float32).T).reshape(tgt)


def map_scale_name(name: str, map_weight):
    """(jvllm scale name, transform) of a checkpoint scale tensor `<layer>.weight_scale(_inv)`,
    from its weight's mapping `map_weight(<layer>.weight)`; None when `name` is no such tensor."""
    from .name_map import t_in_heads, t_out_heads, t_transpose

    for suffix, fn in ((".weight_scale_inv", t_block_scale), (".weight_scale", t_channel_scale)):
        if name.endswith(suffix):
            break
    else:
        return None
    try:
        tgt, wfn = map_weight(name[:-len(suffix)] + ".weight")
    except CheckpointError:
        return None
    if tgt is None:
        return None
    n_in = {t_in_heads: 1, t_out_heads: 2, t_transpose: 1}.get(wfn)
    if isinstance(tgt, tuple) or n_in is None:
        raise CheckpointError(f"tensor {name!r}: a pre-quantized scale of a tensor jvllm splits or reshapes on "
                              f"load ({tgt!r}); pre-quantized checkpoints are supported for unfused q/k/v/o and "
                              f"gate/up/down projections")
    return tgt + "_scale", functools.partial(fn, n_in=n_in)


def quantized_dtype_error(where: str, tensor: str, dtype: str) -> CheckpointError | None:
    """The error for a tensor of a quantized dtype jvllm does not read (fp8 e5m2, fp4 ...), or
    None when `dtype` is not one (or is float8_e4m3, read for the formats above)."""
    if dtype not in QUANTIZED_ST_DTYPES or dtype == "F8_E4M3":
        return None
    return CheckpointError(f"{where}: tensor {tensor!r} has dtype {dtype}, a quantized (fp8/fp4) checkpoint; "
                           f"{SUPPORTED}")


def unexpected_quantized_error(tensor: str, got, want) -> CheckpointError | None:
    """The error for a float8 tensor where the model wants another dtype (a quantized tensor in a
    checkpoint whose config.json declares no supported quantization), or an unquantized tensor
    where a pre-quantized model wants float8; None when the dtypes agree."""
    f8 = np.dtype(ml_dtypes.float8_e4m3fn)
    got, want = np.dtype(got), np.dtype(want)
    if (got == f8) == (want == f8):
        return None
    if got == f8:
        return CheckpointError(f"tensor {tensor!r} has dtype F8_E4M3, a quantized checkpoint, but its config.json "
                               f"declares no quantization_config; {SUPPORTED}")
    return CheckpointError(f"tensor {tensor!r} is {got.name} but this pre-quantized checkpoint's projections "
                           f"must be float8_e4m3 with a scale (config.json declares the quantization)")


def quantized_name_error(tensor: str) -> CheckpointError | None:
    """The error for a tensor name of a quantized layer (AWQ/GPTQ qweight ...), or None."""
    if not tensor.endswith(QUANTIZED_SUFFIXES):
        return None
    return CheckpointError(f"tensor {tensor!r} belongs to a quantized layer (AWQ/GPTQ/fp8 naming); {SUPPORTED}")
