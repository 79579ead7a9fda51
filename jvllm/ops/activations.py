"""The MLPs' activation functions by transformers' `hidden_act` names, in one place (dense MLPs,
gated MLPs and the mixture-of-experts kernels all look them up here).

  silu, swish          x * sigmoid(x) (SwiGLU's gate)
  gelu_pytorch_tanh    GELU's tanh approximation (Gemma's GeGLU); gelu_new is the same formula
                       under GPT-2's name
  gelu                 the exact (erf) GELU (GPT-NeoX / Pythia)
  relu                 max(x, 0) (OPT)
  relu2                max(x, 0)^2 (Arcee's ungated MLP)

`jvllm.config.ModelConfig` checks a config's `hidden_act` against `NAMES` (no jax import there).
"""
from __future__ import annotations

import functools

import jax

NAMES = ("silu", "swish", "gelu_pytorch_tanh", "gelu_new", "gelu", "relu", "relu2")
_FUNCTIONS = {"silu": jax.nn.silu, "swish": jax.nn.silu,
              "gelu_pytorch_tanh": functools.partial(jax.nn.gelu, approximate=True),
              "gelu_new": functools.partial(jax.nn.gelu, approximate=True),
              "gelu": functools.partial(jax.nn.gelu, approximate=False), "relu": jax.nn.relu,
              "relu2": lambda x: jax.numpy.square(jax.nn.relu(x))}


def activation(name: str):
    """The function for `hidden_act` `name`; ValueError naming the supported ones otherwise."""
    try:
        return _FUNCTIONS[name]
    except KeyError:
        raise ValueError(f"unsupported activation {name!r}; supported: {', '.join(NAMES)}") from None
