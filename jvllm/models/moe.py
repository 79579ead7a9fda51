"""Mixture-of-experts families in Flax NNX: Mixtral (top-2 of 8), Qwen2-MoE (shared expert behind
a sigmoid gate, qkv bias), Qwen3-MoE (top-8 of 128, q/k norms, `norm_topk_prob`), OLMoE, GLM-4.5
(sigmoid router with a selection bias over expert groups, ungated shared experts, dense first
layers).

Attention, norms, embedding and head are the Llama family's (jvllm.models.llama); only the
feed-forward of a sparse layer differs (`ModelConfig.moe.is_sparse(i)`; other layers keep the dense
MLP). Forward contract: as `LlamaForCausalLM`.

Parameter layout of a sparse layer's `mlp` (logical axes in brackets):
  router [embed, router]; expert_gate / expert_up [expert, embed, moe_mlp]; expert_down
  [expert, moe_mlp, embed]; Qwen2-MoE adds shared_expert.{gate,up,down}_proj (a dense MLP) and
  shared_expert_gate [embed]; GLM-4.5 the shared expert without its gate and router_bias [router]
  (float32).
The expert computation is jvllm.ops.grouped_matmul (tokens sorted by expert, ragged_dot). On a
stage mesh ("expert", "tensor") the mesh axes the experts and their hidden dimension are split
over are fixed at construction from the sharding preset (`jvllm.sharding.moe_mesh_axes`, chosen
by `cfg.moe.expert_parallel`), the same entries that shard the parameters; partial outputs are
summed with one psum (grouped_matmul.ENGINE_ROUTING).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jvllm.config import ModelConfig
from jvllm.models.layers import MLP, Attention, declare, norm
from jvllm.quantization.schemes import DENSE
from jvllm.models.llama import DecoderLayer, LlamaForCausalLM
from jvllm.models.moe_routers import router_for
from jvllm.ops import grouped_matmul as gm
from jvllm.ops.attention import _TP_MESH



def configure_moe(cfg: ModelConfig, expert_parallel: bool = False, backend: str = "auto") -> ModelConfig:
    """`cfg` with the engine's choices for its experts: `expert_parallel` (enable_expert_parallel)
    and the grouped-matmul `backend` (moe_backend: "auto" = jvllm's Pallas kernel on GPUs, else "xla"; see
    jvllm.ops.grouped_matmul). A dense model is returned unchanged with
    the defaults and refused, naming the option, otherwise."""
    if backend not in ("auto", *gm.BACKENDS):
        raise ValueError(f"moe_backend must be one of auto, {', '.join(gm.BACKENDS)}; got {backend!r}")
    if cfg.moe is None:
        if expert_parallel:
            raise ValueError(f"enable_expert_parallel needs a mixture-of-experts model; {cfg.architecture} has no experts")
        if backend != "auto":
            raise ValueError(f"moe_backend={backend!r} needs a mixture-of-experts model; {cfg.architecture} has no experts")
        return cfg
    if backend == "auto":
        backend = "pallas" if jax.default_backend() == "gpu" else "xla"
    gm.ragged_dot_fn(backend)  # unknown name / missing package: fail now, not at the first trace
    return dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, expert_parallel=bool(expert_parallel),
                                                            grouped_matmul=backend))


class SharedExpertMLP(MLP):
    """Qwen2-MoE's shared expert: a SwiGLU MLP of `shared_expert_size`."""

    def __init__(self, cfg: ModelConfig, dtype):
        D, I = cfg.hidden_size, cfg.moe.shared_expert_size
        self.proj = DENSE  # MoE models are never quantized (jvllm.quantization.config)
        self.gate_proj = declare((D, I), ("embed", "mlp"), dtype)
        self.up_proj = declare((D, I), ("embed", "mlp"), dtype)
        self.down_proj = declare((I, D), ("mlp", "embed"), dtype)
        self.gate_proj_scale = self.up_proj_scale = self.down_proj_scale = None
        self.has_bias = False
        self.act = cfg.hidden_act


class SparseMoE(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype):
        m = cfg.moe
        D, E, I = cfg.hidden_size, m.num_experts, m.expert_size
        self.router = declare((D, E), ("embed", "router"), dtype)
        # DeepSeek-V3 / GLM-4.5: the per-expert selection bias, kept in float32 as transformers keeps it
        self.router_bias = declare((E,), ("router",), jnp.float32) if m.correction_bias else None
        self.expert_gate = declare((E, D, I), ("expert", "embed", "moe_mlp"), dtype)
        self.expert_up = declare((E, D, I), ("expert", "embed", "moe_mlp"), dtype)
        self.expert_down = declare((E, I, D), ("expert", "moe_mlp", "embed"), dtype)
        self.has_shared = m.shared_expert_size > 0
        if self.has_shared:
            self.shared_expert = SharedExpertMLP(cfg, dtype)
            self.shared_expert_gate = declare((D,), ("embed",), dtype) if m.shared_expert_gate else None
        self.route_fn = router_for(m)
        # the routers with a selection bias (DeepSeek-V3's, GLM-4.5's, ERNIE 4.5's) keep their weight in
        # float32 in transformers and run in float32 throughout
        self.f32_logits = m.correction_bias
        from jvllm.sharding import moe_mesh_axes

        self.expert_axes, self.hidden_axis = moe_mesh_axes(m.expert_parallel)
        self.backend = m.grouped_matmul
        self.act = cfg.hidden_act  # the routed experts' activation, as the shared expert's and the dense MLP's

    def route(self, x):
        """(top_idx [T, k] int32, top_w [T, k] float32): the config's router
        (`jvllm.models.moe_routers`) over the logits in float32."""
        if self.f32_logits:
            logits = x.astype(jnp.float32) @ self.router[...].astype(jnp.float32)
        else:
            logits = (x @ self.router[...]).astype(jnp.float32)
        return self.route_fn(logits, None if self.router_bias is None else self.router_bias[...])

    def __call__(self, x, valid=None):
        """x [T, D]; valid [T] bool (False: a padding token, computed by no expert) or None."""
        with jax.named_scope(gm.ROUTING_SCOPE):
            top_idx, top_w = self.route(x)
        ws = (self.expert_gate[...], self.expert_up[...], self.expert_down[...])
        mesh = _TP_MESH.get()
        if mesh is None or mesh.size == 1:
            y = gm.moe_ffn(x, top_idx, top_w, *ws, valid, backend=self.backend, act=self.act)
        else:
            y = gm.sharded_ffn(x, top_idx, top_w, *ws, valid, mesh=mesh, expert_axes=self.expert_axes,
                               hidden_axis=self.hidden_axis, backend=self.backend, act=self.act)
        y = y.astype(x.dtype)
        if self.has_shared and self.shared_expert_gate is not None:
            gate = jax.nn.sigmoid((x @ self.shared_expert_gate[...]).astype(jnp.float32))
            y = y + (gate[:, None] * self.shared_expert(x).astype(jnp.float32)).astype(x.dtype)
        elif self.has_shared:
            y = y + self.shared_expert(x)
        return y


class MoEDecoderLayer(DecoderLayer):
    """A Llama decoder layer whose MLP is a `SparseMoE` on sparse layers; the step's padding
    tokens (position -1) are kept out of the experts."""

    def __init__(self, cfg: ModelConfig, layer: int, dtype):
        self.input_layernorm = norm(cfg, cfg.hidden_size, dtype)
        self.self_attn = Attention(cfg, layer, dtype)
        self.post_attention_layernorm = norm(cfg, cfg.hidden_size, dtype)
        self.sparse = cfg.moe.is_sparse(layer)
        self.mlp = SparseMoE(cfg, dtype) if self.sparse else MLP(cfg, dtype)

    def ffn(self, h, md):
        return self.mlp(h, md.positions >= 0) if self.sparse else self.mlp(h)


class MoEForCausalLM(LlamaForCausalLM):
    """Mixtral / Qwen2-MoE / Qwen3-MoE: `LlamaForCausalLM` with `MoEDecoderLayer`s (pipeline
    stages as there: `layers=(start, end)`)."""

    layer_cls = MoEDecoderLayer

    def __init__(self, cfg: ModelConfig, dtype=jnp.float32, layers: tuple[int, int] | None = None):
        if cfg.moe is None:
            raise ValueError(f"{cfg.architecture}: MoEForCausalLM needs ModelConfig.moe")
        super().__init__(cfg, dtype, layers)
