"""What a model's dense projections are stored and multiplied as (host only: no jax import).

`QuantConfig` is a field of `jvllm.config.ModelConfig` (`quant`), so every place that derives
something from a model config (declared parameters, their shardings, the converters' checks, the
step programs) sees the same choice. The engine option `quantization` ("fp8" | "int8", vLLM's
names) and a pre-quantized checkpoint's config.json (`converters.quantization.checkpoint_quant`)
both end in one `QuantConfig`, applied once by `apply_quantization`.

Methods (the weight layout of each is `jvllm.quantization.schemes`):
  fp8        float8_e4m3fn weights, one float32 scale per output channel; activations quantized
             to fp8 per token at run time, the dot is fp8 x fp8 with float32 accumulation.
  int8       int8 weights, one float32 scale per output channel, weight-only (the int8 values
             are converted to the activation dtype inside the dot).
  fp8_block  float8_e4m3fn weights with one float32 scale per (input block, output channel),
             weight-only: the layout HF FP8 (`weight_scale_inv`) block-scaled checkpoints load
             into without requantizing. Not selectable by `quantization=`: it comes from such a
             checkpoint.
What is quantized: the attention q/k/v/o and the MLP gate/up/down projections. The embedding,
the LM head and the norms stay in the model dtype. Mixture-of-experts models are refused.
"""
from __future__ import annotations

import dataclasses

METHODS = ("fp8", "fp8_block", "int8")
ENGINE_OPTIONS = ("fp8", "int8")  # what `quantization=` takes


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    method: str
    block_in: int | None = None   # fp8_block: input rows per scale block
    from_checkpoint: bool = False  # the checkpoint holds the quantized values (no quantization at load)

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"quantization method {self.method!r} is not one of {', '.join(METHODS)}")
        if (self.method == "fp8_block") != (self.block_in is not None):
            raise ValueError(f"QuantConfig: block_in is for fp8_block only and required there "
                             f"(method {self.method!r}, block_in {self.block_in!r})")
        if self.block_in is not None and (not isinstance(self.block_in, int) or self.block_in <= 0):
            raise ValueError(f"QuantConfig.block_in must be a positive integer, got {self.block_in!r}")


def apply_quantization(cfg, quantization: str | None):
    """`cfg` (a ModelConfig, `cfg.quant` set when its checkpoint is pre-quantized) with the engine
    option `quantization` applied. ValueError naming the value and what is supported: an unknown
    option, a mixture-of-experts model, an option that contradicts the checkpoint's own scheme."""
    if quantization is not None and quantization not in ENGINE_OPTIONS:
        raise ValueError(f"quantization must be one of {', '.join(ENGINE_OPTIONS)} (or None); got {quantization!r}")
    if cfg.quant is not None:  # a pre-quantized checkpoint decides
        if quantization not in (None, "fp8") or not cfg.quant.method.startswith("fp8"):
            raise ValueError(f"quantization={quantization!r}: this checkpoint is already quantized "
                             f"({cfg.quant.method}); pass quantization=None or 'fp8' for it")
        return cfg
    if quantization is None:
        return cfg
    if cfg.moe is not None:
        raise ValueError(f"quantization={quantization!r} is not implemented for mixture-of-experts models "
                         f"({cfg.architecture}: the experts' grouped matmuls have no quantized variant)")
    return dataclasses.replace(cfg, quant=QuantConfig(quantization))
