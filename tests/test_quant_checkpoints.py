"""Pre-quantized HF checkpoints load without requantizing: compressed-tensors FP8-dynamic
(per-channel `weight_scale`) and HF FP8 (block `weight_scale_inv`), written here from the tiny
llama checkpoint; other quantization configs are refused naming what is supported."""
import json
import os
import shutil

import numpy as np
import pytest

from jvllm import LLM
from jvllm.converters import CheckpointError, model_config, resolve_model

IDS = [int(t) for t in np.random.default_rng(1).integers(3, 256, 32)]
KW = dict(dtype="float32", max_model_len=64, max_num_seqs=2, max_num_batched_tokens=32, token_buckets=(32,),
          use_tqdm_on_load=False, background_compile=False)
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CT = {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
      "config_groups": {"group_0": {"targets": ["Linear"],
                                    "weights": {"num_bits": 8, "type": "float", "strategy": "channel",
                                                "symmetric": True, "dynamic": False},
                                    "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                                          "dynamic": True, "symmetric": True}}}}
BLOCK = (48, 16)  # [out, in]: 48 leaves partial output blocks (k/v: 32 rows, q: 64, gate/up: 128)
HF_FP8 = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": list(BLOCK),
          "modules_to_not_convert": ["lm_head"]}


def _channel(w):  # torch [out, in] -> (fp8, scale [out, 1])
    import torch

    s = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 448.0
    return (w / s).clamp(-448, 448).to(torch.float8_e4m3fn), s


def _block(w):  # torch [out, in] -> (fp8, scale_inv [ceil(out/bo), in/bi])
    import torch

    bo, bi = BLOCK
    out, inn = w.shape
    nbo = -(-out // bo)
    pad = torch.zeros(nbo * bo, inn)
    pad[:out] = w
    b = pad.reshape(nbo, bo, inn // bi, bi)
    s = b.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
    q = (b / s[:, None, :, None]).clamp(-448, 448).reshape(nbo * bo, inn)[:out].to(torch.float8_e4m3fn)
    return q, s


def _deq_block(q, s):
    bo, bi = BLOCK
    full = s.repeat_interleave(bo, 0)[:q.shape[0]].repeat_interleave(bi, 1)
    return q.float() * full


def _write(src, dst, qcfg, fn, deq_dst=None):
    """dst: src with every projection quantized by fn (config.json declaring qcfg); deq_dst: the
    same values dequantized to float32 (the reference the engine must reproduce)."""
    import safetensors.torch

    for d in (dst, deq_dst):
        if d is not None:
            shutil.copytree(src, d)
    t = safetensors.torch.load_file(os.path.join(src, "model.safetensors"))
    q, deq = {}, {}
    for name, w in t.items():
        if name.endswith(".weight") and name.split(".")[-2] in PROJ:
            wq, s = fn(w.float())
            q[name], q[name + ("_scale_inv" if qcfg["quant_method"] == "fp8" else "_scale")] = wq, s
            deq[name] = _deq_block(wq, s) if qcfg["quant_method"] == "fp8" else wq.float() * s
        else:
            q[name] = deq[name] = w
    safetensors.torch.save_file(q, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    cfg = json.load(open(os.path.join(src, "config.json")))
    json.dump({**cfg, "quantization_config": qcfg}, open(os.path.join(dst, "config.json"), "w"))
    if deq_dst is not None:
        safetensors.torch.save_file(deq, os.path.join(deq_dst, "model.safetensors"), metadata={"format": "pt"})
    return q


@pytest.fixture(scope="module")
def dirs(ckpt_dir, tmp_path_factory):
    src, root = ckpt_dir("llama"), tmp_path_factory.mktemp("prequant")
    out = {}
    for kind, qcfg, fn in (("ct", CT, _channel), ("block", HF_FP8, _block)):
        out[kind], out[kind + "_deq"] = str(root / kind), str(root / (kind + "_deq"))
        out[kind + "_tensors"] = _write(src, out[kind], qcfg, fn, out[kind + "_deq"])
    return out


def _logits(path, **kw):
    llm = LLM(path, **KW, **kw)
    try:
        import jax

        return llm.llm_engine.runner.sequence_logits(IDS), jax.tree.map(np.asarray, llm.get_weights())
    finally:
        llm.shutdown()


def test_compressed_tensors_fp8_dynamic_loads_the_checkpoint_values(dirs):
    assert model_config(resolve_model(dirs["ct"])).quant.method == "fp8"
    z, w = _logits(dirs["ct"])
    t = dirs["ct_tensors"]
    q = np.asarray(w["layers"]["1"]["self_attn"]["q_proj"]).astype(np.float32)  # [embed, heads, head_dim]
    ref = t["model.layers.1.self_attn.q_proj.weight"].float().numpy()          # [heads * head_dim, embed]
    np.testing.assert_array_equal(q.reshape(q.shape[0], -1), ref.T)           # not requantized: the same values
    np.testing.assert_array_equal(np.asarray(w["layers"]["1"]["mlp"]["down_proj_scale"]),
                                  t["model.layers.1.mlp.down_proj.weight_scale"].numpy()[:, 0])
    # the same scheme as quantizing the dequantized values at load (those requantize to the same values)
    z_load, _ = _logits(dirs["ct_deq"], quantization="fp8")
    np.testing.assert_allclose(z, z_load, rtol=1e-5, atol=1e-5)
    z_f32, _ = _logits(dirs["ct_deq"])
    assert float(np.abs(z - z_f32).max() / np.abs(z_f32).max()) < 0.08  # fp8 activations only


def test_hf_fp8_block_checkpoint_computes_its_dequantized_weights(dirs):
    cfg = model_config(resolve_model(dirs["block"]))
    assert (cfg.quant.method, cfg.quant.block_in) == ("fp8_block", BLOCK[1])
    z, w = _logits(dirs["block"], quantization="fp8")  # "fp8" is accepted for an fp8 checkpoint
    assert str(w["layers"]["0"]["self_attn"]["k_proj"].dtype) == "float8_e4m3fn"
    assert w["layers"]["0"]["self_attn"]["o_proj_scale"].shape == (4, 1, 64)  # [heads, head_dim / 16, embed]
    z_deq, _ = _logits(dirs["block_deq"])
    np.testing.assert_allclose(z, z_deq, rtol=1e-4, atol=1e-5)  # weight-only: the same weights exactly


def test_prequantized_checkpoint_refuses_another_quantization(dirs):
    with pytest.raises(ValueError, match=r"already quantized \(fp8_block\)"):
        LLM(dirs["block"], quantization="int8", **KW)


def test_unquantized_projection_in_a_prequantized_checkpoint_is_an_error(dirs, tmp_path):
    import safetensors.torch

    d = str(tmp_path / "mixed")
    shutil.copytree(dirs["ct"], d)
    p = os.path.join(d, "model.safetensors")
    t = safetensors.torch.load_file(p)
    name = "model.layers.0.mlp.up_proj.weight"
    t[name] = t[name].float()
    safetensors.torch.save_file(t, p, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"{name}' is float32 but this pre-quantized"):
        LLM(d, **KW)


@pytest.mark.parametrize("edit,match", [
    (lambda q: q["config_groups"]["group_0"]["weights"].update(strategy="tensor"),
     r"compressed-tensors weights \{'strategy': 'tensor'\}; FP8-dynamic needs"),
    (lambda q: q["config_groups"]["group_0"]["input_activations"].update(dynamic=False),
     r"input_activations \{'dynamic': False\}"),
    (lambda q: q.update(kv_cache_scheme={"num_bits": 8, "type": "float"}), r"kv_cache_scheme"),
    (lambda q: q.update(ignore=["lm_head", "model.layers.0.self_attn.q_proj"]), r"leaves \['model.layers.0"),
])
def test_other_compressed_tensors_schemes_are_refused(dirs, tmp_path, edit, match):
    d = str(tmp_path / "m")
    shutil.copytree(dirs["ct"], d)
    cfg = json.load(open(os.path.join(d, "config.json")))
    edit(cfg["quantization_config"])
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
    with pytest.raises(CheckpointError, match=rf"quantized .*{match}.*quant_method 'fp8'"):
        model_config(resolve_model(d))


@pytest.mark.parametrize("edit,match", [
    (dict(activation_scheme="static"), r"activation_scheme='static'; only 'dynamic'"),
    (dict(weight_block_size=None), r"weight_block_size=None"),
])
def test_other_hf_fp8_configs_are_refused(dirs, tmp_path, edit, match):
    d = str(tmp_path / "m")
    shutil.copytree(dirs["block"], d)
    cfg = json.load(open(os.path.join(d, "config.json")))
    cfg["quantization_config"].update(edit)
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
    with pytest.raises(CheckpointError, match=match):
        model_config(resolve_model(d))
