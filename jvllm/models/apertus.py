"""Apertus (swiss-ai) in Flax NNX: the Llama decoder with q/k RMSNorms per head (before rope, as
Qwen3's: `qk_norm`), its norms named attention_layernorm / feedforward_layernorm in checkpoints
(renamed by the converters' "apertus" name map) and an ungated MLP, down(act(up(x))), whose
activation is xIELU with learned scalars per layer (this file).

xIELU (transformers' XIELUActivation, its Python form), with a_p = softplus(alpha_p) and
a_n = beta + softplus(alpha_n):
    x > 0:  a_p * x^2 + beta * x
    else:   a_n * (expm1(min(x, eps)) - x) + beta * x
alpha_p, alpha_n ([1]) are the layer's parameters; beta and eps its stored buffers (0-d in
checkpoints, [1] here).
They are computed in the model dtype, as transformers does with parameters of the model's dtype.
Another hidden_act gives the plain ungated MLP (`layers.DenseMLP`), as transformers' does.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jvllm.config import ModelConfig
from jvllm.models.layers import DenseMLP
from jvllm.models.llama import DecoderLayer, LlamaForCausalLM
from jvllm.models.params import declare


class XIELUMLP(DenseMLP):
    """down(xielu(up(x))), without biases (Apertus's)."""

    def __init__(self, cfg: ModelConfig, dtype):
        super().__init__(cfg, dtype)
        self.alpha_p = declare((1,), ("norm",), dtype)
        self.alpha_n = declare((1,), ("norm",), dtype)
        self.beta = declare((1,), ("norm",), dtype)
        self.eps = declare((1,), ("norm",), dtype)

    def xielu(self, u):
        a_p = jax.nn.softplus(self.alpha_p[...]).astype(u.dtype)
        beta = self.beta[...].astype(u.dtype)
        a_n = beta + jax.nn.softplus(self.alpha_n[...]).astype(u.dtype)
        neg = (jnp.expm1(jnp.minimum(u, self.eps[...].astype(u.dtype))) - u) * a_n + beta * u
        return jnp.where(u > 0, a_p * u * u + beta * u, neg)

    def __call__(self, x):
        u = self.proj("td,di->ti", x, self.up_proj, self.up_proj_scale)
        return self.proj("ti,id->td", self.xielu(u), self.down_proj, self.down_proj_scale)


class ApertusDecoderLayer(DecoderLayer):
    """Llama's pre-norm layer with the xIELU MLP when hidden_act is "xielu"."""

    def __init__(self, cfg: ModelConfig, layer: int, dtype):
        super().__init__(cfg, layer, dtype)
        if cfg.hidden_act == "xielu":
            self.mlp = XIELUMLP(cfg, dtype)


class ApertusForCausalLM(LlamaForCausalLM):
    """Apertus: the Llama model's embedding, stages, final norm and forward contract with the
    xIELU MLP."""

    layer_cls = ApertusDecoderLayer
