"""Frozen, self-validating configuration objects.

`ModelConfig` is the one description of a model's shape that every other part of jvllm reads. It is
built from a checkpoint's config.json through `transformers.AutoConfig` (so the 4.x style
`rope_theta` + `rope_scaling` and the 5.x style `rope_parameters` both work), or from a GGUF file's
metadata (see `jvllm.converters.gguf`), by `jvllm.hf_config`. Engine-side configs (`CacheConfig`, `SchedulerConfig`) live
here too; each validates itself in `__post_init__` and raises `ValueError` naming the bad value.
"""
from __future__ import annotations

import bisect
import dataclasses

from jvllm.quantization.config import QuantConfig

# freq_factors: llama.cpp's rope_freqs tensor (a GGUF of a Llama 3.1-style model stores its llama3
# scaling as one divisor per frequency, no rope.scaling keys): rope_scaling {"factors": (...)}
_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "longrope", "freq_factors")
# jvllm.ops.activations.NAMES (named here: this module imports no jax)
_ACTIVATIONS = ("silu", "swish", "gelu_pytorch_tanh", "gelu_new", "gelu", "relu", "relu2")
# activations with learned parameters: each the MLP module of the architectures named (not in
# jvllm.ops.activations)
_LEARNED_ACTIVATIONS = {"xielu": ("ApertusForCausalLM",)}  # jvllm.models.apertus
_NORM_KINDS = ("rms", "layer")
_QK_NORM_LAYOUTS = ("head", "per_head", "all")


def supported_architectures() -> tuple[str, ...]:
    """Every architecture a registered model family serves (`jvllm.models.registry`)."""
    from jvllm.models.registry import supported_architectures as archs

    return archs()
_MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM",
                      "OlmoeForCausalLM", "Glm4MoeForCausalLM", "Dots1ForCausalLM",
                      "Ernie4_5_MoeForCausalLM", "MiniMaxM2ForCausalLM", "GraniteMoeForCausalLM",
                      "GraniteMoeSharedForCausalLM", "PhimoeForCausalLM", "ExaoneMoeForCausalLM")  # jvllm.models.moe


def _freeze(d: dict | None) -> tuple | None:
    if not d:
        return None
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in d.items()))


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """The mixture-of-experts part of a model (jvllm.models.moe).

    Router (`scoring`): "softmax" over `num_experts` logits in float32, the `top_k` largest,
    renormalised to sum to one when `norm_topk_prob` (Mixtral always); or "sigmoid" (DeepSeek-V3 /
    GLM-4.5): sigmoid scores in float32, chosen by score + a learned per-expert bias
    (`correction_bias`) within the `topk_groups` best of `num_groups` expert groups (a group's
    worth: its two best biased scores), weighted by the unbiased scores (renormalised when
    `norm_topk_prob`) times `routed_scaling`; or "sparsemixer" (Phi-3.5-MoE, top-2, `jitter_eps`)
    (jvllm.models.moe_routers). Layer i is sparse iff i is
    not in `mlp_only_layers` and (i + 1) % `decoder_sparse_step` == 0; other layers keep the dense
    MLP of `intermediate_size`. `shared_expert_size` > 0 adds a shared expert, scaled by a sigmoid
    gate (Qwen2-MoE) or not (`shared_expert_gate` False: GLM-4.5's shared experts). `expert_parallel` picks the expert computation's variant under a tensor-parallel
    mesh (experts sharded over the devices, not their hidden dimension); the engine sets it from
    `enable_expert_parallel`, it changes no parameter; so does `grouped_matmul`, the expert
    matmuls' backend (jvllm.ops.grouped_matmul.BACKENDS, from the engine's `moe_backend`)."""

    num_experts: int
    top_k: int
    expert_size: int  # each expert's intermediate size (moe_intermediate_size)
    norm_topk_prob: bool = True
    shared_expert_size: int = 0
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple = ()
    expert_parallel: bool = False
    grouped_matmul: str = "xla"
    scoring: str = "softmax"
    correction_bias: bool = False
    num_groups: int = 1
    topk_groups: int = 1
    routed_scaling: float = 1.0
    shared_expert_gate: bool = True
    jitter_eps: float = 0.0  # sparsemixer's relative band (Phi-3.5-MoE's router_jitter_noise)
    norm_min: float = 0.0  # softmax renormalisation divides by max(sum of the top-k, norm_min) (ERNIE's moe_norm_min)

    def __post_init__(self):
        for f in ("num_experts", "top_k", "expert_size", "decoder_sparse_step", "num_groups", "topk_groups"):
            v = getattr(self, f)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"MoEConfig.{f} must be a positive integer, got {v!r}")
        if self.top_k > self.num_experts:
            raise ValueError(f"num_experts_per_tok ({self.top_k}) exceeds the number of experts ({self.num_experts})")
        if self.scoring not in ("softmax", "sigmoid", "sparsemixer"):
            raise ValueError(f"MoE scoring function {self.scoring!r} is not supported; supported: softmax, sigmoid, "
                             f"sparsemixer")
        if self.scoring == "sparsemixer" and self.top_k != 2:
            raise ValueError(f"the sparsemixer router picks exactly 2 experts; num_experts_per_tok is {self.top_k}")
        if self.num_experts % self.num_groups:
            raise ValueError(f"n_group ({self.num_groups}) does not divide the {self.num_experts} experts")
        if self.topk_groups > self.num_groups:
            raise ValueError(f"topk_group ({self.topk_groups}) exceeds n_group ({self.num_groups})")
        if self.num_groups > 1 and self.num_experts // self.num_groups < 2:
            raise ValueError(f"n_group ({self.num_groups}) leaves fewer than 2 experts a group (a group's worth "
                             f"is its two best scores)")
        if self.top_k > self.topk_groups * (self.num_experts // self.num_groups):
            raise ValueError(f"num_experts_per_tok ({self.top_k}) exceeds the experts of the topk_group "
                             f"({self.topk_groups}) groups kept")
        if not isinstance(self.shared_expert_size, int) or self.shared_expert_size < 0:
            raise ValueError(f"shared_expert_intermediate_size must be an integer >= 0, got {self.shared_expert_size!r}")

    def is_sparse(self, layer: int) -> bool:
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a decoder-only model of a registered family (`jvllm.models.registry`).

    `layer_windows[i]` is the sliding-window size of layer i (None = full attention); a token at
    position q attends keys k with q - window < k <= q, as in transformers. Sliding-window layers
    use `local_rope_theta` / `local_rope_scaling` when set (Gemma 3), else the global rope.

    Family variants (each read by the shared layers in `jvllm.models.layers`):
      norm_unit_offset     the norm scales by (1 + w) in float32, then casts (Gemma's RMSNorm,
                           Nemotron's LayerNorm1P)
      norm_scale_f32       RMSNorm scales by w in float32, then casts (OLMo 2; Llama casts first)
      norm_kind            "rms" (RMSNorm) or "layer" (LayerNorm: GPT-2, GPT-NeoX, Cohere);
                           `rms_norm_eps` is the epsilon of either
      norm_bias            LayerNorms have a bias (False: Cohere's)
      norm_affine          LayerNorms have a weight (and the bias of norm_bias); False: no
                           parameters at all (OLMo 1's non-parametric LayerNorm)
      mlp_gated            down(act(gate(x)) * up(x)); False: down(act(up(x))) (GPT-2, GPT-NeoX)
      parallel_residual    x + attn(norm1(x)) + mlp(norm2(x)) in one step (GPT-NeoX)
      learned_positions    absolute position embeddings added to the token embeddings, no rotary
                           embedding (GPT-2, OPT)
      position_offset      with learned_positions: position p reads row p + offset of a table of
                           max_position_embeddings + offset rows (OPT: 2)
      qk_norm_layout       the q/k norms' weights and span: "head" (each head over head_dim, one
                           [head_dim] weight: Qwen3, Gemma 3), "per_head" (each head over head_dim,
                           its own weight [heads, head_dim]: Command R+), "all" (all heads jointly,
                           [heads, head_dim]: OLMo 2, OLMoE)
      qk_norm_after_rope   the q/k norms normalise the rotated q and k (HunYuan); else before rope
      embed_scale          embeddings are multiplied by sqrt(hidden_size) in the model dtype (Gemma)
      sandwich_norms       extra norms after attention and around the MLP (Gemma 2/3)
      query_pre_attn_scalar  attention scale is its -1/2 power instead of head_dim's
      attn_logit_softcap   attention scores s -> cap * tanh(s / cap) before masking (Gemma 2)
      final_logit_softcap  logits z -> cap * tanh(z / cap) (Gemma 2)
      partial_rotary_factor  rotary embedding on the first head_dim * factor dims only
      longrope_mscale      longrope's cos / sin are scaled by the rope parameters' short_mscale
                           (positions within the original context) and long_mscale (past it)
                           instead of its attention factor (Phi-3.5-MoE)
      nope_layers          layers whose attention has no rotary embedding at all (SmolLM3's NoPE)
      rope_interleaved     rope rotates dims (2i, 2i + 1) instead of (i, i + rotary_dim/2) (Cohere, GLM)
      embedding_multiplier, residual_multiplier, attention_multiplier, logits_scaling  Granite's
                           scales: of the embeddings, of each block's output before its residual
                           add, the attention scale itself, and a divisor of the logits
      logit_scale          a multiplier of the logits (Cohere)
      lm_head_bias         the LM head has a bias [vocab] (Phi), param `lm_head_bias`
      clip_qkv             q, k and v clamped to [-clip_qkv, clip_qkv] after their projections
                           and biases, before any norm or rope (OLMo 1)
      attn_temperature_beta, attn_temperature_len  Llama 4's attention temperature (Ministral 3's
                           llama_4_scaling_beta): queries at position p are multiplied by
                           1 + beta * log(1 + floor(p / len)) after rope
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: tuple | None = None  # frozen dict: rope_type + its parameters
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v biases
    o_bias: bool = False  # o_proj bias (Llama / Qwen3 with attention_bias; never Qwen2)
    mlp_bias: bool = False
    qk_norm: bool = False
    qk_norm_layout: str = "head"
    qk_norm_after_rope: bool = False
    layer_windows: tuple = ()
    hidden_act: str = "silu"
    norm_unit_offset: bool = False
    norm_scale_f32: bool = False
    norm_kind: str = "rms"
    norm_bias: bool = True
    norm_affine: bool = True
    mlp_gated: bool = True
    parallel_residual: bool = False
    learned_positions: bool = False
    position_offset: int = 0
    embed_scale: bool = False
    sandwich_norms: bool = False
    query_pre_attn_scalar: float | None = None
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    local_rope_theta: float | None = None
    local_rope_scaling: tuple | None = None
    partial_rotary_factor: float = 1.0
    longrope_mscale: bool = False
    nope_layers: tuple = ()
    rope_interleaved: bool = False
    embedding_multiplier: float | None = None
    residual_multiplier: float | None = None
    attention_multiplier: float | None = None
    logits_scaling: float | None = None
    logit_scale: float | None = None
    lm_head_bias: bool = False
    clip_qkv: float | None = None
    attn_temperature_beta: float | None = None
    attn_temperature_len: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple = ()
    moe: MoEConfig | None = None  # mixture-of-experts layers (the MoE architectures only)
    # quantized projection weights (jvllm.quantization; None: the model dtype)
    quant: QuantConfig | None = None
    # batch-invariant mode's fixed-tile projections and LM head (an engine choice the worker sets:
    # jvllm.worker.batch_invariant, jvllm.models.layers.projection)
    batch_invariant: bool = False

    def __post_init__(self):
        if self.architecture not in supported_architectures():
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; supported: {', '.join(supported_architectures())}")
        for f in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                  "num_kv_heads", "head_dim", "max_position_embeddings"):
            v = getattr(self, f)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"ModelConfig.{f} must be a positive integer, got {v!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if not isinstance(self.position_offset, int) or self.position_offset < 0 or (
                self.position_offset and not self.learned_positions):
            raise ValueError(f"ModelConfig.position_offset must be an integer >= 0, and 0 without learned_positions; "
                             f"got {self.position_offset!r}")
        if self.attn_temperature_beta is not None and not (isinstance(self.attn_temperature_len, int)
                                                            and self.attn_temperature_len > 0):
            raise ValueError(f"attn_temperature_len must be a positive integer with attn_temperature_beta, got "
                             f"{self.attn_temperature_len!r}")
        if self.qk_norm_layout not in _QK_NORM_LAYOUTS:
            raise ValueError(f"unsupported qk_norm_layout {self.qk_norm_layout!r}; supported: {', '.join(_QK_NORM_LAYOUTS)}")
        if self.norm_kind not in _NORM_KINDS:
            raise ValueError(f"unsupported norm_kind {self.norm_kind!r}; supported: {', '.join(_NORM_KINDS)}")
        if not self.norm_affine and self.norm_kind != "layer":
            raise ValueError("norm_affine=False (norms without parameters) is implemented for LayerNorm only")
        if self.hidden_act not in _ACTIVATIONS and (
                self.architecture not in _LEARNED_ACTIVATIONS.get(self.hidden_act, ())):
            raise ValueError(f"unsupported hidden_act {self.hidden_act!r}; supported: {', '.join(_ACTIVATIONS)}")
        for f in ("query_pre_attn_scalar", "attn_logit_softcap", "final_logit_softcap", "local_rope_theta", "clip_qkv"):
            v = getattr(self, f)
            if v is not None and not (isinstance(v, (int, float)) and v > 0):
                raise ValueError(f"ModelConfig.{f} must be a positive number or None, got {v!r}")
        rot = self.head_dim * self.partial_rotary_factor
        if not (0 < self.partial_rotary_factor <= 1) or rot != int(rot) or int(rot) % 2:
            raise ValueError(f"partial_rotary_factor {self.partial_rotary_factor!r} must be in (0, 1] and give an "
                             f"even rotary dimension of head_dim {self.head_dim}")
        if len(self.layer_windows) != self.num_layers:
            object.__setattr__(self, "layer_windows", tuple([None] * self.num_layers))
        bad = [i for i in self.nope_layers if not (isinstance(i, int) and 0 <= i < self.num_layers)]
        if bad:
            raise ValueError(f"nope_layers {bad} are not layer indices of a {self.num_layers}-layer model")
        for rtype in (self.rope_type, _rope_type(self.local_rope_scaling)):
            if rtype not in _ROPE_TYPES:
                raise ValueError(f"unsupported rope scaling type {rtype!r}; supported: {', '.join(_ROPE_TYPES)}")
        if self.rope_type == "freq_factors" and len(self.rope_params.get("factors") or ()) != self.rotary_dim // 2:
            raise ValueError(f"rope freq_factors needs {self.rotary_dim // 2} factors (rotary_dim / 2), got "
                             f"{len(self.rope_params.get('factors') or ())}")
        if self.rope_type == "longrope":
            p, half = self.rope_params, self.rotary_dim // 2
            for k in ("short_factor", "long_factor"):
                if len(p.get(k) or ()) != half:
                    raise ValueError(f"longrope {k} needs {half} values (rotary_dim / 2), got "
                                     f"{len(p.get(k) or ())}")
            missing = [k for k in ("short_mscale", "long_mscale") if self.longrope_mscale and p.get(k) is None]
            if missing:
                raise ValueError(f"{self.architecture}'s longrope needs rope parameters {missing} (its cos / sin "
                                 f"scales)")
        if self.quant is not None and not isinstance(self.quant, QuantConfig):
            raise ValueError(f"ModelConfig.quant must be a jvllm.quantization.QuantConfig or None, got {self.quant!r}")
        if (self.moe is not None) != (self.architecture in _MOE_ARCHITECTURES):
            raise ValueError(f"architecture {self.architecture!r} {'needs' if self.moe is None else 'takes no'} "
                             f"mixture-of-experts settings (moe={self.moe!r})")

    # ------------------------------------------------------------------ derived
    @property
    def rope_type(self) -> str:
        return _rope_type(self.rope_scaling)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def rope_params(self) -> dict:
        return dict(self.rope_scaling or ())

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def num_params(self) -> int:
        D, I, H, K, hd, V = (self.hidden_size, self.intermediate_size, self.num_heads,
                             self.num_kv_heads, self.head_dim, self.vocab_size)
        per_layer = D * hd * (H + 2 * K) + H * hd * D + (4 if self.sandwich_norms else 2) * D
        mlp = 3 * D * I * self.num_layers
        if self.moe is not None:  # sparse layers: router + experts (+ shared expert and its gate)
            m = self.moe
            sparse = sum(m.is_sparse(i) for i in range(self.num_layers))
            moe = D * m.num_experts + 3 * D * m.expert_size * m.num_experts + (m.num_experts if m.correction_bias else 0)
            moe += (3 * D * m.shared_expert_size + (D if m.shared_expert_gate else 0)) if m.shared_expert_size else 0
            mlp += sparse * (moe - 3 * D * I)
        return V * D * (1 if self.tie_word_embeddings else 2) + self.num_layers * per_layer + mlp + D

    # ------------------------------------------------------------------ builders
    @classmethod
    def from_hf_config(cls, hf, *, generic_names: bool = False) -> "ModelConfig":
        """From a `transformers.PretrainedConfig` (4.x or 5.x style): `jvllm.hf_config.model_config_from_hf`."""
        from jvllm.hf_config import model_config_from_hf

        return model_config_from_hf(hf, generic_names=generic_names)

    @classmethod
    def from_pretrained(cls, path: str) -> "ModelConfig":
        """From a folder holding config.json (read with transformers.AutoConfig)."""
        from jvllm.hf_config import load_hf_config

        return cls.from_hf_config(load_hf_config(path))


def _rope_type(scaling: tuple | None) -> str:
    d = dict(scaling or ())
    return d.get("rope_type", d.get("type", "default")) or "default"


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """KV page pool: `num_blocks` blocks of `block_size` tokens (block 0 is the null block)."""

    block_size: int = 16
    num_blocks: int | None = None  # None: sized from memory
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    enable_prefix_caching: bool = True

    def __post_init__(self):
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128, 256):
            raise ValueError(f"block_size must be a power of two in [1, 256], got {self.block_size}")
        if not (0.0 < self.gpu_memory_utilization <= 1.0):
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ValueError(f"num_gpu_blocks_override must be >= 2 (block 0 is reserved), got {self.num_blocks}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError(f"kv_cache_memory_bytes must be > 0, got {self.kv_cache_memory_bytes}")


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """`max_num_batched_tokens` is the token budget of one micro-batch: with pipeline stages a step
    is `num_microbatches` micro-batches, each up to that budget (as vLLM's budget is per virtual
    engine), so each micro-batch fills the same bucket one step fills without stages.
    `max_num_seqs` bounds the running requests of the whole step."""
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    max_model_len: int = 2048
    num_microbatches: int = 1

    def __post_init__(self):
        for f in ("max_num_batched_tokens", "max_num_seqs", "max_model_len", "num_microbatches"):
            v = getattr(self, f)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"{f} must be a positive integer, got {v!r}")
        if self.max_num_seqs > self.max_num_batched_tokens:
            raise ValueError(f"max_num_seqs ({self.max_num_seqs}) must be <= max_num_batched_tokens "
                             f"({self.max_num_batched_tokens}): every running request needs one token a step")


def pow2_buckets(lo: int, hi: int) -> tuple[int, ...]:
    """Powers of two from `lo` up to and including `hi` (hi itself is always the last bucket)."""
    out, b = [], max(1, lo)
    while b < hi:
        out.append(b)
        b *= 2
    out.append(hi)
    return tuple(out)


def smallest_bucket(buckets: tuple[int, ...], n: int) -> int:
    """The smallest of the ascending `buckets` that holds `n` tokens (a step's program); ValueError
    past the largest. Jax-free: the scheduler (engine/bucket_fit.py) and the worker's input layout
    share it."""
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"{n} tokens exceed the largest token bucket {buckets[-1]}")
    return buckets[i]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)

