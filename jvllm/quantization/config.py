"""What a model's dense projections are stored and multiplied as (host only: no jax import).

`QuantConfig` is a field of `jvllm.config.ModelConfig` (`quant`), so every place that derives
something from a model config (declared parameters, their shardings, the converters' checks, the
step programs) sees the same choice. The engine option `quantization` ("fp8" | "int8", vLLM's
names) and a pre-quantized checkpoint's config.json (`converters.quantization.checkpoint_quant`)
both end in one `QuantConfig`, applied once by `apply_quantization`; the engine hands that resolved
`QuantConfig` to `load_checkpoint`, so the scales are quantized into the layout it declared.

Methods (the weight layout of each is `jvllm.quantization.schemes`):
  fp8        float8_e4m3fn weights, one float32 scale per output channel (or per group: below),
             weight-only by default
             (the fp8 values are converted inside the dot). `fp8_activations` (W8A8: activations
             quantized to fp8 per token at run time, an fp8 x fp8 dot with float32 accumulation,
             vLLM's fp8 on Hopper) exists, but only where the device has fp8 matmuls (NVIDIA
             compute capability >= 8.9) and only when asked for: on an H200 with jax 0.11.2 XLA
             does emit the cuBLASLt f8 GEMM, yet the projection was slower than bf16 at every
             token count measured, and W8A8 costs accuracy on small models (figures:
             benchmarks/README.md).
             Weight-only fp8 projections run on one of two backends (`QuantConfig.matmul`, from
             the engine option `fp8_matmul_backend`, decided once by `apply_quantization`): "xla"
             (the convert fused into XLA's dot) or "pallas" (jvllm.ops.pallas_matmul, a kernel that
             streams the 1-byte weights; used for steps of at most `fp8_pallas.PALLAS_MAX_TOKENS` tokens
             on one tensor-parallel device, XLA otherwise: see `Fp8Pallas`; it stores the weights
             output dims first, so it is refused for pre-quantized checkpoints). "auto" takes xla:
             pallas is faster at B1 on an H200 (1.05x), but W1 and prefill, which run XLA's einsum
             over its layout, are not measured with it (benchmarks/README.md).
  int8       int8 weights, weight-only (the int8 values are converted to the activation dtype
             inside the dot).
  fp8_block  float8_e4m3fn weights with one float32 scale per (input block, output channel),
             weight-only: the layout HF FP8 (`weight_scale_inv`) block-scaled checkpoints load
             into without requantizing. Not selectable by `quantization=`: it comes from such a
             checkpoint.
What is quantized: the attention q/k/v/o and the MLP gate/up/down projections. The embedding,
the LM head and the norms stay in the model dtype. Mixture-of-experts models are refused.
Scale layout of fp8 / int8 (`QuantConfig.group_size`, from the engine option
`quantization_group_size`, decided once here; figures behind the defaults: benchmarks/README.md):
None = one float32 scale per output channel (the default, "auto" or "channel", for both
methods); g = one float32 scale per (g rows of the projection's last contracted dim, output
channel), which must divide hidden_size, head_dim and intermediate_size (`schemes.GroupScaled`:
fp8_block's layout; fp8 groups search a few clipping ratios per group). Groups are opt-in: they
buy accuracy on small models but cost decode speed on GPUs, where the per-channel layout keeps
the int8 projection at the bf16 rate (both: benchmarks/README.md). Group scales
are weight-only and run on XLA: with fp8_activations or fp8_matmul_backend="pallas" an explicit
group size is a ValueError naming both options.
Costs: float32 scales add 4/g bytes per weight (int8 at 32: +12.5%, fp8 at 16: +25%). Hazard:
tensor parallelism shards down_proj's scale along intermediate_size / g, which must then divide
by the tensor-parallel size.
"""
from __future__ import annotations

import dataclasses

METHODS = ("fp8", "fp8_block", "int8")
GROUP_METHODS = ("fp8", "int8")  # methods that take QuantConfig.group_size
ENGINE_OPTIONS = ("fp8", "int8")  # what `quantization=` takes
MATMUL_BACKENDS = ("xla", "pallas")  # weight-only fp8 projections (QuantConfig.matmul)


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    method: str
    block_in: int | None = None   # fp8_block: input rows per scale block
    from_checkpoint: bool = False  # the checkpoint holds the quantized values (no quantization at load)
    fp8_activations: bool = False  # fp8: also quantize activations per token (W8A8); else weight-only
    matmul: str = "xla"  # weight-only fp8: "xla" | "pallas" (the module docstring)
    group_size: int | None = None  # fp8 / int8: input rows per scale (None: one scale per output channel)

    def __post_init__(self):
        if self.group_size is not None:
            g = self.group_size
            if not isinstance(g, int) or isinstance(g, bool) or g < 2:
                raise ValueError(f"QuantConfig.group_size must be an integer >= 2 (input rows per scale; None for "
                                 f"one scale per output channel), got {g!r}")
            if self.method not in GROUP_METHODS:
                raise ValueError(f"QuantConfig.group_size is for methods {', '.join(GROUP_METHODS)}, not "
                                 f"{self.method!r} (fp8_block has block_in)")
            if self.fp8_activations:
                raise ValueError(f"QuantConfig: fp8_activations (W8A8) needs one scale per output channel; "
                                 f"group_size {g} is weight-only")
            if self.matmul == "pallas":
                raise ValueError(f"fp8_matmul_backend='pallas' takes one scale per output channel, not "
                                 f"quantization_group_size={g}: pass fp8_matmul_backend='xla' (or 'auto') with "
                                 f"group scales, or quantization_group_size='channel' with pallas")
        if self.matmul not in MATMUL_BACKENDS:
            raise ValueError(f"QuantConfig.matmul must be one of {', '.join(MATMUL_BACKENDS)}, got {self.matmul!r}")
        if self.matmul == "pallas" and (self.method != "fp8" or self.fp8_activations):
            raise ValueError(f"QuantConfig: the pallas matmul is for weight-only fp8 (method 'fp8' without "
                             f"fp8_activations), not method {self.method!r} with fp8_activations={self.fp8_activations}")
        if self.method not in METHODS:
            raise ValueError(f"quantization method {self.method!r} is not one of {', '.join(METHODS)}")
        if (self.method == "fp8_block") != (self.block_in is not None):
            raise ValueError(f"QuantConfig: block_in is for fp8_block only and required there "
                             f"(method {self.method!r}, block_in {self.block_in!r})")
        if self.fp8_activations and self.method != "fp8":
            raise ValueError(f"QuantConfig: fp8_activations is for method 'fp8', not {self.method!r}")
        if self.block_in is not None and (not isinstance(self.block_in, int) or self.block_in <= 0):
            raise ValueError(f"QuantConfig.block_in must be a positive integer, got {self.block_in!r}")


def apply_quantization(cfg, quantization: str | None, fp8_activations: bool | None = None,
                       fp8_matmul_backend: str = "auto", group_size: int | str = "auto"):
    """`cfg` (a ModelConfig, `cfg.quant` set when its checkpoint is pre-quantized) with the engine
    option `quantization` applied. ValueError naming the value and what is supported: an unknown
    option, a mixture-of-experts model, an option that contradicts the checkpoint's own scheme.
    `fp8_activations` (W8A8 for method fp8): None = weight-only (the measured faster choice, see
    the module docstring); True needs a device with fp8 matmuls
    (`jvllm.quantization.fp8.fp8_matmul_supported`, which imports jax), else ValueError.
    `fp8_matmul_backend` ("auto" | "xla" | "pallas"): the weight-only fp8 projections' backend;
    "pallas" for anything but weight-only fp8 is a ValueError, "auto" picks (module docstring).
    `group_size` (the engine option `quantization_group_size`): "auto" | "channel" | an integer
    >= 2 dividing every projection's last contracted dim (module docstring)."""
    backends = ("auto", *MATMUL_BACKENDS)
    if fp8_matmul_backend not in backends:
        raise ValueError(f"fp8_matmul_backend must be one of {', '.join(backends)}; got {fp8_matmul_backend!r}")
    if group_size not in ("auto", "channel") and (not isinstance(group_size, int) or isinstance(group_size, bool)
                                                  or group_size < 2):
        raise ValueError(f"quantization_group_size must be 'auto', 'channel' or an integer >= 2 (input rows per "
                         f"scale); got {group_size!r}")
    cfg = _apply(cfg, quantization)
    quant = cfg.quant
    if quant is not None and quant.from_checkpoint and group_size != "auto":
        raise ValueError(f"quantization_group_size={group_size!r}: this checkpoint is already quantized "
                         f"({quant.method}) and brings its own scales; leave quantization_group_size='auto'")
    if quant is None or quant.method != "fp8":
        if fp8_matmul_backend == "pallas":
            raise ValueError(f"fp8_matmul_backend='pallas' needs fp8 weights (quantization='fp8'); this model's "
                             f"projections are {quant.method if quant else 'not quantized'}")
        if quant is None:
            if group_size != "auto":
                raise ValueError(f"quantization_group_size={group_size!r} needs quantization='fp8' or 'int8'")
            return cfg
        return _grouped(cfg, quant, group_size)
    from jvllm.quantization.fp8 import fp8_matmul_supported

    if fp8_activations and not fp8_matmul_supported():
        raise ValueError("fp8_activations=True (W8A8) needs fp8 matmuls (an NVIDIA GPU of compute capability "
                         ">= 8.9); this device has none")
    fp8_activations = bool(fp8_activations)
    if fp8_activations and fp8_matmul_backend == "pallas":
        raise ValueError("fp8_matmul_backend='pallas' is the weight-only fp8 matmul; fp8_activations=True (W8A8) "
                         "runs on XLA's fp8 GEMM: pass fp8_matmul_backend='auto' or 'xla' with it")
    if isinstance(group_size, int) and (fp8_activations or fp8_matmul_backend == "pallas"):
        other = "fp8_activations=True (W8A8)" if fp8_activations else "fp8_matmul_backend='pallas'"
        raise ValueError(f"quantization_group_size={group_size} is weight-only on XLA; {other} takes one scale "
                         f"per output channel: pass quantization_group_size='auto' or 'channel' with it, or "
                         f"fp8_matmul_backend='xla' (or 'auto') with group scales")
    if fp8_matmul_backend == "pallas" and quant.from_checkpoint:
        raise ValueError("fp8_matmul_backend='pallas' stores the fp8 weights output dims first, quantizing them at "
                         "load; this checkpoint is already quantized (read as stored): pass fp8_matmul_backend="
                         "'xla' or 'auto'")
    if fp8_matmul_backend == "auto":  # the measured faster backend (module docstring)
        fp8_matmul_backend = "xla"
    resolved = dataclasses.replace(quant, fp8_activations=fp8_activations, matmul=fp8_matmul_backend)
    cfg = cfg if resolved == quant else dataclasses.replace(cfg, quant=resolved)
    return cfg if quant.from_checkpoint else _grouped(cfg, resolved, group_size)


def _grouped(cfg, quant, group_size):
    """`cfg` with `quant.group_size` resolved from the option (ValueError for a size that does not
    divide a projection's last contracted dim)."""
    dims = {"hidden_size (q/k/v, gate/up)": cfg.hidden_size, "head_dim (o_proj)": cfg.head_dim,
            "intermediate_size (down_proj)": cfg.intermediate_size}
    if group_size in ("auto", "channel"):  # one scale per output channel
        return cfg
    g = group_size
    bad = {k: v for k, v in dims.items() if v % g}
    if bad:
        raise ValueError(f"quantization_group_size={g} must divide each projection's last contracted dim; "
                         f"{', '.join(f'{k} = {v}' for k, v in bad.items())} is not a multiple of {g}")
    return dataclasses.replace(cfg, quant=dataclasses.replace(quant, group_size=g))


def _apply(cfg, quantization):
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
