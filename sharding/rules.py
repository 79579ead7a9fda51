"""Logical axes -> mesh axes (MaxText-style rules as data).

Model code names only logical axes (jvllm.models.layers.LOGICAL_AXES). A rule set maps each to a
mesh axis name or None (replicated). One preset per strategy; `tensor_parallel_rules` adapts the
preset to a model (heads that cannot be split raise; KV heads fewer than the TP size are
replicated; a vocabulary that does not divide is replicated). A rule set that would put one mesh
axis on two dimensions of the same array is refused.

Mixture-of-experts models add the logical axes expert / moe_mlp / router, and the stage mesh has
an "expert" axis besides "tensor" (sharding.mesh; size `expert_parallel_size`, 1 by default).
Attention, dense MLPs, shared experts, embedding and head name only "tensor", so they are
replicated over "expert". The experts (the MoE presets, read by jvllm.models.moe through
`moe_mesh_axes`, so the parameter shardings and the expert computation's shard_map come from the
same entries):
  TENSOR  experts over "expert", each expert's hidden dimension (moe_mlp) split over "tensor";
  EXPERT  (enable_expert_parallel) experts over ("expert", "tensor"), i.e. over every device of the
          stage (EP = expert_parallel_size x tensor_parallel_size), each expert whole on one device.
The router is always replicated.

Tensor parallel is Megatron-style by construction: q/k/v and gate/up are sharded on their output
(heads / mlp) dimension, o_proj and down_proj on their input dimension, so XLA inserts exactly one
all-reduce after attention and one after the MLP; the embedding and LM head are vocab-parallel;
the KV pool is sharded by KV heads.
"""
from __future__ import annotations

from jax.sharding import NamedSharding, PartitionSpec

REPLICATED = {"vocab": None, "embed": None, "heads": None, "kv_heads": None, "head_dim": None, "mlp": None,
              "norm": None, "expert": None, "moe_mlp": None, "router": None, "positions": None}
TENSOR = dict(REPLICATED, vocab="tensor", heads="tensor", kv_heads="tensor", mlp="tensor",
              expert="expert", moe_mlp="tensor")
# Expert parallel (vLLM's enable_expert_parallel): attention, dense MLPs and shared experts as
# TENSOR; the experts' leading dimension over every device of the stage, each expert whole on one
# device (see jvllm.ops.grouped_matmul for the token routing).
EXPERT = dict(TENSOR, expert=("expert", "tensor"), moe_mlp=None)
PRESETS = {"replicated": REPLICATED, "tensor": TENSOR, "expert": EXPERT}


def _mesh_axes(entry) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def moe_mesh_axes(expert_parallel: bool) -> tuple[tuple[str, ...], str | None]:
    """(mesh axes the experts are split over, mesh axis each expert's hidden dimension is split
    over or None) under the preset the engine uses (EXPERT with enable_expert_parallel, else TENSOR)."""
    r = EXPERT if expert_parallel else TENSOR
    hidden = _mesh_axes(r["moe_mlp"])
    return _mesh_axes(r["expert"]), (hidden[0] if hidden else None)


def valid_tp_sizes(cfg, limit: int = 64, expert_parallel: bool = False, ep: int = 1) -> list[int]:
    """TP sizes that fit `cfg` next to `ep` expert groups. The experts: with `expert_parallel`
    num_experts must divide over ep x tp devices, else over ep groups with expert_size over tp."""
    moe = getattr(cfg, "moe", None)

    def experts_fit(t):
        if moe is None:
            return ep == 1
        if moe.shared_expert_size % t:
            return False
        if expert_parallel:
            return moe.num_experts % (ep * t) == 0
        return moe.num_experts % ep == 0 and moe.expert_size % t == 0

    return [t for t in range(1, limit + 1)
            if cfg.num_heads % t == 0 and cfg.intermediate_size % t == 0
            and (cfg.num_kv_heads % t == 0 or t % cfg.num_kv_heads == 0) and experts_fit(t)]


def parallel_rules(cfg, tp: int, ep: int = 1, expert_parallel: bool = False) -> dict:
    """The rules for `cfg` on a stage mesh of `ep` expert groups x `tp` tensor devices: the EXPERT
    preset with `expert_parallel` (enable_expert_parallel), else TENSOR; REPLICATED on one device.
    ValueError naming the numbers when a size does not fit (heads, KV heads, intermediate size,
    experts) or when `ep` > 1 / `expert_parallel` is asked of a model without experts."""
    moe = getattr(cfg, "moe", None)
    if moe is None and (expert_parallel or ep > 1):
        what = "enable_expert_parallel" if expert_parallel else f"expert_parallel_size {ep}"
        raise ValueError(f"{what} needs a mixture-of-experts model; {cfg.architecture} has no experts")
    if not isinstance(ep, int) or isinstance(ep, bool) or ep < 1:
        raise ValueError(f"expert_parallel_size must be a positive integer, got {ep!r}")
    if tp * ep == 1:
        return dict(REPLICATED)
    ok = valid_tp_sizes(cfg, expert_parallel=expert_parallel, ep=ep)
    if tp not in ok:
        prefix = "enable_expert_parallel: " if expert_parallel else ""
        experts = ""
        if moe is not None:
            experts = (f"num_experts {moe.num_experts} over expert_parallel_size {ep}"
                       f"{' x tensor_parallel_size' if expert_parallel else ''}, expert size {moe.expert_size}, "
                       f"shared expert size {moe.shared_expert_size}, ")
        raise ValueError(
            f"{prefix}tensor_parallel_size {tp} does not fit this model: {experts}num_attention_heads "
            f"{cfg.num_heads}, num_key_value_heads {cfg.num_kv_heads}, intermediate_size {cfg.intermediate_size}; "
            f"sizes that work: {', '.join(map(str, ok)) or 'none'}")
    rules = dict(EXPERT if expert_parallel else TENSOR)
    if cfg.num_kv_heads % tp:
        rules["kv_heads"] = None  # fewer KV heads than ranks: every rank keeps all KV heads
    if cfg.vocab_size % tp:
        rules["vocab"] = None
    return rules


def expert_parallel_rules(cfg, tp: int, ep: int = 1) -> dict:
    """`parallel_rules` with enable_expert_parallel (the experts over ep x tp devices)."""
    if getattr(cfg, "moe", None) is None:
        raise ValueError(f"enable_expert_parallel needs a mixture-of-experts model; {cfg.architecture} has no experts")
    return parallel_rules(cfg, tp, ep, expert_parallel=True)


def tensor_parallel_rules(cfg, tp: int, ep: int = 1) -> dict:
    """`parallel_rules` without enable_expert_parallel (experts, if any, over the ep groups)."""
    return parallel_rules(cfg, tp, ep)


def partition_spec(axes: tuple[str, ...], rules: dict) -> PartitionSpec:
    mesh_axes = []
    for a in axes:
        if a not in rules:
            raise ValueError(f"no sharding rule for logical axis {a!r}")
        mesh_axes.append(rules[a])
    used = [a for m in mesh_axes for a in _mesh_axes(m)]
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
