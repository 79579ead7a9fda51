"""Quantized checkpoints are refused with an error that names quantization and what is supported."""
import json
import os
import shutil

import pytest

from jvllm.converters import CheckpointError, load_checkpoint, model_config, resolve_model

SAYS_SUPPORTED = r"GGUF files .* dequantized"


def _copy(ckpt_dir, tmp_path):
    d = str(tmp_path / "m")
    shutil.copytree(ckpt_dir("llama"), d)
    return d


def _edit_tensors(d, fn):
    import safetensors.torch

    p = os.path.join(d, "model.safetensors")
    t = safetensors.torch.load_file(p)
    fn(t)
    safetensors.torch.save_file(t, p, metadata={"format": "pt"})


@pytest.mark.parametrize("method", ["awq", "gptq", "fp8"])
def test_quantization_config_is_refused_before_weights(ckpt_dir, tmp_path, method):
    d = _copy(ckpt_dir, tmp_path)
    cfg = json.load(open(os.path.join(d, "config.json")))
    cfg["quantization_config"] = {"quant_method": method, "bits": 4}
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
    os.remove(os.path.join(d, "model.safetensors"))  # never read: the config is enough
    for call in (lambda: model_config(resolve_model(d)), lambda: load_checkpoint(d)):
        with pytest.raises(CheckpointError, match=rf"quantized .*quant_method='{method}'.*{SAYS_SUPPORTED}"):
            call()


def test_fp8_tensor_is_refused(ckpt_dir, tmp_path):
    import torch

    d = _copy(ckpt_dir, tmp_path)
    name = "model.layers.0.self_attn.q_proj.weight"

    def to_fp8(t):
        t[name] = t[name].to(torch.float8_e4m3fn)
        t[name + "_scale"] = torch.ones(())

    _edit_tensors(d, to_fp8)
    # the reader meets the fp8 weight or its scale first (file order): either names quantization
    with pytest.raises(CheckpointError, match=r"q_proj\.weight(' has dtype F8_E4M3, a quantized|_scale' belongs to a "
                                              rf"quantized layer).*{SAYS_SUPPORTED}"):
        load_checkpoint(d)
    _edit_tensors(d, lambda t: t.pop(name + "_scale"))
    with pytest.raises(CheckpointError, match=rf"{name}' has dtype F8_E4M3, a quantized .*{SAYS_SUPPORTED}"):
        load_checkpoint(d)


def test_awq_qweight_is_refused(ckpt_dir, tmp_path):
    import torch

    d = _copy(ckpt_dir, tmp_path)
    base = "model.layers.0.mlp.up_proj"

    def to_awq(t):
        del t[base + ".weight"]
        t[base + ".qweight"] = torch.zeros(64, 16, dtype=torch.int32)
        t[base + ".qzeros"] = torch.zeros(1, 16, dtype=torch.int32)
        t[base + ".scales"] = torch.ones(1, 128, dtype=torch.float16)

    _edit_tensors(d, to_awq)
    with pytest.raises(CheckpointError, match=rf"'{base}\.q(weight|zeros)' belongs to a quantized layer.*"
                                              rf"{SAYS_SUPPORTED}"):
        load_checkpoint(d)


def test_unrelated_unknown_tensor_keeps_its_message(ckpt_dir, tmp_path):
    import torch

    d = _copy(ckpt_dir, tmp_path)
    _edit_tensors(d, lambda t: t.__setitem__("model.layers.0.mlp.extra.weight", torch.zeros(3)))
    with pytest.raises(CheckpointError, match="unexpected tensor") as e:
        load_checkpoint(d)
    assert "quantiz" not in str(e.value)
