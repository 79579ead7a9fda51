"""Models: the family registry (`registry.py`: architecture -> family -> Flax NNX class; the built-in
families are registered in `families.py`) and helpers
to build abstract models, list declared parameters and bind parameter values."""
from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from jvllm.config import ModelConfig
from jvllm.models.registry import family_of


def model_class(cfg: ModelConfig):
    """The Flax class of the config's architecture (ValueError naming the supported ones)."""
    return family_of(cfg.architecture).model_class()


def abstract_model(cfg: ModelConfig, dtype=jnp.float32, layers: tuple[int, int] | None = None):
    """The model (or a pipeline stage of it) with abstract leaves: its declared parameters,
    allocating nothing."""
    cls = model_class(cfg)
    return nnx.eval_shape(lambda: cls(cfg, dtype, layers))


def param_specs(cfg: ModelConfig, dtype=jnp.float32,
                layers: tuple[int, int] | None = None) -> dict[str, tuple[tuple[int, ...], object, tuple[str, ...]]]:
    """{'layers.0.self_attn.q_proj': (shape, dtype, logical_axes)} for every declared parameter."""
    state = nnx.state(abstract_model(cfg, dtype, layers), nnx.Param)
    out = {}
    for path, var in _flat_vars(state):
        v = var.get_value() if hasattr(var, "get_value") else var.value
        out[path] = (tuple(v.shape), v.dtype, tuple(var.get_metadata().get("axes", ())) if hasattr(var, "get_metadata") else tuple(getattr(var, "axes", ())))
    return out


def _flat_vars(state):
    for path, var in nnx.to_flat_state(state) if hasattr(nnx, "to_flat_state") else state.flat_state():
        yield ".".join(str(p) for p in path), var


def stage_layers(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """Contiguous layer ranges, as even as possible (earlier stages take the remainder)."""
    if num_stages > num_layers:
        raise ValueError(f"pipeline_parallel_size {num_stages} exceeds num_hidden_layers {num_layers}")
    base, extra = divmod(num_layers, num_stages)
    out, start = [], 0
    for s in range(num_stages):
        end = start + base + (1 if s < extra else 0)
        out.append((start, end))
        start = end
    return out


def stage_names(cfg: ModelConfig, layers: tuple[int, int]) -> dict[str, str]:
    """{global param name: name inside the stage} for the params the stage `layers` owns."""
    start, end = layers
    out = {}
    for local in param_specs(cfg, layers=layers):
        if local.startswith("layers."):
            _, i, rest = local.split(".", 2)
            out[f"layers.{int(i) + start}.{rest}"] = local
        else:
            out[local] = local
    return out


def bind(cfg: ModelConfig, params: dict, dtype=jnp.float32, layers: tuple[int, int] | None = None):
    """(graphdef, state) of the model with `params` ({name: array}) as its parameter values.

    The module is split once here; the engine merges it inside its jitted step (trace time only),
    so no per-step NNX traversal happens (tpu-inference measured ~17 ms/step for that)."""
    graphdef, state = nnx.split(abstract_model(cfg, dtype, layers))
    flat = nnx.to_flat_state(state) if hasattr(nnx, "to_flat_state") else state.flat_state()
    names = {".".join(str(p) for p in path): (path, var) for path, var in flat}
    missing = sorted(set(names) - set(params))
    if missing:
        raise ValueError(f"params missing for {missing[:8]}")
    extra = sorted(set(params) - set(names))
    if extra:
        raise ValueError(f"unexpected params {extra[:8]}")
    new = []
    for name, (path, var) in names.items():
        v = params[name]
        want = var.get_value() if hasattr(var, "get_value") else var.value
        if tuple(v.shape) != tuple(want.shape):
            raise ValueError(f"param {name!r}: shape {tuple(v.shape)}, declared {tuple(want.shape)}")
        new.append((path, var.replace(v)))
    state = nnx.from_flat_state(new) if hasattr(nnx, "from_flat_state") else type(state).from_flat_path(dict(new))
    return graphdef, state
