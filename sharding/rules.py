"""Logical axes -> mesh axes (MaxText-style rules as data).

Model code names only logical axes (jvllm.models.layers.LOGICAL_AXES). A rule set maps each to a
mesh axis name or None (replicated). One preset per strategy; `tensor_parallel_rules` adapts the
preset to a model (heads that cannot be split raise; KV heads fewer than the TP size are
replicated; a vocabulary that does not divide is replicated). A rule set that would put one mesh
axis on two dimensions of the same array is refused.

Mixture-of-experts models add the logical axes expert / moe_mlp / router: under TENSOR each
expert's hidden dimension is split (moe_mlp), under EXPERT (`expert_parallel_rules`) the experts
themselves are; the router is always replicated.

Tensor parallel is Megatron-style by construction: q/k/v and gate/up are sharded on their output
(heads / mlp) dimension, o_proj and down_proj on their input dimension, so XLA inserts exactly one
all-reduce after attention and one after the MLP; the embedding and LM head are vocab-parallel;
the KV pool is sharded by KV heads.
"""
from __future__ import annotations

from jax.sharding import NamedSharding, PartitionSpec

REPLICATED = {"vocab": None, "embed": None, "heads": None, "kv_heads": None, "head_dim": None, "mlp": None,
              "norm": None, "expert": None, "moe_mlp": None, "router": None}
TENSOR = dict(REPLICATED, vocab="tensor", heads="tensor", kv_heads="tensor", mlp="tensor", moe_mlp="tensor")
# Expert parallel (vLLM's enable_expert_parallel: the tensor-parallel devices hold the experts):
# attention, dense MLPs and shared experts as TENSOR; the experts' leading dimension over the same
# devices, each expert whole on one device (see jvllm.ops.grouped_matmul for the token routing).
EXPERT = dict(TENSOR, expert="tensor", moe_mlp=None)
PRESETS = {"replicated": REPLICATED, "tensor": TENSOR, "expert": EXPERT}


def valid_tp_sizes(cfg, limit: int = 64, expert_parallel: bool = False) -> list[int]:
    """TP sizes that fit `cfg`; with `expert_parallel` the experts are split instead of their
    hidden dimension (num_experts must divide)."""
    moe = getattr(cfg, "moe", None)

    def experts_fit(t):
        if moe is None:
            return True
        return moe.shared_expert_size % t == 0 and (moe.num_experts if expert_parallel else moe.expert_size) % t == 0

    return [t for t in range(1, limit + 1)
            if cfg.num_heads % t == 0 and cfg.intermediate_size % t == 0
            and (cfg.num_kv_heads % t == 0 or t % cfg.num_kv_heads == 0) and experts_fit(t)]


def expert_parallel_rules(cfg, tp: int) -> dict:
    """The expert preset for a mixture-of-experts `cfg` over `tp` devices, or ValueError naming
    the numbers (attention as `tensor_parallel_rules`; the experts must divide evenly)."""
    if cfg.moe is None:
        raise ValueError(f"enable_expert_parallel needs a mixture-of-experts model; {cfg.architecture} has no experts")
    if tp == 1:
        return dict(REPLICATED)
    ok = valid_tp_sizes(cfg, expert_parallel=True)
    if tp not in ok:
        raise ValueError(
            f"enable_expert_parallel: tensor_parallel_size {tp} does not fit this model: num_experts "
            f"{cfg.moe.num_experts}, shared expert size {cfg.moe.shared_expert_size}, num_attention_heads "
            f"{cfg.num_heads}, num_key_value_heads {cfg.num_kv_heads}, intermediate_size {cfg.intermediate_size}; "
            f"sizes that work: {', '.join(map(str, ok))}")
    rules = dict(EXPERT)
    if cfg.num_kv_heads % tp:
        rules["kv_heads"] = None
    if cfg.vocab_size % tp:
        rules["vocab"] = None
    return rules


def tensor_parallel_rules(cfg, tp: int) -> dict:
    """The tensor preset for `cfg` at TP size `tp`, or ValueError naming the numbers."""
    if tp == 1:
        return dict(REPLICATED)
    ok = valid_tp_sizes(cfg)
    if tp not in ok:
        raise ValueError(
            f"tensor_parallel_size {tp} does not fit this model: num_attention_heads {cfg.num_heads}, "
            f"num_key_value_heads {cfg.num_kv_heads}, intermediate_size {cfg.intermediate_size}; "
            f"sizes that work: {', '.join(map(str, ok))}")
    rules = dict(TENSOR)
    if cfg.num_kv_heads % tp:
        rules["kv_heads"] = None  # fewer KV heads than ranks: every rank keeps all KV heads
    if cfg.vocab_size % tp:
        rules["vocab"] = None
    return rules


def partition_spec(axes: tuple[str, ...], rules: dict) -> PartitionSpec:
    mesh_axes = []
    for a in axes:
        if a not in rules:
            raise ValueError(f"no sharding rule for logical axis {a!r}")
        mesh_axes.append(rules[a])
    used = [m for m in mesh_axes if m is not None]
    if len(used) != len(set(used)):
        raise ValueError(f"sharding rules map two dimensions of {axes} onto one mesh axis: {mesh_axes}")
    return PartitionSpec(*mesh_axes)


def param_shardings(specs: dict, mesh, rules: dict) -> dict:
    """{param name: NamedSharding} from `jvllm.models.param_specs` output."""
    return {name: NamedSharding(mesh, partition_spec(axes, rules)) for name, (_, _, axes) in specs.items()}


def kv_partition_spec(rules: dict) -> PartitionSpec:
    """KV pages [kv_heads, num_blocks, block_size, head_dim]: sharded by KV heads."""
    return partition_spec(("kv_heads", "kv_blocks", "block", "head_dim"), dict(rules, kv_blocks=None, block=None))


def kv_sharding(mesh, rules: dict) -> NamedSharding:
    return NamedSharding(mesh, kv_partition_spec(rules))


def replicated(mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def describe(shardings: dict) -> dict:
    """{name: str(PartitionSpec)}: the golden-file form of a preset's parameter shardings."""
    return {k: str(tuple(v.spec)) for k, v in sorted(shardings.items())}
