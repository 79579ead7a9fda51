"""Quantizing weights as they arrive, and swapping new weights into a quantized engine.

At load (`LoadQuantizer`): whatever the source (HF safetensors, GGUF dequantized on read, random
presets, Orbax), each full-precision projection weight is placed in its target sharding, then
quantized on its device(s) by a small jitted program whose outputs carry the quantized weight's
and its scale's shardings (a per-channel scale is sharded with its output axis); the
full-precision array is deleted at once, so the peak holds one full-precision tensor beyond the
quantized model. Checkpoints that are already quantized skip this (`QuantConfig.from_checkpoint`).

Weight updates (`LLM.update_weights`, `update_quantized`): `get_weights()` of a quantized engine
returns the quantized arrays (in the format's stored layout, `Projection.stored_shape`) and their
`<name>_scale` arrays (what it computes with). An update gives, for each projection, either a
full-precision weight alone in the model layout (requantized here, on device, into the live
shardings and layout) or the quantized weight in the stored layout together with its scale (used
as they are: the get_weights round trip, and sleep level 2's restore); a shape that is neither is
a ValueError naming both. Anything else (a scale alone, a quantized
weight without its scale, a full-precision weight with a scale) is a ValueError naming it.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jvllm.quantization.schemes import Projection, projection_for

SCALE = "_scale"


def quantized_names(specs: dict, proj: Projection) -> dict[str, int]:
    """{weight name: number of contracted dims} of the quantized projections among `specs`
    (`jvllm.models.param_specs` of a quantized model config)."""
    return {n[:-len(SCALE)]: proj.n_in_of(specs[n[:-len(SCALE)]][0], specs[n][0])
            for n in specs if n.endswith(SCALE) and n[:-len(SCALE)] in specs}


@functools.lru_cache(maxsize=None)
def _quantizer(proj: Projection, n_in: int, shardings):
    return jax.jit(lambda w: proj.quantize(w, n_in), out_shardings=shardings)


def quantize_on_device(proj: Projection, w: jax.Array, n_in: int, w_sharding=None, s_sharding=None):
    """(quantized weight, scale) of device array `w`, in the given shardings (None: w's device)."""
    sh = None if w_sharding is None else (w_sharding, s_sharding)
    return _quantizer(proj, n_in, sh)(w)


class LoadQuantizer:
    """`q(name, array)` -> {name: array} or {name: quantized, name_scale: scale} (see the module
    docstring); `q.all(params)` does it for a whole dict. `specs`: the quantized model's
    param_specs; `shardings`: {name: sharding} of the quantized model, or None (one device)."""

    def __init__(self, cfg, specs: dict, shardings: dict | None = None):
        self.proj = projection_for(cfg.quant)
        self.n_in = quantized_names(specs, self.proj)
        self.shardings = shardings

    def __call__(self, name: str, a) -> dict:
        if name not in self.n_in or not hasattr(a, "dtype"):
            return {name: a}
        sh = self.shardings or {}
        if name in sh and not sh[name].addressable_devices:  # another process's stage
            from jvllm.converters import remote_placeholder

            s_spec = sh[name + SCALE]
            shape = self.proj.scale_shape(a.shape, self.n_in[name])
            stored = self.proj.stored_shape(a.shape, self.n_in[name])
            return {name: remote_placeholder(stored, self.proj.weight_dtype, sh[name]),
                    name + SCALE: remote_placeholder(tuple(shape), jnp.float32, s_spec)}
        wq, s = quantize_on_device(self.proj, a, self.n_in[name], sh.get(name), sh.get(name + SCALE))
        if isinstance(a, jax.Array):
            a.delete()  # ours (placed by the loader): free it before the next tensor arrives
        return {name: wq, name + SCALE: s}

    def all(self, params: dict) -> dict:
        out = {}
        for name in list(params):
            out.update(self(name, params.pop(name)))
        return out


def update_quantized(flat: dict, live: dict, proj: Projection, n_in: dict[str, int]) -> dict:
    """`flat` ({name: array} checked against the quantized specs) with every full-precision
    projection weight replaced by its quantized weight and scale, placed like `live`."""
    out = dict(flat)
    for name, k in n_in.items():
        w, s = flat.get(name), flat.get(name + SCALE)
        if w is None and s is None:
            continue
        if w is None:
            raise ValueError(f"weight {name + SCALE!r} given without {name!r}: a scale is set only together "
                             f"with its quantized weight")
        quantized = jnp.dtype(w.dtype) == jnp.dtype(proj.weight_dtype)
        if quantized != (s is not None):
            raise ValueError(
                f"weight {name!r}: a quantized engine takes a full-precision weight alone (it requantizes it) "
                f"or the {jnp.dtype(proj.weight_dtype).name} weight together with {name + SCALE!r}; got a "
                f"{jnp.dtype(w.dtype).name} weight {'with' if s is not None else 'without'} a scale")
        target_w, target_s = live[name], live[name + SCALE]
        want = tuple(target_w.shape) if quantized else proj.model_shape(target_w.shape, k)
        if tuple(w.shape) != want:
            layout = " (its quantized weights are stored output dims first)" if proj.out_first else ""
            raise ValueError(f"weight {name!r}: a {'quantized' if quantized else 'full-precision'} weight of shape "
                             f"{tuple(w.shape)}; this engine takes {want}{layout}")
        if quantized:
            continue
        if not isinstance(w, jax.Array):
            import numpy as np

            w = jnp.asarray(np.asarray(w, np.float32))
        if not proj.out_first:  # else the stored sharding names other dims: the quantizer's jit places it
            w = jax.device_put(w, target_w.sharding)
        out[name], out[name + SCALE] = quantize_on_device(proj, w, k, target_w.sharding, target_s.sharding)
    return out
