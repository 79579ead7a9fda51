"""Checkpoints in, Flax params out (installed as `jvllm.converters`).

    spec = resolve_model("smollm2")            # short name, HF folder, .gguf file or Orbax folder
    ckpt = load_checkpoint(spec, dtype="float32")
    ckpt.config, ckpt.params, ckpt.tokenizer  # ModelConfig, {name: jax.Array}, tokenizer or None

Every format goes through the same checks (`name_map.convert_tensors`): each tensor name is
mapped, each shape checked against the model's declared parameters, missing tensors listed.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from typing import Callable

import numpy as np

from .builtin import BUILTIN_MODELS  # noqa: F401  (short name -> BuiltinModel)
from .name_map import CheckpointError, convert_tensors, map_name  # noqa: F401



DEFAULT_MODEL = "smollm2"

# Random-weight models by shape ("random:NAME" or "random:/path/config.json"), for benchmarks.
RANDOM_PRESETS = {
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=128, vocab_size=128256, rope_theta=500000.0,
                      max_position_embeddings=8192),
    "llama3-70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                       num_key_value_heads=8, head_dim=128, vocab_size=128256, rope_theta=500000.0,
                       max_position_embeddings=8192),
    "llama3-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=64, vocab_size=128256, rope_theta=500000.0,
                      max_position_embeddings=8192, tie_word_embeddings=True),
    # one GPU's share of llama3-8b at TP=2 (half the heads, KV heads, MLP and vocab) with no
    # collectives: B1 on one GPU measures the per-device work a TP=2 step cannot avoid
    "llama3-8b-tp2-shard": dict(hidden_size=4096, intermediate_size=7168, num_hidden_layers=32, num_attention_heads=16,
                                num_key_value_heads=4, head_dim=128, vocab_size=64128, rope_theta=500000.0,
                                max_position_embeddings=8192),
    # mixture of experts (a preset naming its model_type / architectures overrides the llama default)
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], hidden_size=2048,
                          intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                          norm_topk_prob=True, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                          head_dim=128, vocab_size=151936, rope_theta=1000000.0, max_position_embeddings=40960,
                          rms_norm_eps=1e-6),
    "tiny-moe": dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], hidden_size=64,
                     intermediate_size=128, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                     norm_topk_prob=True, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=16, vocab_size=512, max_position_embeddings=2048),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=512, max_position_embeddings=2048),
    # google/gemma-3-4b-pt's text decoder: every 6th layer global (linear rope x8), the rest 1024-token windows
    "gemma3-4b": dict(model_type="gemma3_text", architectures=["Gemma3ForCausalLM"], hidden_size=2560,
                      intermediate_size=10240, num_hidden_layers=34, num_attention_heads=8, num_key_value_heads=4,
                      head_dim=256, vocab_size=262208, query_pre_attn_scalar=256, sliding_window=1024,
                      max_position_embeddings=131072, tie_word_embeddings=True, rms_norm_eps=1e-6,
                      rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                       "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
}


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    kind: str  # "hf" | "gguf" | "orbax"
    path: str
    name: str


def resolve_model(model: str) -> ModelSpec:
    """Map a user's model argument to a checkpoint on disk (never downloads)."""
    key = model.lower()
    if key.startswith("random:"):
        name = model[len("random:"):]
        if name not in RANDOM_PRESETS and not os.path.isfile(name):
            raise FileNotFoundError(f"random model {name!r}: not a preset ({', '.join(RANDOM_PRESETS)}) "
                                    f"nor a config.json file")
        return ModelSpec("random", name, model)
    if key in BUILTIN_MODELS and not os.path.exists(model):
        return ModelSpec("gguf", BUILTIN_MODELS[key].path(model), model)
    if os.path.isfile(model) and model.endswith(".gguf"):
        return ModelSpec("gguf", model, os.path.basename(model))
    if os.path.isdir(model):
        from .orbax_io import is_orbax_checkpoint

        if is_orbax_checkpoint(model):
            return ModelSpec("orbax", model, os.path.basename(os.path.abspath(model)))
        ggufs = [f for f in os.listdir(model) if f.endswith(".gguf")]
        if not os.path.isfile(os.path.join(model, "config.json")) and len(ggufs) == 1:
            return ModelSpec("gguf", os.path.join(model, ggufs[0]), ggufs[0])
        return ModelSpec("hf", model, os.path.basename(os.path.abspath(model)))
    raise FileNotFoundError(
        f"model {model!r} is not a built-in name ({', '.join(sorted(BUILTIN_MODELS))}), a .gguf file or a "
        f"checkpoint folder (jvllm never downloads from a hub)")


def hf_config_dict(spec: ModelSpec) -> dict:
    if spec.kind == "random":
        if spec.path in RANDOM_PRESETS:
            return {**dict(model_type="llama", architectures=["LlamaForCausalLM"], bos_token_id=1, eos_token_id=2,
                           rms_norm_eps=1e-5), **RANDOM_PRESETS[spec.path]}
        with open(spec.path) as f:
            return json.load(f)
    if spec.kind == "gguf":
        from .gguf import gguf_hf_config

        return gguf_hf_config(spec.path)
    with open(os.path.join(spec.path, "config.json")) as f:
        return json.load(f)


def llama_config_defaults(d: dict) -> dict:
    """transformers' LlamaConfig defaults for what `d` leaves out (the fields ModelConfig reads;
    tests/test_converters.py checks the result against LlamaConfig for every llama preset). Built
    by hand because importing a transformers config class imports torch where it is installed
    (seconds of start-up, about 10 s on the GPU image)."""
    heads = d.get("num_attention_heads", 32)
    return dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                num_attention_heads=heads, num_key_value_heads=d.get("num_key_value_heads", heads),
                head_dim=d.get("hidden_size", 4096) // heads, hidden_act="silu", max_position_embeddings=2048,
                rms_norm_eps=1e-6, tie_word_embeddings=False, rope_theta=10000.0, rope_scaling=None,
                attention_bias=False, mlp_bias=False, sliding_window=None, layer_types=None, pad_token_id=None,
                bos_token_id=1, eos_token_id=2)


def model_config(spec: ModelSpec):
    from jvllm.config import ModelConfig
    from jvllm.hf_config import load_hf_config

    if spec.kind == "gguf":  # the dict is complete: no transformers config class (its import pulls torch)
        from .gguf import model_config_from_dict

        return model_config_from_dict(hf_config_dict(spec))
    if spec.kind == "random":
        d = hf_config_dict(spec)
        if d["model_type"] == "llama":  # filled with LlamaConfig's defaults: no config class to import
            from .gguf import model_config_from_dict

            return model_config_from_dict({**llama_config_defaults(d), **d})
        import transformers

        cls = transformers.CONFIG_MAPPING[d["model_type"]]
        return ModelConfig.from_hf_config(cls(**{k: v for k, v in d.items() if k != "model_type"}))
    quant = None
    if spec.kind == "hf":  # a pre-quantized checkpoint declares its scheme (others are refused here)
        from .quantization import checkpoint_quant

        quant = checkpoint_quant(hf_config_dict(spec), spec.path)
    cfg = ModelConfig.from_hf_config(load_hf_config(spec.path))
    return cfg if quant is None else dataclasses.replace(cfg, quant=quant)


def load_tokenizer(spec: ModelSpec, cache_dir: str | None = None):
    """The checkpoint's tokenizer, or None when it ships no tokenizer files. `cache_dir`: where a
    tokenizer built from a GGUF's metadata is kept across starts (None: built every time)."""
    if spec.kind == "random":
        return None
    if spec.kind == "gguf":
        from .gguf import gguf_tokenizer

        return gguf_tokenizer(spec.path, cache_dir)
    names = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
    if not any(os.path.isfile(os.path.join(spec.path, n)) for n in names):
        return None
    import transformers

    return transformers.AutoTokenizer.from_pretrained(spec.path)


@dataclasses.dataclass
class Checkpoint:
    config: object            # jvllm.config.ModelConfig
    params: dict              # {param name: array}
    spec: ModelSpec
    load_seconds: float


def load_checkpoint(spec: ModelSpec | str, dtype="float32",
                    put: Callable[[str, np.ndarray], object] | None = None,
                    shardings: dict | None = None, quantization=None) -> Checkpoint:
    """Read and convert a checkpoint. `put(name, np_array)` places each tensor as it is converted
    (default: `jax.device_put` to the default device, optionally into `shardings[name]`).

    `quantization` ("fp8" | "int8" with the defaults of `jvllm.quantization.apply_quantization`,
    or the `QuantConfig` it resolved for this checkpoint, as the engine passes it so that the
    scales' layout is the engine's): each projection weight is quantized on its device(s) right
    after it is placed (`LoadQuantizer`), whatever the source; a pre-quantized checkpoint's values
    and scales are placed as they are. The params then hold the quantized weights and their
    `<name>_scale` arrays; `shardings` must be those of the quantized model (`param_specs` of
    `config`)."""
    import jax
    import jax.numpy as jnp

    from jvllm.models import param_specs
    from jvllm.quantization import QuantConfig, apply_quantization

    if isinstance(spec, str):
        spec = resolve_model(spec)
    t0 = time.perf_counter()
    if isinstance(quantization, QuantConfig):
        cfg = dataclasses.replace(model_config(spec), quant=quantization)
    else:
        cfg = apply_quantization(model_config(spec), quantization)
    jdtype = jnp.dtype(dtype)
    specs = param_specs(cfg, jdtype)
    quantizer = None
    if cfg.quant is not None and not cfg.quant.from_checkpoint:  # read full precision, quantize each tensor
        from jvllm.quantization.load import LoadQuantizer

        quantizer = LoadQuantizer(cfg, specs, shardings)
        specs = param_specs(dataclasses.replace(cfg, quant=None), jdtype)
    if spec.kind == "orbax":
        from .orbax_io import restore

        params = restore(spec.path, specs, jdtype, shardings)
        return Checkpoint(cfg, quantizer.all(params) if quantizer else params, spec, time.perf_counter() - t0)
    if spec.kind == "random":
        params = random_device_params(specs, jdtype, shardings, post=quantizer)
        return Checkpoint(cfg, params, spec, time.perf_counter() - t0)
    if put is None:
        def put(name, a):
            s, dt = (shardings or {}).get(name), specs[name][1]  # the model dtype, or float8 / a float32 scale
            if s is not None and not s.addressable_devices:  # another process's stage: nothing to place here
                return remote_placeholder(tuple(a.shape), dt, s)
            return jax.device_put(jnp.asarray(a, dt), s) if s is not None else jnp.asarray(a, dt)

    if spec.kind == "gguf":
        from .gguf import gguf_tensor_stream

        stream = gguf_tensor_stream(spec.path, hf_config_dict(spec))
    else:
        from .quantization import prequantized_stream
        from .readers import hf_tensor_stream, mtp_layers_skipped, text_decoder_stream

        d = hf_config_dict(spec)
        stream = prequantized_stream(mtp_layers_skipped(text_decoder_stream(hf_tensor_stream(spec.path), d), d), d)
    np_dtype = np.float32 if jdtype == jnp.float32 else (np.float16 if jdtype == jnp.float16 else jdtype)
    from jvllm.models.registry import family_of

    placed = put if quantizer is None else (lambda name, a: quantizer(name, put(name, a)))
    params = convert_tensors(specs, stream, np_dtype, placed, tied_embeddings=cfg.tie_word_embeddings,
                             name_map=family_of(cfg.architecture).name_map)
    if quantizer is not None:  # {name: {name: q, name_scale: s}} -> flat
        params = {k: v for d in params.values() for k, v in d.items()}
    jax.block_until_ready(list(params.values()))
    return Checkpoint(cfg, params, spec, time.perf_counter() - t0)


def convert_to_orbax(src: str, dst: str, dtype="float32", log=None):
    """`jvllm convert`: write SRC's converted params (Orbax) + config.json + tokenizer to DST.
    `log(str)` hears each step as it starts. Returns a ConvertReport."""
    from .convert_report import ConvertReport
    from .orbax_io import save

    log = log or (lambda msg: None)
    spec = resolve_model(src)
    log(f"reading {spec.path} ({spec.kind}) and converting to {dtype} ...")
    ck = load_checkpoint(spec, dtype)
    if ck.config.quant is not None:
        raise ValueError(f"{src}: an Orbax copy of a pre-quantized checkpoint is not implemented "
                         f"(the Orbax reader restores unquantized params); load the checkpoint directly")
    tok = load_tokenizer(spec)
    d = hf_config_dict(spec)
    log(f"writing {len(ck.params)} tensors to {dst} ...")
    t0 = time.perf_counter()
    save(dst, ck.params, d, tok, source=spec.path, dtype=str(dtype))
    gen = os.path.join(spec.path, "generation_config.json")
    if os.path.isdir(spec.path) and os.path.isfile(gen):  # the model's generation defaults travel along
        shutil.copyfile(gen, os.path.join(dst, "generation_config.json"))
    return ConvertReport(src=src, src_path=spec.path, src_kind=spec.kind, dst=dst, dtype=str(dtype),
                         num_tensors=len(ck.params), num_params=int(sum(int(np.prod(p.shape)) for p in ck.params.values())),
                         load_s=ck.load_seconds, save_s=time.perf_counter() - t0, has_tokenizer=tok is not None)


def remote_placeholder(shape: tuple, dtype, sharding):
    """A global array on devices that all belong to other processes (pipeline stages over
    processes): this process holds none of its data and never computes with it; the owners load
    the values. No device memory, no program."""
    import jax

    return jax.make_array_from_single_device_arrays(shape, sharding, [], dtype=dtype)


def random_device_params(specs: dict, dtype, shardings: dict | None = None, seed: int = 0, std: float = 0.02,
                         post=None) -> dict:
    """Random weights generated on the device(s) in their target dtype and sharding (no host copy):
    normal(0, std) for matrices, 1 for norm weights, 0 for biases. `post(name, array) -> {name:
    array}` (a `jvllm.quantization.load.LoadQuantizer`) replaces each array as it is made."""
    import jax
    import jax.numpy as jnp

    out = {}
    key = jax.random.PRNGKey(seed)
    fns = {}
    for i, (name, (shape, _, _)) in enumerate(sorted(specs.items())):
        kind = "ones" if name.endswith("norm.weight") else ("zeros" if "bias" in name else "normal")
        sh = (shardings or {}).get(name)
        if sh is not None and not sh.addressable_devices:  # another process's stage (its own key i there)
            a = remote_placeholder(tuple(shape), dtype, sh)
            out.update(post(name, a) if post is not None else {name: a})
            continue
        fk = (shape, kind, sh)
        if fk not in fns:
            def make(k, shape=shape, kind=kind):
                if kind == "ones":
                    return jnp.ones(shape, dtype)
                if kind == "zeros":
                    return jnp.zeros(shape, dtype)
                return (jax.random.normal(k, shape, jnp.float32) * std).astype(dtype)

            fns[fk] = jax.jit(make, out_shardings=sh)
        a = fns[fk](jax.random.fold_in(key, i))
        out.update(post(name, a) if post is not None else {name: a})
    jax.block_until_ready(list(out.values()))
    return out
