"""Recognising quantized checkpoints, so that loading one fails saying quantization is the reason.

jvllm computes with unquantized weights. It reads float32 / float16 / bfloat16 tensors (safetensors,
PyTorch .bin/.pt) and GGUF files, whose quantized types it dequantizes to the model dtype on load.
Quantized HF checkpoints (a `quantization_config` in config.json: fp8, AWQ, GPTQ, bitsandbytes,
compressed-tensors ...; fp8 tensors; AWQ/GPTQ `qweight`/`qzeros`/`scales`/`g_idx` tensors;
fp8 `weight_scale`/`input_scale` tensors) are refused with an error naming what was found and
what is supported. Checked from config.json first, before any weight is read.
"""
from __future__ import annotations

from .name_map import CheckpointError

SUPPORTED = ("jvllm loads unquantized checkpoints (float32, float16 or bfloat16 safetensors or PyTorch "
             ".bin/.pt) and GGUF files (their quantized types, e.g. Q4_0, Q4_1, Q8_0, Q4_K, are dequantized "
             "to the model dtype on load); quantized HF checkpoints (fp8, AWQ, GPTQ, bitsandbytes, "
             "compressed-tensors) are not supported yet: use the model's unquantized checkpoint or a GGUF file")

# safetensors dtypes that only quantized checkpoints use
QUANTIZED_ST_DTYPES = ("F8_E4M3", "F8_E5M2", "F8_E8M0", "F8_E4M3FNUZ", "F8_E5M2FNUZ", "F4", "F6_E2M3", "F6_E3M2")
# tensor-name suffixes of quantized linear layers (AWQ/GPTQ packed weights and their scales, fp8 scales)
QUANTIZED_SUFFIXES = (".qweight", ".qzeros", ".scales", ".g_idx", ".weight_scale", ".weight_scale_inv",
                      ".input_scale", ".weight_zero_point", ".weight_packed", ".SCB", ".absmax")


def check_hf_config(config: dict, where: str):
    """Raise CheckpointError when config.json declares a quantization (`quantization_config`)."""
    q = config.get("quantization_config")
    if q is None:
        return
    method = q.get("quant_method", "unknown") if isinstance(q, dict) else type(q).__name__
    raise CheckpointError(f"{where}: the checkpoint is quantized (config.json has quantization_config with "
                          f"quant_method={method!r}); {SUPPORTED}")


def quantized_dtype_error(where: str, tensor: str, dtype: str) -> CheckpointError | None:
    """The error for a tensor of a quantized dtype (fp8 ...), or None when `dtype` is not one."""
    if dtype not in QUANTIZED_ST_DTYPES:
        return None
    return CheckpointError(f"{where}: tensor {tensor!r} has dtype {dtype}, a quantized (fp8/fp4) checkpoint; "
                           f"{SUPPORTED}")


def quantized_name_error(tensor: str) -> CheckpointError | None:
    """The error for a tensor name of a quantized layer (AWQ/GPTQ qweight ...), or None."""
    if not tensor.endswith(QUANTIZED_SUFFIXES):
        return None
    return CheckpointError(f"tensor {tensor!r} belongs to a quantized layer (AWQ/GPTQ/fp8 naming); {SUPPORTED}")
