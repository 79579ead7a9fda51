"""The checkpoint names of the GPT lineage's families (GPT-2, OPT, GPT-J, GPTBigCode, Falcon,
GPT-NeoX): their name-map rules and the transforms of their fused or Conv1D tensors, beside the
Llama-style maps of `name_map` (which lists every map in HF_RULES_BY_MAP and imports these)."""
from __future__ import annotations

import numpy as np

from .name_map import (_QKV, _QKV_BIAS, LM_HEAD_BIAS_RULE, _expect, t_bias_heads, t_identity, t_in_heads,
                       t_out_heads, t_transpose)


def t_conv1d_qkv(name, a, tgts):  # GPT-2's Conv1D c_attn [embed, 3 * H*hd] (q | k | v) -> q, k, v [embed, H, hd]
    (d, h, hd), _, _ = tgts
    _expect(name, a, (d, 3 * h * hd))
    return tuple(p.reshape(d, h, hd) for p in np.split(a, 3, axis=1))


def t_conv1d_qkv_bias(name, a, tgts):  # [3 * H*hd] -> q, k, v biases [H, hd]
    (h, hd), _, _ = tgts
    _expect(name, a, (3 * h * hd,))
    return tuple(p.reshape(h, hd) for p in np.split(a, 3))


def t_conv1d_out_heads(name, a, tgt):  # GPT-2's Conv1D attn.c_proj [H*hd, embed] -> [H, hd, embed]
    h, hd, d = tgt
    _expect(name, a, (h * hd, d))
    return a.reshape(h, hd, d)


def t_neox_qkv(name, a, tgts):  # [H * (q | k | v) * hd, embed], per head -> q, k, v [embed, H, hd]
    (d, h, hd), _, _ = tgts
    _expect(name, a, (3 * h * hd, d))
    per_head = a.reshape(h, 3, hd, d)
    return tuple(per_head[:, i].transpose(2, 0, 1) for i in range(3))


def t_neox_qkv_bias(name, a, tgts):  # [H * 3 * hd], per head -> q, k, v biases [H, hd]
    (h, hd), _, _ = tgts
    _expect(name, a, (3 * h * hd,))
    per_head = a.reshape(h, 3, hd)
    return tuple(per_head[:, i] for i in range(3))


_G = r"(?:transformer\.)?"  # GPT-2 checkpoints name their tensors with and without the prefix
_GH = _G + r"h\.(\d+)\."
GPT2_RULES = [  # Conv1D weights are [in, out]: the model's layout already, no transpose
    (_G + r"wte\.weight", "embed", t_identity),
    (_G + r"wpe\.weight", "pos_embed", t_identity),
    (_GH + r"ln_1\.(weight|bias)", r"layers.\1.input_layernorm.\2", t_identity),
    (_GH + r"ln_2\.(weight|bias)", r"layers.\1.post_attention_layernorm.\2", t_identity),
    (_GH + r"attn\.c_attn\.weight", _QKV, t_conv1d_qkv),
    (_GH + r"attn\.c_attn\.bias", _QKV_BIAS, t_conv1d_qkv_bias),
    (_GH + r"attn\.c_proj\.weight", r"layers.\1.self_attn.o_proj", t_conv1d_out_heads),
    (_GH + r"attn\.c_proj\.bias", r"layers.\1.self_attn.o_bias", t_identity),
    (_GH + r"mlp\.c_fc\.weight", r"layers.\1.mlp.up_proj", t_identity),
    (_GH + r"mlp\.c_fc\.bias", r"layers.\1.mlp.up_bias", t_identity),
    (_GH + r"mlp\.c_proj\.weight", r"layers.\1.mlp.down_proj", t_identity),
    (_GH + r"mlp\.c_proj\.bias", r"layers.\1.mlp.down_bias", t_identity),
    (_G + r"ln_f\.(weight|bias)", r"norm.\1", t_identity),
    (r"lm_head\.weight", "lm_head", t_transpose),
    (_GH + r"attn\.(bias|masked_bias)", None, None),  # old checkpoints' causal-mask buffers
]
_OD = r"(?:model\.)?decoder\."  # facebook/opt-* checkpoints name their tensors with and without "model."
_OL = _OD + r"layers\.(\d+)\."
OPT_RULES = [  # OPT: Linear layers ([out, in]) with biases, out_proj, fc1 / fc2, learned positions
    (_OD + r"embed_tokens\.weight", "embed", t_identity),
    (_OD + r"embed_positions\.weight", "pos_embed", t_identity),
    (_OL + r"self_attn\.(q|k|v)_proj\.weight", r"layers.\1.self_attn.\2_proj", t_in_heads),
    (_OL + r"self_attn\.(q|k|v)_proj\.bias", r"layers.\1.self_attn.\2_bias", t_bias_heads),
    (_OL + r"self_attn\.out_proj\.weight", r"layers.\1.self_attn.o_proj", t_out_heads),
    (_OL + r"self_attn\.out_proj\.bias", r"layers.\1.self_attn.o_bias", t_identity),
    (_OL + r"self_attn_layer_norm\.(weight|bias)", r"layers.\1.input_layernorm.\2", t_identity),
    (_OL + r"final_layer_norm\.(weight|bias)", r"layers.\1.post_attention_layernorm.\2", t_identity),
    (_OL + r"fc1\.weight", r"layers.\1.mlp.up_proj", t_transpose),
    (_OL + r"fc1\.bias", r"layers.\1.mlp.up_bias", t_identity),
    (_OL + r"fc2\.weight", r"layers.\1.mlp.down_proj", t_transpose),
    (_OL + r"fc2\.bias", r"layers.\1.mlp.down_bias", t_identity),
    (_OD + r"final_layer_norm\.(weight|bias)", r"norm.\1", t_identity),
    (r"lm_head\.weight", "lm_head", t_transpose),
]


def t_grouped_qkv(name, a, tgts):  # fused q/k/v rows per KV group: [its G queries; its k; its v]
    """Falcon's query_key_value and GPTBigCode's c_attn. One group (multi-query) is [q | k | v] in
    blocks; one query per group (multi-head) interleaves q, k and v per head (NeoX's layout)."""
    (d, h, hd), (_, k, _), _ = tgts
    _expect(name, a, ((h + 2 * k) * hd, d))
    g = a.reshape(k, h // k + 2, hd, d)
    return (g[:, :-2].reshape(h, hd, d).transpose(2, 0, 1), g[:, -2].transpose(2, 0, 1),
            g[:, -1].transpose(2, 0, 1))


def t_grouped_qkv_bias(name, a, tgts):  # its bias, the same layout
    (h, hd), (k, _), _ = tgts
    _expect(name, a, ((h + 2 * k) * hd,))
    g = a.reshape(k, h // k + 2, hd)
    return g[:, :-2].reshape(h, hd), g[:, -2], g[:, -1]


def t_twice(name, a, tgts):  # one tensor feeding two params of its shape (a norm both branches share)
    for t in tgts:
        _expect(name, a, tuple(t))
    return tuple(a for _ in tgts)


_TH = r"transformer\.h\.(\d+)\."  # a block of Falcon, GPTBigCode and GPT-J
FALCON_RULES = [  # Falcon: fused grouped query_key_value, dense, dense_h_to_4h / dense_4h_to_h, LayerNorms
    (r"transformer\.word_embeddings\.weight", "embed", t_identity),
    # one norm feeding attention and MLP (7B; the 40B with num_ln_in_parallel_attn=1): both of the
    # parallel layer's norms; the 40B / 180B's ln_attn and ln_mlp: one each
    (_TH + r"input_layernorm\.(weight|bias)", (r"layers.\1.input_layernorm.\2", r"layers.\1.post_attention_layernorm.\2"),
     t_twice),
    (_TH + r"ln_attn\.(weight|bias)", r"layers.\1.input_layernorm.\2", t_identity),
    (_TH + r"ln_mlp\.(weight|bias)", r"layers.\1.post_attention_layernorm.\2", t_identity),
    (_TH + r"self_attention\.query_key_value\.weight", _QKV, t_grouped_qkv),
    (_TH + r"self_attention\.query_key_value\.bias", _QKV_BIAS, t_grouped_qkv_bias),
    (_TH + r"self_attention\.dense\.weight", r"layers.\1.self_attn.o_proj", t_out_heads),
    (_TH + r"self_attention\.dense\.bias", r"layers.\1.self_attn.o_bias", t_identity),
    (_TH + r"mlp\.dense_h_to_4h\.weight", r"layers.\1.mlp.up_proj", t_transpose),
    (_TH + r"mlp\.dense_h_to_4h\.bias", r"layers.\1.mlp.up_bias", t_identity),
    (_TH + r"mlp\.dense_4h_to_h\.weight", r"layers.\1.mlp.down_proj", t_transpose),
    (_TH + r"mlp\.dense_4h_to_h\.bias", r"layers.\1.mlp.down_bias", t_identity),
    (r"transformer\.ln_f\.(weight|bias)", r"norm.\1", t_identity),
    (r"lm_head\.weight", "lm_head", t_transpose),
]
BIGCODE_RULES = [  # GPTBigCode (StarCoder 1, SantaCoder): Linear layers ([out, in]), fused c_attn, learned positions
    (r"transformer\.wte\.weight", "embed", t_identity),
    (r"transformer\.wpe\.weight", "pos_embed", t_identity),
    (_TH + r"ln_1\.(weight|bias)", r"layers.\1.input_layernorm.\2", t_identity),
    (_TH + r"ln_2\.(weight|bias)", r"layers.\1.post_attention_layernorm.\2", t_identity),
    (_TH + r"attn\.c_attn\.weight", _QKV, t_grouped_qkv),
    (_TH + r"attn\.c_attn\.bias", _QKV_BIAS, t_grouped_qkv_bias),
    (_TH + r"attn\.c_proj\.weight", r"layers.\1.self_attn.o_proj", t_out_heads),
    (_TH + r"attn\.c_proj\.bias", r"layers.\1.self_attn.o_bias", t_identity),
    (_TH + r"mlp\.c_fc\.weight", r"layers.\1.mlp.up_proj", t_transpose),
    (_TH + r"mlp\.c_fc\.bias", r"layers.\1.mlp.up_bias", t_identity),
    (_TH + r"mlp\.c_proj\.weight", r"layers.\1.mlp.down_proj", t_transpose),
    (_TH + r"mlp\.c_proj\.bias", r"layers.\1.mlp.down_bias", t_identity),
    (r"transformer\.ln_f\.(weight|bias)", r"norm.\1", t_identity),
    (r"lm_head\.weight", "lm_head", t_transpose),
]
GPTJ_RULES = [  # GPT-J: Linear layers ([out, in]), q/k/v/out_proj without biases, fc_in / fc_out, a biased head
    (r"transformer\.wte\.weight", "embed", t_identity),
    (_TH + r"ln_1\.(weight|bias)", r"layers.\1.input_layernorm.\2", t_identity),
    (_TH + r"attn\.(q|k|v)_proj\.weight", r"layers.\1.self_attn.\2_proj", t_in_heads),
    (_TH + r"attn\.out_proj\.weight", r"layers.\1.self_attn.o_proj", t_out_heads),
    (_TH + r"mlp\.fc_in\.weight", r"layers.\1.mlp.up_proj", t_transpose),
    (_TH + r"mlp\.fc_in\.bias", r"layers.\1.mlp.up_bias", t_identity),
    (_TH + r"mlp\.fc_out\.weight", r"layers.\1.mlp.down_proj", t_transpose),
    (_TH + r"mlp\.fc_out\.bias", r"layers.\1.mlp.down_bias", t_identity),
    (r"transformer\.ln_f\.(weight|bias)", r"norm.\1", t_identity),
    (r"lm_head\.weight", "lm_head", t_transpose),
    LM_HEAD_BIAS_RULE,
    (_TH + r"attn\.(bias|masked_bias)", None, None),  # old checkpoints' causal-mask buffers
]
_N = r"gpt_neox\.layers\.(\d+)\."
NEOX_RULES = [
    (r"gpt_neox\.embed_in\.weight", "embed", t_identity),
    (_N + r"(input_layernorm|post_attention_layernorm)\.(weight|bias)", r"layers.\1.\2.\3", t_identity),
    (_N + r"attention\.query_key_value\.weight", _QKV, t_neox_qkv),
    (_N + r"attention\.query_key_value\.bias", _QKV_BIAS, t_neox_qkv_bias),
    (_N + r"attention\.dense\.weight", r"layers.\1.self_attn.o_proj", t_out_heads),
    (_N + r"attention\.dense\.bias", r"layers.\1.self_attn.o_bias", t_identity),
    (_N + r"mlp\.dense_h_to_4h\.weight", r"layers.\1.mlp.up_proj", t_transpose),
    (_N + r"mlp\.dense_h_to_4h\.bias", r"layers.\1.mlp.up_bias", t_identity),
    (_N + r"mlp\.dense_4h_to_h\.weight", r"layers.\1.mlp.down_proj", t_transpose),
    (_N + r"mlp\.dense_4h_to_h\.bias", r"layers.\1.mlp.down_bias", t_identity),
    (r"gpt_neox\.final_layer_norm\.(weight|bias)", r"norm.\1", t_identity),
    (r"(?:embed_out|lm_head)\.weight", "lm_head", t_transpose),
    (_N + r"attention\.(bias|masked_bias|rotary_emb\.inv_freq)", None, None),  # old checkpoints' buffers
]
