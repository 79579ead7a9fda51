"""Device meshes for tensor / pipeline / data parallelism, and multi-host start-up.

A jvllm mesh has the named axes ("data", "stage", "expert", "tensor"). Data-parallel replicas are
separate engines (each with its own scheduler and KV pool) on the sub-meshes `mesh.devices[d]`;
pipeline stages are the sub-meshes `mesh.devices[d, s]` with the axes ("expert", "tensor").

The "expert" axis (expert_parallel_size, 1 unless asked for) exists for mixture-of-experts models:
attention, dense MLPs, embedding and head are sharded over "tensor" only and so replicated over
"expert" (every expert group runs the same attention on the same tokens, with its own copy of the
KV pool); only the experts are split over "expert" (sharding.rules). Code that shards over
"tensor" alone (the attention shard_map) is therefore unchanged by it.
"""
from __future__ import annotations

import os

import jax
import numpy as np
from jax.sharding import Mesh

AXES = ("data", "stage", "expert", "tensor")
STAGE_AXES = AXES[2:]


def make_mesh(tensor: int = 1, stage: int = 1, data: int = 1, devices=None, expert: int = 1) -> Mesh:
    """A (data, stage, expert, tensor) mesh over the first data*stage*expert*tensor devices
    ("tensor" fastest: the devices of one tensor group are neighbours).

    Raises ValueError naming the sizes when there are not enough devices."""
    for name, v in (("tensor_parallel_size", tensor), ("pipeline_parallel_size", stage),
                    ("data_parallel_size", data), ("expert_parallel_size", expert)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    devices = list(devices if devices is not None else jax.devices())
    n = tensor * stage * data * expert
    if n > len(devices):
        ep = f" x expert_parallel_size ({expert})" if expert > 1 else ""
        raise ValueError(
            f"tensor_parallel_size ({tensor}) x pipeline_parallel_size ({stage}) x data_parallel_size ({data}){ep} "
            f"= {n} devices, but only {len(devices)} are available ({devices[0].platform})")
    return Mesh(np.asarray(devices[:n], dtype=object).reshape(data, stage, expert, tensor), AXES)


def stage_mesh(mesh: Mesh, data_index: int, stage_index: int) -> Mesh:
    """The ("expert", "tensor") mesh of one pipeline stage of one replica."""
    return Mesh(mesh.devices[data_index, stage_index], STAGE_AXES)


def replica_mesh(mesh: Mesh, data_index: int) -> Mesh:
    return Mesh(mesh.devices[data_index], AXES[1:])


def initialize_distributed(coordinator_address: str | None = None, num_processes: int | None = None,
                           process_id: int | None = None, local_device_count: int | None = None) -> bool:
    """`jax.distributed.initialize` from arguments or the environment (JVLLM_COORDINATOR,
    JVLLM_NUM_PROCESSES, JVLLM_PROCESS_ID; `jvllm launch` sets them). Returns True when this is a
    multi-process run (started now or before); `LLM(...)` calls it with no arguments.

    Every process must then build the same LLM and submit the same requests in the same order:
    the scheduler is deterministic, so all processes take the same decisions step by step (process
    0's, which the others replay), and each reads sampled ids from its local replica."""
    addr = coordinator_address or os.environ.get("JVLLM_COORDINATOR")
    n = num_processes or (int(os.environ["JVLLM_NUM_PROCESSES"]) if "JVLLM_NUM_PROCESSES" in os.environ else None)
    pid = process_id if process_id is not None else (
        int(os.environ["JVLLM_PROCESS_ID"]) if "JVLLM_PROCESS_ID" in os.environ else None)
    if not addr or not n or n <= 1:
        return False
    if jax.distributed.is_initialized():  # already started (the CLI, then LLM(...) reading the env)
        return True
    if pid is None:
        raise ValueError("multi-process run: process_id (or JVLLM_PROCESS_ID) is required")
    # CPU collectives across processes (affects only the CPU backend; must not touch the backend here)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    kw = {}
    if local_device_count:
        kw["local_device_ids"] = list(range(local_device_count))
    try:
        jax.distributed.initialize(coordinator_address=addr, num_processes=n, process_id=pid, **kw)
    except RuntimeError as e:
        raise RuntimeError(f"multi-process run (coordinator {addr}, {n} processes, this one {pid}): "
                           f"jax.distributed could not start: {e}. It must start before anything touches JAX's "
                           f"devices: build the LLM (or call jvllm.sharding.initialize_distributed()) first") from e
    return True
