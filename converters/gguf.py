"""GGUF files (llama.cpp): config from metadata, tensors dequantized and renamed to HF names.

The header is parsed by `gguf_file.GGUFFile`; tensor data are dequantized by `gguf_dequant`
(vectorized numpy for the common types, the `gguf` package's kernels for the rest). llama.cpp stores Llama/Mistral q and k projections with
its rotary permutation (`convert_hf_to_gguf.py: LlamaModel.permute`); `unpermute` undoes it so the
result is the HF layout, which `name_map` then converts like any HF checkpoint. The tokenizer is
built from the same metadata by `gguf_tokenizer` (no torch needed). The mixture-of-experts files
(Mixtral as arch "llama" with experts, qwen2moe, qwen3moe): `gguf_moe`; Gemma 2 / 3 and Phi-3: `gguf_archs`.
"""
from __future__ import annotations

import os
import re
from typing import Iterator

import numpy as np

from . import gguf_archs, gguf_moe
from .name_map import CheckpointError

# GGUF architecture -> (HF architecture, HF model_type)
# ("llama" with {arch}.expert_count > 0 is Mixtral: gguf_moe.MOE_ARCHS)
_GGUF_ARCHS = {"llama": ("LlamaForCausalLM", "llama"), "qwen2": ("Qwen2ForCausalLM", "qwen2"),
               "qwen3": ("Qwen3ForCausalLM", "qwen3"), "gemma": ("GemmaForCausalLM", "gemma"),
               "gemma2": ("Gemma2ForCausalLM", "gemma2"), "smollm3": ("SmolLM3ForCausalLM", "smollm3"),
               "granite": ("GraniteForCausalLM", "granite"), "olmo2": ("Olmo2ForCausalLM", "olmo2"),
               "command-r": ("CohereForCausalLM", "cohere"), "cohere2": ("Cohere2ForCausalLM", "cohere2"),
               "gemma3": ("Gemma3ForCausalLM", "gemma3_text"), "phi3": ("Phi3ForCausalLM", "phi3"),
               "starcoder2": ("Starcoder2ForCausalLM", "starcoder2"), "phi2": ("PhiForCausalLM", "phi"),
               "gptneox": ("GPTNeoXForCausalLM", "gpt_neox"), "gpt2": ("GPT2LMHeadModel", "gpt2"),
               "glm4": ("Glm4ForCausalLM", "glm4"),
               "qwen2moe": gguf_moe.MOE_ARCHS["qwen2moe"],
               "qwen3moe": gguf_moe.MOE_ARCHS["qwen3moe"], "olmoe": gguf_moe.MOE_ARCHS["olmoe"]}
SUPPORTED_GGUF_ARCHS = tuple(_GGUF_ARCHS)
# the i-quants, ternary and MXFP4 types dequantize through the gguf package (`gguf_dequant`); a
# gguf too old for one is a CheckpointError naming the type
SUPPORTED_GGUF_TYPES = ("F32", "F16", "BF16", "F64", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                        "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S",
                        "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS", "TQ1_0", "TQ2_0", "MXFP4")
_PERMUTED_ARCHS = ("llama", "smollm3", "granite")  # llama.cpp's LlamaModel lineage

_GGUF_TO_HF = [
    (r"token_embd\.weight", "model.embed_tokens.weight"),
    (r"output_norm\.weight", "model.norm.weight"),
    (r"output\.weight", "lm_head.weight"),
    (r"blk\.(\d+)\.attn_q\.(weight|bias)", r"model.layers.\1.self_attn.q_proj.\2"),
    (r"blk\.(\d+)\.attn_k\.(weight|bias)", r"model.layers.\1.self_attn.k_proj.\2"),
    (r"blk\.(\d+)\.attn_v\.(weight|bias)", r"model.layers.\1.self_attn.v_proj.\2"),
    (r"blk\.(\d+)\.attn_output\.weight", r"model.layers.\1.self_attn.o_proj.weight"),
    (r"blk\.(\d+)\.attn_q_norm\.weight", r"model.layers.\1.self_attn.q_norm.weight"),
    (r"blk\.(\d+)\.attn_k_norm\.weight", r"model.layers.\1.self_attn.k_norm.weight"),
    (r"blk\.(\d+)\.attn_norm\.weight", r"model.layers.\1.input_layernorm.weight"),
    (r"blk\.(\d+)\.ffn_norm\.weight", r"model.layers.\1.post_attention_layernorm.weight"),
    (r"blk\.(\d+)\.ffn_(gate|up|down)\.weight", r"model.layers.\1.mlp.\2_proj.weight"),
    (r"rope_freqs\.weight", None),  # per-frequency rope divisors: read into the config (gguf_hf_config)
]
# keyed by GGUF arch, and "mixtral" for arch "llama" with experts (`_rules_key`); the stacked
# *_exps tensors are split before these rules apply (gguf_moe.expert_tensors)
GGUF_RULES_BY_ARCH = {"llama": _GGUF_TO_HF, "qwen2": _GGUF_TO_HF, "qwen3": _GGUF_TO_HF, "gemma": _GGUF_TO_HF,
                      "gemma2": gguf_archs.GEMMA_RULES + _GGUF_TO_HF,
                      "gemma3": gguf_archs.GEMMA_RULES + _GGUF_TO_HF, "phi3": gguf_archs.PHI3_RULES + _GGUF_TO_HF,
                      "qwen2moe": gguf_moe.MOE_RULES + _GGUF_TO_HF, "qwen3moe": gguf_moe.MOE_RULES + _GGUF_TO_HF,
                      "olmoe": gguf_moe.MOE_RULES + _GGUF_TO_HF,
                      "mixtral": gguf_moe.MIXTRAL_RULES + _GGUF_TO_HF, "smollm3": _GGUF_TO_HF,
                      "granite": _GGUF_TO_HF, "olmo2": gguf_archs.GEMMA_RULES + _GGUF_TO_HF,
                      "command-r": _GGUF_TO_HF, "cohere2": _GGUF_TO_HF,
                      "starcoder2": gguf_archs.STARCODER2_RULES + _GGUF_TO_HF,
                      "phi2": gguf_archs.PHI2_RULES + _GGUF_TO_HF, "gptneox": gguf_archs.GPTNEOX_RULES,
                      "gpt2": gguf_archs.GPT2_RULES, "glm4": gguf_archs.GLM4_RULES + _GGUF_TO_HF}
_GGUF_RX = {a: [(re.compile(p + r"\Z"), t) for p, t in rules] for a, rules in GGUF_RULES_BY_ARCH.items()}


def _rules_key(r, arch: str) -> str:
    return "mixtral" if arch == "llama" and gguf_moe.is_moe_llama(r.fields) else arch


_last_reader: tuple = (None, None)  # ((path, inode, size, mtime, ctime), GGUFFile) of the file read last; one
                                    # tuple, replaced whole, so threads never see a mixed pair


def _reader(path: str):
    """The parsed header of `path`, shared by the config, the tokenizer and the weights of one
    start-up (each would otherwise parse it again): the last file read stays parsed (and mapped)
    until another file is read; a file replaced or touched since (other size or mtime) is read again."""
    from .deps import MissingDependencyError

    try:
        import gguf  # noqa: F401  (type tables and dequantization kernels)
    except ImportError:
        raise MissingDependencyError(f"reading the GGUF file {path} needs the gguf package: "
                                     f"pip install 'jvllm[gguf]'") from None
    from .gguf_file import GGUFFile

    try:
        st = os.stat(path)
        key = (os.path.realpath(path), st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    except OSError:
        return GGUFFile(path)  # raises its own error naming the file
    global _last_reader
    cached_key, cached = _last_reader
    if cached_key == key:
        return cached
    r = GGUFFile(path)
    _last_reader = (key, r)
    return r


def _field(r, key, default=None):
    return r.get(key, default)


def gguf_hf_config(path: str) -> dict:
    """An HF-style config dict (model_type, architectures, sizes, rope) from GGUF metadata."""
    r = _reader(path)
    arch = _field(r, "general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHS:
        raise ValueError(f"{path}: unsupported GGUF architecture {arch!r}; supported: {', '.join(SUPPORTED_GGUF_ARCHS)}")

    def g(k, default=None):
        return _field(r, f"{arch}.{k}", default)

    heads = int(g("attention.head_count"))
    hidden = int(g("embedding_length"))
    tokens = r.get("tokenizer.ggml.tokens")
    vocab = g("vocab_size") or (len(tokens) if tokens is not None else None)
    names = {t.name: tuple(t.numpy_shape) for t in r.tensors}  # name -> numpy shape
    if vocab is None:
        vocab = int([t for t in r.tensors if t.name == "token_embd.weight"][0].shape[1])
    hf_arch, model_type = (gguf_moe.MOE_ARCHS["llama"] if _rules_key(r, arch) == "mixtral" else _GGUF_ARCHS[arch])
    cfg = {
        "model_type": model_type,
        "architectures": [hf_arch],
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(g("feed_forward_length")),
        "num_hidden_layers": int(g("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(g("attention.head_count_kv", heads)),
        "head_dim": int(g("attention.key_length", hidden // heads)),
        "max_position_embeddings": int(g("context_length", 2048)),
        "rms_norm_eps": float(g("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(g("rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": _field(r, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(r, "tokenizer.ggml.eos_token_id"),
        "hidden_act": "silu",
    }
    if arch == "qwen2":
        cfg["attention_bias"] = True
    cfg.update(_rope_fields(r, path, g, cfg["head_dim"]))
    if arch in gguf_archs.ARCH_FIELDS:
        cfg.update(gguf_archs.ARCH_FIELDS[arch](cfg, g, lambda name: _f32_tensor(r, path, name), names))
    if hf_arch in (a for a, _ in gguf_moe.MOE_ARCHS.values()):
        cfg.update(gguf_moe.moe_fields(arch, g, cfg))
    return cfg


def _f32_tensor(r, path: str, name: str) -> np.ndarray | None:
    """The file's F32 tensor `name` as a numpy array (None when absent; ValueError for another type)."""
    t = next((t for t in r.tensors if t.name == name), None)
    if t is None:
        return None
    if t.ggml_type != 0:
        raise ValueError(f"{path}: {name} must be F32 (ggml type 0), got type {t.ggml_type}")
    return r.tensor_bytes(t).view(np.float32).reshape(t.numpy_shape)


def _rope_fields(r, path: str, g, head_dim: int) -> dict:
    """partial_rotary_factor from rope.dimension_count; rope_scaling from rope.scaling.* or, for a
    Llama 3.1-style file, the rope_freqs tensor (llama.cpp stores llama3 scaling as one divisor per
    frequency and no rope.scaling keys)."""
    out = {}
    dims = g("rope.dimension_count")
    if dims is not None and int(dims) != head_dim:
        if not 0 < int(dims) <= head_dim:
            raise ValueError(f"{path}: rope.dimension_count {dims} must be in 1..head_dim ({head_dim})")
        out["partial_rotary_factor"] = int(dims) / head_dim
    st = g("rope.scaling.type")
    freqs = _f32_tensor(r, path, "rope_freqs.weight")
    if freqs is not None:
        if st and st != "none":
            raise ValueError(f"{path}: a rope_freqs tensor together with rope.scaling.type {st!r} is not implemented")
        out["rope_scaling"] = {"rope_type": "freq_factors", "factors": [float(x) for x in freqs.reshape(-1)]}
    elif st and st != "none":
        out["rope_scaling"] = {"rope_type": st, "factor": float(g("rope.scaling.factor", 1.0))}
        orig = g("rope.scaling.original_context_length")
        if orig:
            out["rope_scaling"]["original_max_position_embeddings"] = int(orig)
    return out


def model_config_from_dict(cfg: dict):
    """jvllm's ModelConfig from `gguf_hf_config`'s dict, read as attributes: the dict names every
    field ModelConfig.from_hf_config needs, so no transformers config class is built (importing
    one imports torch where torch is installed, seconds of start-up)."""
    import types

    from jvllm.config import ModelConfig

    return ModelConfig.from_hf_config(types.SimpleNamespace(**cfg), generic_names=True)


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k permutation ([n_head*hd, ...] rows)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensor_stream(path: str, hf_cfg: dict | None = None) -> Iterator[tuple[str, callable]]:
    """(HF tensor name, loader) for every tensor of the file, dequantized to float32."""
    import gguf

    r = _reader(path)
    hf_cfg = hf_cfg or gguf_hf_config(path)
    arch = r.get("general.architecture")
    rules = _GGUF_RX[_rules_key(r, arch)]
    H, KV = hf_cfg["num_attention_heads"], hf_cfg["num_key_value_heads"]
    E = hf_cfg.get("num_local_experts") or hf_cfg.get("num_experts") or 0
    if _rules_key(r, arch) == "mixtral":
        gguf_moe.check_split_experts({t.name for t in r.tensors}, E)
    for t in r.tensors:
        qtype = gguf.GGMLQuantizationType(t.ggml_type)
        if qtype.name not in SUPPORTED_GGUF_TYPES:
            raise CheckpointError(f"{path}: tensor {t.name!r} has unsupported GGUF type {qtype.name}; "
                                  f"supported: {', '.join(SUPPORTED_GGUF_TYPES)}")
        if E and gguf_moe.is_stacked_experts(t.name):
            r.tensor_bytes(t)  # checks the file holds the whole tensor
            experts = gguf_moe.expert_tensors(t.name, arch, lambda t=t, qtype=qtype: _dequantize(path, t, qtype, r), E)
            yield from experts
            continue
        for rx, tgt in rules:
            m = rx.match(t.name)
            if m:
                break
        else:
            raise CheckpointError(f"{path}: unexpected GGUF tensor {t.name!r}")
        if tgt is None:
            continue
        hf_name = m.expand(tgt)
        r.tensor_bytes(t)  # checks the file holds the whole tensor
        if "{qkv}" in hf_name:
            yield from _split_qkv(path, t, hf_name, lambda t=t, qtype=qtype: _dequantize(path, t, qtype, r), H, KV)
            continue

        def load(t=t, qtype=qtype, hf_name=hf_name):
            a = _dequantize(path, t, qtype, r)
            if hf_name.endswith("shared_expert_gate.weight"):
                a = gguf_moe.shared_gate_row(a)
            if arch in _PERMUTED_ARCHS and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
                a = unpermute(a, H if ".q_proj" in hf_name else KV)
            if arch in gguf_archs.NORM_PLUS_ONE_ARCHS and hf_name.endswith("norm.weight"):
                a = a - np.float32(1.0)
            if arch == "gptneox" and ".query_key_value." in hf_name:
                a = gguf_archs.neox_qkv_per_head(a, H)
            if arch == "gpt2" and hf_name.endswith(gguf_archs.GPT2_TRANSPOSED):
                a = np.ascontiguousarray(a.T)
            return a

        yield hf_name, load


def _split_qkv(path: str, t, hf_name: str, load, H: int, KV: int):
    """(name, loader) for the q, k and v row blocks of a fused tensor ([H*hd + 2*KV*hd, ...]),
    `hf_name` holding "{qkv}"; the tensor is dequantized once, on the first load, and dropped
    after the third (each part is loaded once, as the converter does)."""
    cache: dict = {}

    def part(i):
        if "a" not in cache:
            a = load()
            if a.shape[0] % (H + 2 * KV):
                raise CheckpointError(f"{path}: fused tensor {t.name!r} has {a.shape[0]} rows, not a multiple of "
                                      f"{H + 2 * KV} (q, k and v of {H} + 2 x {KV} heads)")
            hd = a.shape[0] // (H + 2 * KV)
            cache["a"], cache["cuts"] = a, (0, H * hd, (H + KV) * hd, (H + 2 * KV) * hd)
        c, a = cache["cuts"], cache["a"]
        cache["left"] = cache.get("left", 3) - 1
        if cache["left"] == 0:  # the three parts are out: drop the fused array
            cache.pop("a")
        return np.ascontiguousarray(a[c[i]:c[i + 1]])

    return [(hf_name.replace("{qkv}", p), (lambda i=i: part(i))) for i, p in enumerate("qkv")]


def _dequantize(path: str, t, qtype, r) -> np.ndarray:
    from .gguf_dequant import dequantize

    try:
        return dequantize(r.tensor_bytes(t), qtype, t.numpy_shape)
    except NotImplementedError:
        raise CheckpointError(f"{path}: tensor {t.name!r} uses GGUF type {qtype.name}, which this "
                              f"gguf version cannot dequantize") from None


def gguf_tokenizer(path: str, cache_dir: str | None = None):
    """The file's tokenizer built from its metadata (no torch), or None when it carries none.
    `cache_dir`: where built tokenizers are kept across starts (`tokenizer_cache`)."""
    from .gguf_tokenizer import tokenizer_from_gguf

    return tokenizer_from_gguf(_reader(path), cache_dir)
