"""GGUF files of the mixture-of-experts families: architecture, config and names.

What llama.cpp's converter (convert_hf_to_gguf.py) writes, and how it reads back as HF:

  GGUF arch   HF architecture                        experts
  llama       MixtralForCausalLM when {arch}.expert_count > 0 (Mixtral has no arch of its own)
  qwen2moe    Qwen2MoeForCausalLM (shared expert + sigmoid gate; every layer sparse)
  qwen3moe    Qwen3MoeForCausalLM (q/k norms; top-k renormalised)
  olmoe       OlmoeForCausalLM (q/k norms over the whole projection; top-k not renormalised;
              the experts' size is feed_forward_length)

Experts are stacked per layer and projection: `blk.N.ffn_{gate,up,down}_exps.weight` with numpy
shape [E, out, in] (each expert as HF's Linear weight), the router `blk.N.ffn_gate_inp.weight`
[E, D]; Qwen2-MoE's shared expert is `ffn_{gate,up,down}_shexp` and its gate `ffn_gate_inp_shexp`
([D] in llama.cpp's tensor table; [1, D] is accepted too). `expert_tensors` splits a stacked
tensor into HF's per-expert names, so the HF name map (converters.moe_names) converts them like a
safetensors checkpoint; the stacked tensor is dequantized once for all its experts. Mixtral files
of llama.cpp's older layout store each expert on its own (`blk.N.ffn_gate.J.weight`, HF's [out, in]);
they map name by name (MIXTRAL_RULES), `check_split_experts` names a missing one.

Router normalisation: `{arch}.expert_weights_norm` when the file has it, else what llama.cpp's
graph does for the arch (Mixtral and Qwen3-MoE renormalise the top-k weights, Qwen2-MoE and
OLMoE do not).
A gating function other than softmax (`{arch}.expert_gating_func`) is refused by name.
"""
from __future__ import annotations

import re

import numpy as np

from .name_map import CheckpointError

# GGUF arch -> (HF architecture, HF model_type) for the files this module reads
MOE_ARCHS = {"llama": ("MixtralForCausalLM", "mixtral"), "qwen2moe": ("Qwen2MoeForCausalLM", "qwen2_moe"),
             "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"), "olmoe": ("OlmoeForCausalLM", "olmoe")}
_NORM_TOPK_DEFAULT = {"llama": True, "qwen2moe": False, "qwen3moe": True, "olmoe": False}
_SOFTMAX_GATING = 1  # llama.cpp LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX

# stacked expert tensors: (pattern, HF per-expert name with {j}) per GGUF arch
_MIXTRAL_W = {"gate": "w1", "down": "w2", "up": "w3"}
_EXPERT_RX = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight\Z")
MOE_RULES = [
    (r"blk\.(\d+)\.ffn_gate_inp\.weight", r"model.layers.\1.mlp.gate.weight"),
    (r"blk\.(\d+)\.ffn_(gate|up|down)_shexp\.weight", r"model.layers.\1.mlp.shared_expert.\2_proj.weight"),
    (r"blk\.(\d+)\.ffn_gate_inp_shexp\.weight", r"model.layers.\1.mlp.shared_expert_gate.weight"),
]
# Mixtral files of llama.cpp's older layout (before its stacked *_exps tensors) store each expert
# on its own: blk.N.ffn_{gate,up,down}.J.weight, numpy shape [out, in] like HF's Linear weight
MIXTRAL_RULES = [(r"blk\.(\d+)\.ffn_gate_inp\.weight", r"model.layers.\1.block_sparse_moe.gate.weight")] + [
    (rf"blk\.(\d+)\.ffn_{p}\.(\d+)\.weight", rf"model.layers.\1.block_sparse_moe.experts.\2.{w}.weight")
    for p, w in _MIXTRAL_W.items()]
_SPLIT_RX = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)\.weight\Z")


def check_split_experts(names, num_experts: int) -> None:
    """For Mixtral's per-expert layout: every (layer, projection) that has any per-expert tensor
    has all `num_experts` of them and no stacked `_exps` tensor besides; CheckpointError naming
    the missing, extra or doubled GGUF tensors otherwise."""
    split: dict = {}
    for n in names:
        m = _SPLIT_RX.match(n)
        if m:
            split.setdefault((int(m.group(1)), m.group(2)), set()).add(int(m.group(3)))
    for (layer, proj), got in sorted(split.items()):
        stacked = f"blk.{layer}.ffn_{proj}_exps.weight"
        if stacked in names:
            raise CheckpointError(f"GGUF layer {layer} stores its {proj} experts twice: {stacked!r} and "
                                  f"per-expert tensors blk.{layer}.ffn_{proj}.J.weight")
        extra = sorted(j for j in got if j >= num_experts)
        if extra:
            raise CheckpointError(f"GGUF tensor 'blk.{layer}.ffn_{proj}.{extra[0]}.weight' names expert {extra[0]} "
                                  f"but the file has {num_experts} experts (expert_count)")
        absent = [f"blk.{layer}.ffn_{proj}.{j}.weight" for j in range(num_experts) if j not in got]
        if absent:
            raise CheckpointError(f"GGUF file is missing expert tensor(s) {', '.join(absent[:8])} "
                                  f"({len(got)} of {num_experts} experts of layer {layer}'s {proj})")


def is_moe_llama(fields: dict) -> bool:
    return int(fields.get("llama.expert_count", 0) or 0) > 0


def moe_fields(arch: str, g, cfg: dict) -> dict:
    """The HF config fields of a MoE file (`g(key)` reads `{arch}.key`); `cfg` is the dense part."""
    gating = g("expert_gating_func")
    if gating is not None and int(gating) != _SOFTMAX_GATING:
        raise ValueError(f"GGUF {arch}.expert_gating_func {gating} is not supported (only softmax, {_SOFTMAX_GATING})")
    E, k = g("expert_count"), g("expert_used_count")
    if not E or not k:
        raise ValueError(f"GGUF arch {arch!r} needs {arch}.expert_count and {arch}.expert_used_count "
                         f"(got {E!r}, {k!r})")
    norm = g("expert_weights_norm")
    norm = _NORM_TOPK_DEFAULT[arch] if norm is None else bool(norm)
    if arch == "llama":
        if not norm:
            raise ValueError("GGUF llama (Mixtral) with expert_weights_norm false is not supported: "
                             "Mixtral renormalises its top-k weights")
        return {"num_local_experts": int(E), "num_experts_per_tok": int(k)}
    if arch == "olmoe":  # every layer sparse; HF's intermediate_size is the experts' size
        return {"num_experts": int(E), "num_experts_per_tok": int(k), "norm_topk_prob": norm}
    out = {"num_experts": int(E), "num_experts_per_tok": int(k), "norm_topk_prob": norm,
           "moe_intermediate_size": int(g("expert_feed_forward_length") or cfg["intermediate_size"]),
           "decoder_sparse_step": 1, "mlp_only_layers": []}
    if arch == "qwen2moe":
        out["shared_expert_intermediate_size"] = int(g("expert_shared_feed_forward_length") or 0)
        out["attention_bias"] = True
    return out


def is_stacked_experts(name: str) -> bool:
    return _EXPERT_RX.match(name) is not None


def expert_tensors(name: str, arch: str, load, num_experts: int):
    """[(HF name, loader)] for the experts of the stacked GGUF tensor `name` (is_stacked_experts). `load()` returns the float32 [E, out, in] array; it runs once, on the first expert
    loaded, and the stack is dropped after the last one (CheckpointError naming the tensor when
    its leading dimension is not `num_experts`)."""
    m = _EXPERT_RX.match(name)
    layer, proj = m.group(1), m.group(2)
    if arch == "llama":
        fmt = f"model.layers.{layer}.block_sparse_moe.experts.{{j}}.{_MIXTRAL_W[proj]}.weight"
    else:
        fmt = f"model.layers.{layer}.mlp.experts.{{j}}.{proj}_proj.weight"
    cache: dict = {}

    def get(j):
        if "a" not in cache:
            a = load()
            if a.ndim != 3 or a.shape[0] != num_experts:
                raise CheckpointError(f"GGUF tensor {name!r} has shape {a.shape}; expected [{num_experts}, out, in] "
                                      f"({num_experts} experts)")
            cache["a"], cache["left"] = a, num_experts
        a = cache["a"][j]
        cache["left"] -= 1
        if cache["left"] == 0:
            cache.pop("a")
        return np.ascontiguousarray(a)

    return [(fmt.format(j=j), (lambda j=j: get(j))) for j in range(num_experts)]


def shared_gate_row(a: np.ndarray) -> np.ndarray:
    """llama.cpp's [D] shared-expert gate as HF's [1, D] Linear weight."""
    return a.reshape(1, -1) if a.ndim == 1 else a
