"""Meshes and logical-axis sharding rules (installed as `jvllm.sharding`)."""
from .mesh import AXES, STAGE_AXES, initialize_distributed, make_mesh, replica_mesh, stage_mesh  # noqa: F401
from .rules import (PRESETS, describe, expert_parallel_rules, kv_partition_spec, kv_sharding, moe_mesh_axes, param_shardings, parallel_rules, partition_spec, replicated,  # noqa: F401
                    tensor_parallel_rules, valid_tp_sizes)
