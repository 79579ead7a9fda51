"""Converted params saved and restored with Orbax, next to config.json and tokenizer files.

Layout of a converted folder (what `jvllm convert SRC DST` writes):
    DST/jvllm_checkpoint.json   marker: format version, source, dtype
    DST/config.json             HF-style config (AutoConfig reads it)
    DST/params/                 Orbax checkpoint of the nested param tree
    DST/tokenizer*.json ...     tokenizer files (when the source had a tokenizer)
Restoring takes an abstract target (shape, dtype, sharding per leaf), so each array is read
straight into its sharding without materialising the whole model on one device.
"""
from __future__ import annotations

import json
import os

import jax
import numpy as np

MARKER = "jvllm_checkpoint.json"


def _nest(flat: dict) -> dict:
    tree: dict = {}
    for k, v in flat.items():
        node = tree
        parts = k.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = v
    return tree


def _flatten(tree, prefix=""):
    out = {}
    for k, v in tree.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, name + "."))
        else:
            out[name] = v
    return out


def is_orbax_checkpoint(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MARKER))


def save(dst: str, params: dict, hf_config: dict, tokenizer=None, source: str = "", dtype: str = "") -> None:
    import orbax.checkpoint as ocp

    dst = os.path.abspath(dst)
    os.makedirs(dst, exist_ok=True)
    ckpt = ocp.StandardCheckpointer()
    target = os.path.join(dst, "params")
    ckpt.save(target, _nest({k: jax.numpy.asarray(v) for k, v in params.items()}), force=True)
    ckpt.wait_until_finished()
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=1, default=str)
    if tokenizer is not None:
        tokenizer.save_pretrained(dst)
    with open(os.path.join(dst, MARKER), "w") as f:
        json.dump({"format": 1, "source": source, "dtype": dtype}, f)


def restore(src: str, specs: dict, dtype, shardings: dict | None = None) -> dict:
    """Restore {name: jax.Array}; `specs` from `jvllm.models.param_specs`, `shardings` {name: Sharding}.
    Each tensor is read straight into its sharding (no copy of the whole model on one device); a
    tensor whose devices all belong to other processes (pipeline stages over processes) is not
    read here but becomes a placeholder (`remote_placeholder`)."""
    import orbax.checkpoint as ocp

    from .name_map import CheckpointError

    path = os.path.join(os.path.abspath(src), "params")
    if not os.path.isdir(path):
        raise CheckpointError(f"{src}: no Orbax params folder")
    ckpt = ocp.StandardCheckpointer()
    dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = {k: jax.ShapeDtypeStruct(shape, np.dtype(dtype), sharding=(shardings or {}).get(k, dev))
                for k, (shape, _, _) in specs.items()}
    try:
        meta = ckpt.metadata(path)
        tree = getattr(meta, "item_metadata", meta)
        saved = _flatten(dict(tree)) if tree is not None else None
    except Exception:
        saved = None
    if saved is not None:
        missing = sorted(set(abstract) - set(saved))
        extra = sorted(set(saved) - set(abstract))
        if missing or extra:
            raise CheckpointError(f"{src}: Orbax params do not match the model: missing {missing[:8]}, "
                                  f"unexpected {extra[:8]}")
        for k, m in saved.items():
            if tuple(getattr(m, "shape", abstract[k].shape)) != abstract[k].shape:
                raise CheckpointError(f"{src}: tensor {k!r} has shape {tuple(m.shape)}, model expects "
                                      f"{abstract[k].shape}")
    remote = {k for k, a in abstract.items() if not a.sharding.addressable_devices}
    if not remote:
        return _flatten(ckpt.restore(path, _nest(abstract)))
    # pipeline stages over processes: this process reads only the tensors of its own stages;
    # the others become placeholders on their owners' devices (the owners read them)
    from . import remote_placeholder

    item = _nest({k: a for k, a in abstract.items() if k not in remote})
    restored = _flatten(ocp.PyTreeCheckpointer().restore(path, args=ocp.args.PyTreeRestore(
        item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item), partial_restore=True)))
    for k in remote:
        restored[k] = remote_placeholder(abstract[k].shape, abstract[k].dtype, abstract[k].sharding)
    return restored
