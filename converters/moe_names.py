"""Checkpoint names of the mixture-of-experts families (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, GLM-4.5,
dots.llm1, ERNIE 4.5 MoE, MiniMax-M2, GraniteMoe, Phi-3.5-MoE).

Checkpoints store each expert as its own tensors (`...experts.{j}.w1.weight`; transformers 5's
in-memory names fuse them, `...experts.gate_up_proj`, which load whole); jvllm stacks them
into one parameter per layer and projection, `[num_experts, ...]` (jvllm.models.moe). A rule whose
transform is an `ExpertSlice` fills slot j of its target; `name_map.convert_tensors` collects the
slots and places the target once every slot has arrived (so host memory holds at most the stacked
tensors still being filled, one per projection when the checkpoint is in layer order).
"""
from __future__ import annotations

import dataclasses
from typing import Callable


@dataclasses.dataclass(frozen=True)
class ExpertSlice:
    """Marks a rule's transform as filling one expert's slot of a stacked [E, ...] target: the
    expert index is the rule pattern's group named "expert"; `fn(name, array, slot_shape)` converts it."""
    fn: Callable
    index: int = -1

    def at(self, index: int) -> "ExpertSlice":
        return dataclasses.replace(self, index=index)


def moe_rules(t_transpose, t_row, t_experts_gate_up, t_experts_down, t_identity, t_split_gate_up) -> list:
    """(pattern, target, transform) rules, in name_map's form, for the MoE families."""
    L = r"model\.layers\.(\d+)\."
    x = ExpertSlice(t_transpose)
    return [
        # Mixtral: block_sparse_moe.{gate, experts.j.w1 (gate) / w3 (up) / w2 (down)}
        (L + r"block_sparse_moe\.gate\.weight", r"layers.\1.mlp.router", t_transpose),
        (L + r"block_sparse_moe\.experts\.(?P<expert>\d+)\.w1\.weight", r"layers.\1.mlp.expert_gate", x),
        (L + r"block_sparse_moe\.experts\.(?P<expert>\d+)\.w3\.weight", r"layers.\1.mlp.expert_up", x),
        (L + r"block_sparse_moe\.experts\.(?P<expert>\d+)\.w2\.weight", r"layers.\1.mlp.expert_down", x),
        # Qwen2-MoE / Qwen3-MoE: mlp.{gate, experts.j.*_proj, shared_expert.*_proj, shared_expert_gate}
        (L + r"mlp\.gate\.weight", r"layers.\1.mlp.router", t_transpose),
        (L + r"mlp\.experts\.(?P<expert>\d+)\.(gate|up|down)_proj\.weight", r"layers.\1.mlp.expert_\3", x),
        (L + r"mlp\.shared_expert\.(gate|up|down)_proj\.weight", r"layers.\1.mlp.shared_expert.\2_proj", t_transpose),
        (L + r"mlp\.shared_expert_gate\.weight", r"layers.\1.mlp.shared_expert_gate", t_row),
        # GLM-4.5 (DeepSeek-V3's layout): shared_experts (plural, no gate), the router's selection bias
        (L + r"mlp\.shared_experts\.(gate|up|down)_proj\.weight", r"layers.\1.mlp.shared_expert.\2_proj", t_transpose),
        (L + r"mlp\.gate\.e_score_correction_bias", r"layers.\1.mlp.router_bias", t_identity),
        # ERNIE 4.5 MoE: the selection bias as [1, E], on the hub under mlp.moe_statics (transformers
        # 5 keeps it under mlp.gate.moe_statics)
        (L + r"mlp\.(?:gate\.)?moe_statics\.e_score_correction_bias", r"layers.\1.mlp.router_bias", t_row),
        # MiniMax-M2: the selection bias beside Mixtral's names (transformers 5: mlp.e_score_correction_bias)
        (L + r"(?:block_sparse_moe|mlp)\.e_score_correction_bias", r"layers.\1.mlp.router_bias", t_identity),
        # GraniteMoe: fused experts under block_sparse_moe (input_linear [E, 2I, D], gate rows first;
        # output_linear [E, D, I]; transformers 5: experts.gate_up_proj / down_proj), the router as
        # router.layer (transformers 5: router), GraniteMoeShared's shared_mlp (input_linear [2S, D])
        (L + r"block_sparse_moe\.(?:input_linear\.weight|experts\.gate_up_proj)",
         (r"layers.\1.mlp.expert_gate", r"layers.\1.mlp.expert_up"), t_experts_gate_up),
        (L + r"block_sparse_moe\.(?:output_linear\.weight|experts\.down_proj)", r"layers.\1.mlp.expert_down",
         t_experts_down),
        (L + r"block_sparse_moe\.router\.(?:layer\.)?weight", r"layers.\1.mlp.router", t_transpose),
        (L + r"shared_mlp\.input_linear\.weight",
         (r"layers.\1.mlp.shared_expert.gate_proj", r"layers.\1.mlp.shared_expert.up_proj"), t_split_gate_up),
        (L + r"shared_mlp\.output_linear\.weight", r"layers.\1.mlp.shared_expert.down_proj", t_transpose),
        # transformers 5's in-memory layout (a torch.save of its state_dict): every expert fused,
        # experts.gate_up_proj [E, 2I, D] (gate rows first) and experts.down_proj [E, D, I]
        (L + r"mlp\.experts\.gate_up_proj", (r"layers.\1.mlp.expert_gate", r"layers.\1.mlp.expert_up"),
         t_experts_gate_up),
        (L + r"mlp\.experts\.down_proj", r"layers.\1.mlp.expert_down", t_experts_down),
    ]
