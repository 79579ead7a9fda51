"""Parameter declarations: every model parameter is declared once with its shape, dtype and one
logical axis name per dimension (`jvllm.sharding.rules` maps the names onto mesh axes)."""
from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

# Logical axis names used by model code (jvllm.sharding maps them onto mesh axes).
LOGICAL_AXES = ("vocab", "embed", "heads", "kv_heads", "head_dim", "mlp", "norm",
                "expert", "moe_mlp", "router",  # mixture of experts (jvllm.models.moe)
                "positions")  # learned position embeddings (GPT-2)


def declare(shape: tuple[int, ...], axes: tuple[str, ...], dtype, *, ones: bool = False) -> nnx.Param:
    """A parameter of `shape` with one logical axis name per dimension (stored as `.axes`)."""
    if len(shape) != len(axes):
        raise ValueError(f"shape {shape} and logical axes {axes} differ in rank")
    for a in axes:
        if a not in LOGICAL_AXES:
            raise ValueError(f"unknown logical axis {a!r}; known: {LOGICAL_AXES}")
    init = jnp.ones if ones else jnp.zeros
    return nnx.Param(init(shape, dtype), axes=tuple(axes))
