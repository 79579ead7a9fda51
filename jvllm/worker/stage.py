"""A pipeline stage (a model slice with its own weights, KV pages and device sub-mesh) and the
host <-> device transfer helpers every executor uses."""
from __future__ import annotations

import dataclasses

import jax
import numpy as np


@dataclasses.dataclass
class Stage:
    graphdef: object
    state: object
    mesh: object | None = None        # ("expert", "tensor") mesh of this stage's devices; None = default device
    kv_spec: object = None            # PartitionSpec of KV pages on `mesh`
    kv: list | None = None            # [(K, V)] per layer (jvllm.memory.kv_cache); None in another process
    first: bool = True
    last: bool = True
    leaves: list | None = None        # the state's leaves, flattened once (a plain list flattens
    treedef: object = None            # in C++ on every call; an nnx.State would in Python)
    pack: object = None               # param_pack.ParamPack of `leaves`: what the step program takes
    _packed: tuple = (None, None)     # (the leaf list packed, its packed arguments)

    def __post_init__(self):
        if self.state is not None and self.leaves is None:
            self.leaves, self.treedef = jax.tree_util.tree_flatten(self.state)
        if self.leaves is not None and self.pack is None:
            from jvllm.worker.param_pack import ParamPack

            paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(self.state)[0]]
            self.pack = ParamPack.plan(self.leaves, paths)

    def params(self) -> list | None:
        """The step program's parameter arguments (`pack.pack(leaves)`), packed again whenever
        `leaves` is replaced (a weight update); None in a stage of another process."""
        if self.leaves is None:
            return None
        if self._packed[0] is not self.leaves:
            self._packed = (self.leaves, self.pack.pack(self.leaves))
        return self._packed[1]

    def sharding(self, spec=None):
        from jax.sharding import NamedSharding, PartitionSpec

        if self.mesh is None:
            return None
        return NamedSharding(self.mesh, spec if spec is not None else PartitionSpec())

    def devices(self) -> list:
        """The stage's devices in mesh order (the default device without a mesh)."""
        return list(self.mesh.devices.flat) if self.mesh is not None else [jax.devices()[0]]

    def num_layers(self) -> int:
        from flax import nnx

        flat = nnx.to_flat_state(self.state) if hasattr(nnx, "to_flat_state") else self.state.flat_state()
        return len({str(path[1]) for path, _ in flat if str(path[0]) == "layers"})


def put(x, sharding):
    """numpy -> device array with `sharding` (also across processes in a multi-host run: a
    sharding with devices of other processes is built from this process's slices)."""
    if sharding is None:
        return x
    if jax.process_count() > 1 and not sharding.is_fully_addressable:
        return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx], dtype=x.dtype)
    return jax.device_put(x, sharding)


def to_host(x) -> np.ndarray:
    if not getattr(x, "is_fully_addressable", True):  # multi-host: every process holds a replica
        return np.asarray(x.addressable_data(0))
    return np.asarray(x)
