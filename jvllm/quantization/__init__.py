"""Quantized weights: fp8 (W8A8, per-channel weight scales, per-token activation scales), int8
(weight-only, per-channel) and fp8 block-scaled checkpoints (weight-only). `config.py` says what
is quantized and how a choice is made; `schemes.py` is the projection interface the model
layers call; `load.py` quantizes at load and handles weight updates. Pre-quantized checkpoints
are recognised by `jvllm.converters.quantization`."""
from jvllm.quantization.config import ENGINE_OPTIONS, METHODS, QuantConfig, apply_quantization  # noqa: F401
