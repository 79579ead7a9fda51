"""Quantized weights: fp8 (weight-only by default, W8A8 opt-in) and int8 (weight-only), each with
per-channel or group scales, and fp8 block-scaled checkpoints (weight-only). `config.py` says what
is quantized and how a choice is made; `schemes.py` is the projection interface the model
layers call; `load.py` quantizes at load and handles weight updates. Pre-quantized checkpoints
are recognised by `jvllm.converters.quantization`."""
from jvllm.quantization.config import ENGINE_OPTIONS, METHODS, QuantConfig, apply_quantization  # noqa: F401
