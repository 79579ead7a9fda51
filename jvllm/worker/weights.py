"""Live weights of a runner: read them (`live_params`) and swap them in place (`update_params`),
for training loops that hand new params to the engine every step (`LLM.update_weights`).

Names are jvllm's global parameter names (`jvllm.models.param_specs`: 'embed',
'layers.3.self_attn.q_proj', 'norm.weight', 'lm_head'), whatever the pipeline stage a parameter
lives in. `normalize` accepts what a trainer holds:
  - an NNX `State` or a nested dict shaped like `get_weights()` ({'layers': {'3': {...}}}; integer
    keys are fine), or a flat dict {name: array};
  - an iterable of (Hugging Face name, array) pairs, as vLLM's `load_weights` takes: each goes
    through the model family's checkpoint name map and layout transforms of `converters.name_map`
    (host numpy); a fused tensor (Phi-3's qkv_proj, GPT-2's c_attn) updates each of its parts.
    Per-expert names of a mixture-of-experts checkpoint are refused: their parameter stacks every
    expert, so give the stacked array by its jvllm name.

A subset of the parameters may be given (the rest keep their values); an unknown name, a wrong
shape or a non-array value is a ValueError naming it, raised before anything is swapped.

Quantized engines (`quantization=`): `get_weights` returns the quantized projection weights and
their `<name>_scale` arrays; an update gives a projection either in full precision (requantized)
or as its quantized weight together with its scale (`jvllm.quantization.load`).

Placement: an array that already has the target's sharding and dtype is used as is (no copy, no
host round trip); any other array is moved with `jax.device_put` to the target sharding, and cast
(numpy on the host; a device array on the device, which compiles one tiny convert program per new
shape and dtype the first time). The step programs never recompile: their arguments keep shape,
dtype and sharding.

Hazard: arrays used in place are shared with the caller. A training step that *donates* its params
argument (`jax.jit(..., donate_argnums=...)`) deletes them under the engine: hand the engine
arrays that will not be donated, or let it copy (pass a different dtype, or numpy).
"""
from __future__ import annotations

from collections.abc import Mapping

import jax
import numpy as np

from jvllm.models import stage_layers, stage_names


def _names(runner) -> list[dict[str, str]]:
    """Per stage: {global name: name inside the stage}."""
    cfg, n = runner.cfg, len(runner.stages)
    if n == 1:
        return [{k: k for k in _flat_state(runner.stages[0].state)}]
    return [stage_names(cfg, r) for r in stage_layers(cfg.num_layers, n)]


def _flat_state(state) -> dict:
    from flax import nnx

    flat = nnx.to_flat_state(state) if hasattr(nnx, "to_flat_state") else state.flat_state()
    out = {}
    for path, var in flat:
        out[".".join(str(p) for p in path)] = var.get_value() if hasattr(var, "get_value") else getattr(var, "value", var)
    return out


def live_params(runner) -> dict[str, jax.Array]:
    """{global name: the device array the engine computes with} (not copies)."""
    out = {}
    for st, names in zip(runner.stages, _names(runner)):
        if st.state is None:
            continue  # another process's stage
        flat = _flat_state(st.state)
        for glob, local in names.items():
            out[glob] = flat[local]
    return out


def nest(flat: Mapping[str, object]) -> dict:
    """{'a.b.c': x} -> {'a': {'b': {'c': x}}} (the shape `LLM.get_weights` returns)."""
    out: dict = {}
    for name, v in flat.items():
        *head, last = name.split(".")
        d = out
        for k in head:
            d = d.setdefault(k, {})
        d[last] = v
    return out


def _flatten_tree(tree, prefix: str, out: dict):
    for k, v in tree.items():
        name = f"{prefix}{k}"
        if isinstance(v, Mapping):
            _flatten_tree(v, name + ".", out)
        else:
            out[name] = v.get_value() if hasattr(v, "get_value") else v  # an nnx.Variable: its value
    return out


def _to_numpy(name, a) -> np.ndarray:
    if hasattr(a, "detach"):  # a torch tensor: numpy has no bfloat16, go through float32
        a = a.detach().cpu()
        if str(a.dtype) in ("torch.bfloat16", "torch.float16"):
            a = a.float()
        return a.numpy()
    try:
        return np.asarray(a)
    except Exception as e:
        raise ValueError(f"weight {name!r}: {type(a).__name__} is not an array") from e


def normalize(weights, specs: dict, tied: bool, model_specs: dict | None = None, name_map: str = "llama") -> dict:
    """`weights` (see the module docstring) -> {jvllm name: array}, names and shapes checked
    against `specs` (`param_specs` of the whole model). `model_specs`: the unquantized model's
    param_specs where a quantized engine stores some weights in another layout (the fp8 pallas
    backend): HF pairs convert to the model layout, and either shape passes here
    (`jvllm.quantization.load.update_quantized` checks which one a dtype needs). `name_map`: the
    family's checkpoint name map (`jvllm.models.registry.Family.name_map`) for HF pairs."""
    from flax import nnx

    model_specs = model_specs or specs

    if isinstance(weights, nnx.State):
        flat = _flat_state(weights)
    elif isinstance(weights, Mapping):
        flat = _flatten_tree(weights, "", {})
    elif isinstance(weights, (str, bytes)) or not hasattr(weights, "__iter__"):
        raise ValueError(f"weights must be a params pytree (dict / nnx.State) or an iterable of "
                         f"(hf_name, array) pairs, got {type(weights).__name__}")
    else:
        from jvllm.converters.moe_names import ExpertSlice
        from jvllm.converters.name_map import map_name

        flat = {}
        for item in weights:
            if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
                raise ValueError(f"weights: expected (hf_name, array) pairs, got {item!r:.100}")
            src, a = item
            tgt, fn = map_name(src, name_map)  # CheckpointError (a ValueError) for an unknown name
            if tgt is None or (tgt == "lm_head" and tied):
                continue
            if isinstance(fn, ExpertSlice):
                raise ValueError(f"weight {src!r}: one expert of the stacked parameter {tgt!r}; update experts "
                                 f"by that jvllm name with all of them stacked ([experts, ...], as get_weights())")
            tgts = tgt if isinstance(tgt, tuple) else (tgt,)
            for t in tgts:
                if t not in specs:
                    raise ValueError(f"weight {src!r}: this model declares no parameter {t!r}")
                if t in flat:
                    raise ValueError(f"weight {src!r} given twice")
            shapes = [model_specs.get(t, specs[t])[0] for t in tgts]
            parts = fn(src, _to_numpy(src, a), shapes if isinstance(tgt, tuple) else shapes[0])
            flat.update(zip(tgts, parts if isinstance(tgt, tuple) else (parts,)))
    for name, a in flat.items():
        if name not in specs:
            hint = " (this model ties the LM head to 'embed')" if name == "lm_head" and tied else ""
            raise ValueError(f"unknown weight {name!r}{hint}; known: {', '.join(sorted(specs)[:6])} ...")
        if not hasattr(a, "shape"):
            raise ValueError(f"weight {name!r}: {type(a).__name__} is not an array")
        model = tuple(model_specs.get(name, specs[name])[0])
        if tuple(a.shape) not in (tuple(specs[name][0]), model):
            raise ValueError(f"weight {name!r}: shape {tuple(a.shape)}, the model's is {model}")
    return flat


def place(a, target: jax.Array):
    """`a` as an array like `target` (sharding, dtype): `a` itself when it already is one."""
    if isinstance(a, jax.Array):
        if a.dtype == target.dtype and a.sharding.is_equivalent_to(target.sharding, a.ndim):
            return a
        a = jax.device_put(a, target.sharding)
        return a if a.dtype == target.dtype else a.astype(target.dtype)
    return jax.device_put(_to_numpy("?", a).astype(target.dtype, copy=False), target.sharding)


def update_params(runner, flat: dict) -> int:
    """Swap `flat` ({global name: array}, checked by `normalize`) into the runner's stages and
    LM head. Returns the number of arrays used in place (no copy)."""
    from flax import nnx

    live = live_params(runner)
    if runner.cfg.quant is not None:  # full-precision projections are requantized (jvllm.quantization.load)
        from jvllm.quantization.load import SCALE, update_quantized
        from jvllm.quantization.schemes import projection_for

        proj = projection_for(runner.cfg.quant)
        n_in = {n: proj.n_in_of(live[n].shape, live[n + SCALE].shape) for n in live if n + SCALE in live}
        flat = update_quantized(flat, live, proj, n_in)
    placed = {name: place(a, live[name]) for name, a in flat.items() if name in live}
    in_place = sum(placed[n] is flat[n] for n in placed)
    for st, names in zip(runner.stages, _names(runner)):
        if st.state is None:
            continue
        local = {names_local: placed[glob] for glob, names_local in names.items() if glob in placed}
        if not local:
            continue
        fs = nnx.to_flat_state(st.state) if hasattr(nnx, "to_flat_state") else st.state.flat_state()
        new = [(p, var.replace(local[".".join(str(x) for x in p)]) if ".".join(str(x) for x in p) in local else var)
               for p, var in fs]
        st.state = nnx.from_flat_state(new) if hasattr(nnx, "from_flat_state") else type(st.state).from_flat_path(dict(new))
        leaves, treedef = jax.tree_util.tree_flatten(st.state)
        if treedef != st.treedef:
            raise RuntimeError("weight update changed the parameter tree structure")  # a bug, not bad input
        st.leaves = leaves
    head = "embed" if runner.cfg.tie_word_embeddings else "lm_head"
    if runner.local(len(runner.stages) - 1) and (head in placed or "lm_head_bias" in placed):
        from jvllm.models.layers import HeadParams, head_weight

        w = head_weight(runner.head_w)
        if head in placed:
            if len(runner.stages) > 1 and runner.cfg.tie_word_embeddings:  # the last stage's own copy
                w = jax.device_put(placed[head], w.sharding)
            else:
                w = placed[head]
        runner.head_w = (HeadParams(w, placed.get("lm_head_bias", runner.head_w.b)) if runner.cfg.lm_head_bias
                         else w)
    return in_place
