"""Checkpoint tensor names -> jvllm parameter names, declaratively, with shape-checked transforms.

`HF_RULES` maps a transformers-style tensor name (regex) to a jvllm parameter name template and a
transform. `None` as a target means "drop" (e.g. rotary inv_freq buffers). A tuple of templates
splits one fused tensor into several parameters (Phi-3's qkv_proj, gate_up_proj): its transform
takes the targets' shapes and returns one array per target. `HF_RULES_BY_MAP` holds each family's
rules under the key its registration names (`jvllm.models.registry.Family.name_map`). Each transform derives
the *source* shape it expects from the declared target shape and raises `CheckpointError` naming
the tensor when they differ, so a wrong checkpoint never produces silently reshaped garbage.

`convert_tensors` streams (name, loader) pairs: each tensor is read, transformed, cast and handed to
`put` (e.g. `jax.device_put` into a sharding) one at a time, so peak host memory is about one tensor.
"""
from __future__ import annotations

import re
from typing import Callable, Iterable

import numpy as np

from .moe_names import ExpertSlice, moe_rules


class CheckpointError(ValueError):
    """A checkpoint that does not match the model's declared parameters, or a damaged file."""


def _expect(name, arr, shape):
    if tuple(arr.shape) != tuple(shape):
        raise CheckpointError(f"tensor {name!r}: shape {tuple(arr.shape)} but the model expects {tuple(shape)} "
                              f"in checkpoint layout")


def t_identity(name, a, tgt):
    _expect(name, a, tgt)
    return a


def t_transpose(name, a, tgt):  # torch Linear [out, in] -> [in, out]
    _expect(name, a, (tgt[1], tgt[0]))
    return a.T


def t_in_heads(name, a, tgt):  # [heads*hd, embed] -> [embed, heads, hd]
    d, h, hd = tgt
    _expect(name, a, (h * hd, d))
    return a.T.reshape(d, h, hd)


def t_out_heads(name, a, tgt):  # [embed, heads*hd] -> [heads, hd, embed]
    h, hd, d = tgt
    _expect(name, a, (d, h * hd))
    return a.T.reshape(h, hd, d)


def t_bias_heads(name, a, tgt):  # [heads*hd] -> [heads, hd]
    h, hd = tgt
    _expect(name, a, (h * hd,))
    return a.reshape(h, hd)


def t_qk_norm(name, a, tgt):  # [hd] shared; [heads, hd] per head (Cohere); [heads*hd] -> [heads, hd] (OLMo)
    if len(tgt) == 1 or a.ndim == 2:
        return t_identity(name, a, tgt)
    return t_bias_heads(name, a, tgt)


def t_split_qkv(name, a, tgts):  # [(H+2K)*hd, embed] -> q [embed, H, hd], k, v [embed, K, hd]
    (d, h, hd), (_, k, _), _ = tgts
    _expect(name, a, ((h + 2 * k) * hd, d))
    q, kk, v = np.split(a, [h * hd, (h + k) * hd], axis=0)
    return q.T.reshape(d, h, hd), kk.T.reshape(d, k, hd), v.T.reshape(d, k, hd)


def t_split_gate_up(name, a, tgts):  # [2*mlp, embed] (gate rows first) -> gate, up [embed, mlp]
    (d, i), _ = tgts
    _expect(name, a, (2 * i, d))
    return a[:i].T, a[i:].T


# Fused experts come in two layouts, told apart by shape as transformers 5 does (its Transpose with
# check_dims: a tensor already in its in-memory shape is kept, so a square one reads as that):
# transformers 5's in-memory [E, 2I, D] / [E, D, I], and Qwen3-VL-MoE's hub checkpoints' [E, D, 2I] /
# [E, I, D] (transformers 4's Qwen3VLMoeTextExperts).
def t_experts_gate_up(name, a, tgts):  # fused experts [E, 2*I, D] (gate rows first) -> gate, up [E, D, I]
    (e, d, i), _ = tgts
    if tuple(a.shape) == (e, d, 2 * i) != (e, 2 * i, d):  # the hub layout: gate columns first
        return a[:, :, :i], a[:, :, i:]
    _expect(name, a, (e, 2 * i, d))
    return a[:, :i].transpose(0, 2, 1), a[:, i:].transpose(0, 2, 1)


def t_experts_down(name, a, tgt):  # fused experts [E, D, I] -> [E, I, D]
    e, i, d = tgt
    if tuple(a.shape) == (e, i, d) != (e, d, i):  # the hub layout: already the model's
        return a
    _expect(name, a, (e, d, i))
    return a.transpose(0, 2, 1)


def t_row(name, a, tgt):  # Linear(D, 1) [1, D] -> [D]
    _expect(name, a, (1, tgt[0]))
    return a[0]


_L = r"model\.layers\.(\d+)\."
HF_RULES: list[tuple[str, str | None, Callable | None]] = [
    (r"model\.embed_tokens\.weight", "embed", t_identity),
    (_L + r"self_attn\.(q|k|v)_proj\.weight", r"layers.\1.self_attn.\2_proj", t_in_heads),
    (_L + r"self_attn\.(q|k|v)_proj\.bias", r"layers.\1.self_attn.\2_bias", t_bias_heads),
    (_L + r"self_attn\.o_proj\.weight", r"layers.\1.self_attn.o_proj", t_out_heads),
    (_L + r"self_attn\.o_proj\.bias", r"layers.\1.self_attn.o_bias", t_identity),
    (_L + r"self_attn\.(q|k)_norm\.weight", r"layers.\1.self_attn.\2_norm.weight", t_qk_norm),
    (_L + r"mlp\.(gate|up|down)_proj\.weight", r"layers.\1.mlp.\2_proj", t_transpose),
    (_L + r"mlp\.(gate|up|down)_proj\.bias", r"layers.\1.mlp.\2_bias", t_identity),
    (_L + r"(input_layernorm|post_attention_layernorm)\.weight", r"layers.\1.\2.weight", t_identity),
    (r"model\.norm\.weight", "norm.weight", t_identity),
    (r"lm_head\.weight", "lm_head", t_transpose),
    (_L + r"self_attn\.rotary_emb\.inv_freq", None, None),
    (r"model\.rotary_emb\.inv_freq", None, None),
]
GEMMA_RULES = HF_RULES + [  # the sandwich norms around the MLP
    (_L + r"(pre_feedforward_layernorm|post_feedforward_layernorm)\.weight", r"layers.\1.\2.weight", t_identity),
]
OLMO_RULES = [  # the post-MLP norm (the q/k norms over the whole projection: t_qk_norm)
    (_L + r"post_feedforward_layernorm\.weight", r"layers.\1.post_feedforward_layernorm.weight", t_identity),
] + HF_RULES
FUSED_RULES = [  # fused qkv_proj (Phi-3) and gate_up_proj (Phi-3, GLM) split into the model's parameters
    (_L + r"self_attn\.qkv_proj\.weight",
     (r"layers.\1.self_attn.q_proj", r"layers.\1.self_attn.k_proj", r"layers.\1.self_attn.v_proj"), t_split_qkv),
    (_L + r"mlp\.gate_up_proj\.weight", (r"layers.\1.mlp.gate_proj", r"layers.\1.mlp.up_proj"), t_split_gate_up),
] + HF_RULES
NORM_BIAS_RULES = [  # LayerNorms with biases under Llama's norm names (StarCoder2, Nemotron, Phi-3.5-MoE)
    (_L + r"(input_layernorm|post_attention_layernorm)\.bias", r"layers.\1.\2.bias", t_identity),
    (r"model\.norm\.bias", "norm.bias", t_identity),
]
STARCODER2_RULES = [  # LayerNorms with biases; the ungated MLP's c_fc / c_proj
    (_L + r"mlp\.c_fc\.weight", r"layers.\1.mlp.up_proj", t_transpose),
    (_L + r"mlp\.c_fc\.bias", r"layers.\1.mlp.up_bias", t_identity),
    (_L + r"mlp\.c_proj\.weight", r"layers.\1.mlp.down_proj", t_transpose),
    (_L + r"mlp\.c_proj\.bias", r"layers.\1.mlp.down_bias", t_identity),
] + NORM_BIAS_RULES + HF_RULES
LM_HEAD_BIAS_RULE = (r"lm_head\.bias", "lm_head_bias", t_identity)
_QKV = (r"layers.\1.self_attn.q_proj", r"layers.\1.self_attn.k_proj", r"layers.\1.self_attn.v_proj")
_QKV_BIAS = (r"layers.\1.self_attn.q_bias", r"layers.\1.self_attn.k_bias", r"layers.\1.self_attn.v_bias")
PHI_RULES = [  # Phi-1 / 1.5 / 2: dense, fc1 / fc2, LayerNorms with biases, q/k LayerNorms, a biased head
    (_L + r"self_attn\.dense\.weight", r"layers.\1.self_attn.o_proj", t_out_heads),
    (_L + r"self_attn\.dense\.bias", r"layers.\1.self_attn.o_bias", t_identity),
    (_L + r"self_attn\.(q|k)_layernorm\.(weight|bias)", r"layers.\1.self_attn.\2_norm.\3", t_identity),
    (_L + r"mlp\.fc1\.weight", r"layers.\1.mlp.up_proj", t_transpose),
    (_L + r"mlp\.fc1\.bias", r"layers.\1.mlp.up_bias", t_identity),
    (_L + r"mlp\.fc2\.weight", r"layers.\1.mlp.down_proj", t_transpose),
    (_L + r"mlp\.fc2\.bias", r"layers.\1.mlp.down_bias", t_identity),
    (_L + r"input_layernorm\.bias", r"layers.\1.input_layernorm.bias", t_identity),
    (r"model\.final_layernorm\.(weight|bias)", r"norm.\1", t_identity),
    LM_HEAD_BIAS_RULE,
] + HF_RULES
GLM4_RULES = [  # GLM-4's sandwich norms under the names of jvllm's sandwich layer (models/gemma.py)
    (_L + r"post_self_attn_layernorm\.weight", r"layers.\1.post_attention_layernorm.weight", t_identity),
    (_L + r"post_attention_layernorm\.weight", r"layers.\1.pre_feedforward_layernorm.weight", t_identity),
    (_L + r"post_mlp_layernorm\.weight", r"layers.\1.post_feedforward_layernorm.weight", t_identity),
] + FUSED_RULES
HUNYUAN_RULES = [  # HunYuan's q/k norms (after rope) under the model's q_norm / k_norm
    (_L + r"self_attn\.query_layernorm\.weight", r"layers.\1.self_attn.q_norm.weight", t_identity),
    (_L + r"self_attn\.key_layernorm\.weight", r"layers.\1.self_attn.k_norm.weight", t_identity),
] + HF_RULES
def t_scalar(name, a, tgt):  # a 0-d tensor (a stored buffer) -> [1]
    if tuple(a.shape) not in ((), (1,)) or tuple(tgt) != (1,):
        _expect(name, a, ())
    return np.reshape(a, (1,))


APERTUS_RULES = [  # Apertus's pre-norms under Llama's names; its xIELU's learned scalars
    (_L + r"attention_layernorm\.weight", r"layers.\1.input_layernorm.weight", t_identity),
    (_L + r"feedforward_layernorm\.weight", r"layers.\1.post_attention_layernorm.weight", t_identity),
    (_L + r"mlp\.act_fn\.(alpha_p|alpha_n)", r"layers.\1.mlp.\2", t_identity),
    (_L + r"mlp\.act_fn\.(beta|eps)", r"layers.\1.mlp.\2", t_scalar),
] + HF_RULES

# the GPT lineage's maps live in gpt_names (which imports the transforms and templates above)
from .gpt_names import (BIGCODE_RULES, FALCON_RULES, GPT2_RULES, GPTJ_RULES, NEOX_RULES,  # noqa: E402
                        OPT_RULES)

HF_RULES_BY_MAP = {"llama": HF_RULES, "gemma": GEMMA_RULES, "fused": FUSED_RULES, "glm4": GLM4_RULES, "olmo": OLMO_RULES,
                   "hunyuan": HUNYUAN_RULES, "apertus": APERTUS_RULES,
                   "gpt2": GPT2_RULES, "opt": OPT_RULES, "gptj": GPTJ_RULES, "gpt_bigcode": BIGCODE_RULES, "falcon": FALCON_RULES, "gpt_neox": NEOX_RULES, "starcoder2": STARCODER2_RULES, "phi": PHI_RULES,
                   "moe": HF_RULES + moe_rules(t_transpose, t_row, t_experts_gate_up, t_experts_down, t_identity,
                                                        t_split_gate_up) + NORM_BIAS_RULES + [LM_HEAD_BIAS_RULE]}
_COMPILED = {k: [(re.compile(p + r"\Z"), t, f) for p, t, f in rules] for k, rules in HF_RULES_BY_MAP.items()}


def map_name(name: str, name_map: str = "llama"):
    """(jvllm name, a tuple of names for a fused tensor, or None to drop; transform) under the
    family name map `name_map`; raises CheckpointError for an unknown tensor."""
    if name_map not in _COMPILED:
        raise ValueError(f"unknown name map {name_map!r}; known: {', '.join(_COMPILED)}")
    for rx, tgt, fn in _COMPILED[name_map]:
        m = rx.match(name)
        if m:
            if isinstance(tgt, tuple):
                return tuple(m.expand(t) for t in tgt), fn
            if isinstance(fn, ExpertSlice):
                fn = fn.at(int(m.group("expert")))
            return (m.expand(tgt) if tgt is not None else None), fn
    from .quantization import map_scale_name, quantized_name_error

    scale = map_scale_name(name, lambda w: map_name(w, name_map))  # a pre-quantized layer's scale
    if scale is not None:
        return scale
    quant = quantized_name_error(name)
    if quant is not None:
        raise quant
    raise CheckpointError(f"unexpected tensor {name!r} in checkpoint (no parameter of this model maps to it)")


def _absent_shared_expert(tgts, specs, load) -> bool:
    """Qwen2-MoE with shared_expert_intermediate_size 0: transformers still saves a zero-width
    shared expert and its [1, D] gate, whose product adds exactly 0; a model without a shared
    expert skips them (a shared expert of nonzero width still fails as unexpected)."""
    if any(".shared_expert" not in t for t in tgts) or any(".shared_expert" in k for k in specs):
        return False
    return all(t.endswith(".shared_expert_gate") for t in tgts) or load().size == 0


def convert_tensors(specs: dict, tensors: Iterable[tuple[str, Callable[[], np.ndarray]]], dtype,
                    put: Callable[[str, np.ndarray], object] | None = None,
                    tied_embeddings: bool = False, name_map: str = "llama") -> dict:
    """Convert a stream of checkpoint tensors into {jvllm name: put(array)}.

    specs: `jvllm.models.param_specs(cfg)`; tensors: (checkpoint name, zero-arg loader) pairs;
    dtype: numpy-compatible target dtype of stacked experts (every other tensor is cast to its
    spec's dtype: the model dtype, or a pre-quantized model's float8 weights and float32
    scales). Errors name the tensor: unexpected, duplicate, wrong
    shape, non-finite values are *not* checked (they are legal), missing ones are listed together.
    """
    put = put or (lambda name, a: a)
    out = {}
    stacks: dict[str, tuple[np.ndarray, set]] = {}  # stacked expert targets still being filled
    for src, load in tensors:
        tgt, fn = map_name(src, name_map)
        if tgt is None or (tgt == "lm_head" and tied_embeddings):
            continue
        if isinstance(fn, ExpertSlice):
            if tgt not in specs:
                raise CheckpointError(f"unexpected tensor {src!r}: this model declares no parameter {tgt!r}")
            if tgt in out:
                raise CheckpointError(f"tensor {src!r} appears twice in the checkpoint")
            shape = specs[tgt][0]
            if fn.index >= shape[0]:
                raise CheckpointError(f"tensor {src!r}: expert {fn.index} but the model has {shape[0]} experts")
            buf, seen = stacks.setdefault(tgt, (np.empty(shape, dtype), set()))
            if fn.index in seen:
                raise CheckpointError(f"tensor {src!r} appears twice in the checkpoint")
            buf[fn.index] = fn.fn(src, load(), shape[1:])
            seen.add(fn.index)
            if len(seen) == shape[0]:
                out[tgt] = put(tgt, buf)
                del stacks[tgt]
            continue
        tgts = tgt if isinstance(tgt, tuple) else (tgt,)
        if _absent_shared_expert(tgts, specs, load):
            continue
        for t in tgts:
            if t not in specs:
                if t.endswith("_scale"):
                    from .quantization import quantized_name_error

                    raise quantized_name_error(src) or CheckpointError(f"unexpected tensor {src!r}")
                raise CheckpointError(f"unexpected tensor {src!r}: this model declares no parameter {t!r}")
            if t in out:
                raise CheckpointError(f"tensor {src!r} appears twice in the checkpoint")
        if isinstance(tgt, tuple):
            arrs = fn(src, load(), [specs[t][0] for t in tgts])
        else:
            arrs = (fn(src, load(), specs[tgt][0]),)
        for t, arr in zip(tgts, arrs):
            want = specs[t][1]  # the model dtype, or a pre-quantized model's float8 / float32 scale
            if not t.endswith("_scale"):
                from .quantization import unexpected_quantized_error

                bad = unexpected_quantized_error(src, arr.dtype, want)
                if bad is not None:
                    raise bad
            out[t] = put(t, np.ascontiguousarray(arr).astype(want, copy=False))
    for tgt, (buf, seen) in sorted(stacks.items()):
        absent = sorted(set(range(buf.shape[0])) - seen)
        raise CheckpointError(f"checkpoint is missing expert(s) {absent[:8]} of {tgt!r} ({len(seen)} of {buf.shape[0]})")
    missing = sorted(set(specs) - set(out))
    if missing:
        raise CheckpointError(f"checkpoint is missing {len(missing)} tensor(s) the model needs: "
                              f"{', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")
    return out
