"""Converters: every format, every error path, Orbax round trip."""
import json
import os
import shutil

import numpy as np
import pytest

from jvllm.converters import CheckpointError, load_checkpoint, resolve_model
from jvllm.verify import verify
from tests.gguf_util import write_llama_gguf

PROMPTS = [list(range(3, 30)), [7, 8, 9, 10]]


def _copy(src, dst):
    shutil.copytree(src, dst)
    return str(dst)


def test_truncated_safetensors(ckpt_dir, tmp_path):
    d = _copy(ckpt_dir("llama"), tmp_path / "m")
    f = os.path.join(d, "model.safetensors")
    size = os.path.getsize(f)
    with open(f, "r+b") as fh:
        fh.truncate(size - 100)
    with pytest.raises(CheckpointError, match=r"truncated safetensors file: header needs \d+ bytes, file has"):
        load_checkpoint(d)


def test_corrupt_safetensors_header(ckpt_dir, tmp_path):
    d = _copy(ckpt_dir("llama"), tmp_path / "m")
    with open(os.path.join(d, "model.safetensors"), "r+b") as fh:
        fh.seek(8)
        fh.write(b"#garbage#")
    with pytest.raises(CheckpointError, match="corrupt safetensors header"):
        load_checkpoint(d)


def _rewrite(d, fn):
    from safetensors.numpy import load_file, save_file

    f = os.path.join(d, "model.safetensors")
    t = load_file(f)
    fn(t)
    save_file(t, f, metadata={"format": "pt"})


def test_missing_tensor(ckpt_dir, tmp_path):
    d = _copy(ckpt_dir("llama"), tmp_path / "m")
    _rewrite(d, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing 1 tensor.*layers\.1\.mlp\.up_proj"):
        load_checkpoint(d)


def test_wrong_shape(ckpt_dir, tmp_path):
    d = _copy(ckpt_dir("llama"), tmp_path / "m")
    _rewrite(d, lambda t: t.__setitem__("model.layers.0.self_attn.k_proj.weight", np.zeros((16, 64), np.float32)))
    with pytest.raises(CheckpointError, match=r"'model.layers.0.self_attn.k_proj.weight': shape \(16, 64\) but the "
                                              r"model expects \(32, 64\)"):
        load_checkpoint(d)


def test_unexpected_tensor(ckpt_dir, tmp_path):
    d = _copy(ckpt_dir("llama"), tmp_path / "m")
    _rewrite(d, lambda t: t.__setitem__("model.layers.0.mlp.extra.weight", np.zeros(3, np.float32)))
    with pytest.raises(CheckpointError, match="unexpected tensor 'model.layers.0.mlp.extra.weight'"):
        load_checkpoint(d)


def test_unknown_architecture(ckpt_dir, tmp_path):
    d = _copy(ckpt_dir("llama"), tmp_path / "m")
    cfg = json.load(open(os.path.join(d, "config.json")))
    cfg.update(model_type="bloom", architectures=["BloomForCausalLM"])
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
    with pytest.raises(ValueError, match=r"unsupported architecture \['BloomForCausalLM'\].*supported: LlamaForCausalLM"):
        load_checkpoint(d)


def test_truncated_bin(ckpt_dir, tmp_path):
    d = _copy(ckpt_dir("llama", fmt="bin"), tmp_path / "m")
    f = os.path.join(d, "pytorch_model.bin")
    with open(f, "r+b") as fh:
        fh.truncate(os.path.getsize(f) // 2)
    with pytest.raises(CheckpointError, match="cannot read PyTorch checkpoint"):
        load_checkpoint(d)


def test_missing_shard(ckpt_dir, tmp_path):
    d = _copy(ckpt_dir("llama", fmt="sharded"), tmp_path / "m")
    shard = sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))[-1]
    os.remove(os.path.join(d, shard))
    with pytest.raises(CheckpointError, match=f"shard '{shard}'.*missing"):
        load_checkpoint(d)


def test_resolve_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a built-in name"):
        resolve_model(str(tmp_path / "nope"))
    assert resolve_model("smollm2").kind == "gguf"


# ------------------------------------------------------------------------------------- GGUF
@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_gguf_types_vs_transformers(ckpt_dir, tmp_path, qtype):
    """Our GGUF reading (names, unpermute, dequantization) == transformers' reading of the file."""
    hf = ckpt_dir("llama", hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    path = write_llama_gguf(hf, str(tmp_path / f"m-{qtype}.gguf"), lambda n, s: qtype)
    ok, reps = verify(path, prompts=PROMPTS, atol=1e-4, log=lambda *a: None)
    assert ok, [(r.max_abs_diff, r.top1_agreement) for r in reps]


@pytest.mark.parametrize("qtype", ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ1_M", "IQ2_XXS", "IQ3_S", "IQ4_NL",
                                   "IQ4_XS", "TQ2_0"])
def test_gguf_kquants_vs_transformers(ckpt_dir, tmp_path, qtype):
    """Projections in each block type (random valid blocks): jvllm == transformers reading the file."""
    hf = ckpt_dir("llama", hidden_size=256, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=64, vocab_size=64, num_hidden_layers=1)
    path = write_llama_gguf(hf, str(tmp_path / f"m-{qtype}.gguf"),
                            lambda n, s: qtype if s[-1] % 256 == 0 and "token_embd" not in n else "F32")
    ok, reps = verify(path, prompts=[[1, 2, 3, 4, 5, 6]], atol=1e-3, log=lambda *a: None)
    assert ok, [(r.max_abs_diff, r.top1_agreement) for r in reps]


def llama3_rope_freqs(cfg) -> np.ndarray:
    """The rope_freqs tensor llama.cpp's converter writes for a llama3-scaled model (its formula)."""
    p, d = cfg.rope_parameters, cfg.head_dim
    freqs = 1.0 / (p["rope_theta"] ** (np.arange(0, d, 2, dtype=np.float32) / d))
    old, lo, hi, factor = (p["original_max_position_embeddings"], p["low_freq_factor"], p["high_freq_factor"],
                           p["factor"])
    out = []
    for f in freqs:
        wl = 2 * np.pi / f
        s = (old / wl - lo) / (hi - lo)
        out.append(1.0 if wl < old / hi else factor if wl > old / lo else 1 / ((1 - s) / factor + s))
    return np.asarray(out, np.float32)


def test_gguf_llama3_rope_freqs(ckpt_dir, tmp_path):
    """A Llama 3.1-style GGUF keeps its rope scaling only as the rope_freqs tensor (no rope.scaling
    keys): read as per-frequency divisors, the logits equal the original checkpoint's in
    transformers (whose own GGUF reader drops the tensor)."""
    import jax.numpy as jnp
    import transformers

    from jvllm.converters.gguf import gguf_hf_config
    from jvllm.models import bind
    from jvllm.models.layers import head_of
    from jvllm.worker.model_runner import ModelRunner

    def logits(model):
        ck = load_checkpoint(model, "float32")
        g, s = bind(ck.config, ck.params)
        head = head_of(ck.config, ck.params)
        r = ModelRunner(ck.config, g, s, head, dtype=jnp.float32, block_size=16, num_blocks=4, max_model_len=40,
                        max_num_seqs=1, token_buckets=(37,))
        return ck.config, np.asarray(r.sequence_logits(PROMPTS[0]))

    hf = ckpt_dir("llama3")
    cfg = transformers.AutoConfig.from_pretrained(hf)
    path = write_llama_gguf(hf, str(tmp_path / "l3.gguf"), extra_tensors={"rope_freqs.weight": llama3_rope_freqs(cfg)})
    assert gguf_hf_config(path)["rope_scaling"]["rope_type"] == "freq_factors"
    ok, _ = verify(hf, prompts=PROMPTS, atol=1e-4, log=lambda *a: None)  # safetensors == transformers
    assert ok
    (cfg_g, ours), (cfg_s, ref) = logits(path), logits(hf)
    assert cfg_g.rope_type == "freq_factors" and cfg_s.rope_type == "llama3"
    assert np.abs(ours - ref).max() < 1e-4


def test_gguf_unsupported_type(ckpt_dir, tmp_path):
    import gguf

    hf = ckpt_dir("llama")
    path = str(tmp_path / "iq.gguf")
    write_llama_gguf(hf, path)
    # rewrite one tensor as Q8_1 (llama.cpp's activation type, never a weight's: not supported)
    r = gguf.GGUFReader(path)
    t = [t for t in r.tensors if t.name == "blk.0.ffn_up.weight"][0]
    path2 = str(tmp_path / "iq2.gguf")
    w = gguf.GGUFWriter(path2, "llama")
    for k, f in r.fields.items():
        if k.startswith("llama.") or k == "llama.vocab_size":
            v = f.contents()
            (w.add_float32 if isinstance(v, float) else w.add_uint32)(k, v)
    for tt in r.tensors:
        if tt is t:
            data = np.zeros((tt.data.shape[0], tt.data.shape[-1] // 32 * 40), np.uint8)
            w.add_tensor(tt.name, data, raw_dtype=gguf.GGMLQuantizationType.Q8_1)
        else:
            w.add_tensor(tt.name, np.asarray(tt.data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CheckpointError, match="'blk.0.ffn_up.weight' has unsupported GGUF type Q8_1; supported: F32"):
        load_checkpoint(path2)


def test_gguf_truncated(ckpt_dir, tmp_path):
    path = write_llama_gguf(ckpt_dir("llama"), str(tmp_path / "t.gguf"))
    with open(path, "r+b") as fh:
        fh.truncate(os.path.getsize(path) - 4096)
    with pytest.raises(CheckpointError, match=r"t\.gguf"):
        load_checkpoint(path)


def test_gguf_missing_tensor(ckpt_dir, tmp_path):
    path = write_llama_gguf(ckpt_dir("llama"), str(tmp_path / "m.gguf"), drop=("blk.1.ffn_norm.weight",))
    with pytest.raises(CheckpointError, match=r"missing 1 tensor.*layers\.1\.post_attention_layernorm"):
        load_checkpoint(path)


# ------------------------------------------------------------------------------------- Orbax
def test_orbax_roundtrip(ckpt_dir, tmp_path):
    from jvllm.cli import main

    src = ckpt_dir("qwen3", tokenizer=True)
    dst = str(tmp_path / "orbax")
    main(["convert", src, dst])
    assert resolve_model(dst).kind == "orbax"
    a = load_checkpoint(src)
    b = load_checkpoint(dst)
    assert a.config == b.config
    for k in a.params:
        np.testing.assert_array_equal(np.asarray(a.params[k]), np.asarray(b.params[k]))
    assert os.path.isfile(os.path.join(dst, "tokenizer.json"))


def test_orbax_mismatch_is_an_error(ckpt_dir, tmp_path):
    from jvllm.converters import convert_to_orbax

    dst = str(tmp_path / "orbax")
    convert_to_orbax(ckpt_dir("llama"), dst)
    cfg = json.load(open(os.path.join(dst, "config.json")))
    cfg["intermediate_size"] = 96
    json.dump(cfg, open(os.path.join(dst, "config.json"), "w"))
    with pytest.raises(CheckpointError, match="mlp"):
        load_checkpoint(dst)


def test_llama_random_presets_config_without_transformers_classes():
    """random: llama presets build their ModelConfig from a dict of LlamaConfig's defaults (no
    transformers config class: its import pulls torch); it must equal the transformers path."""
    import transformers

    from jvllm.config import ModelConfig
    from jvllm.converters import RANDOM_PRESETS, hf_config_dict, model_config, resolve_model

    n = 0
    for name in RANDOM_PRESETS:
        spec = resolve_model(f"random:{name}")
        d = hf_config_dict(spec)
        if d["model_type"] != "llama":
            continue
        ref = ModelConfig.from_hf_config(transformers.LlamaConfig(**{k: v for k, v in d.items() if k != "model_type"}))
        assert model_config(spec) == ref, name
        n += 1
    assert n >= 3
