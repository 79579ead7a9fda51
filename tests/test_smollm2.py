"""The real built-in model: `jvllm verify` on its GGUF and HF forms, and its Orbax conversion."""
import subprocess
import sys

import pytest

from jvllm.verify import verify


def test_verify_smollm2_gguf(smollm2_path, smollm2_gguf_reference, monkeypatch):
    """`jvllm verify` on the GGUF; its reference, `load_reference` on this GGUF, is the session's
    copy (conftest), read by that very function."""
    from jvllm import verify as verify_mod

    monkeypatch.setattr(verify_mod, "load_reference", lambda spec: smollm2_gguf_reference)
    ok, reports = verify(smollm2_path, log=lambda *a: None)
    assert ok and all(r.top1_agreement == 1.0 for r in reports), reports


def test_verify_smollm2_hf_form(smollm2_hf_dir):
    ok, reports = verify(smollm2_hf_dir, log=lambda *a: None)
    assert ok, reports


def test_verify_cli_exit_codes(ckpt_dir):
    """`jvllm verify` exits 0 on agreement and 1 when jvllm's weights are off by 10% in one tensor."""
    good = ckpt_dir("qwen2")
    r = subprocess.run([sys.executable, "-m", "jvllm.cli", "verify", good], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "PASS" in r.stdout and "fixed token ids" in r.stdout
    r = subprocess.run([sys.executable, "-c", (
        "import sys, jvllm.converters as c\n"
        "orig = c.load_checkpoint\n"
        "def tampered(*a, **k):\n"
        "    ck = orig(*a, **k)\n"
        "    ck.params['layers.0.mlp.up_proj'] = ck.params['layers.0.mlp.up_proj'] * 1.1\n"
        "    return ck\n"
        "c.load_checkpoint = tampered\n"
        "from jvllm.cli import main; main(['verify', sys.argv[1]])\n"), good], capture_output=True, text=True)
    assert r.returncode == 1 and "FAIL" in r.stdout, r.stdout + r.stderr


@pytest.mark.timeout(600)
def test_convert_smollm2_to_orbax_and_generate(tmp_path, smollm2_path):
    from jvllm import LLM, SamplingParams
    from jvllm.converters import convert_to_orbax, load_checkpoint

    dst = str(tmp_path / "smollm2-orbax")
    report = convert_to_orbax("smollm2", dst)
    ck = load_checkpoint(dst)
    assert report.load_s > 0 and ck.load_seconds > 0
    assert report.num_tensors == len(ck.params) and report.has_tokenizer
    assert report.num_params == sum(int(p.size) for p in ck.params.values()) > 100_000_000
    llm = LLM(dst, dtype="float32", max_model_len=128, max_num_batched_tokens=16, max_num_seqs=2,
              token_buckets=(16,), use_tqdm_on_load=False)
    out = llm.generate("The capital of France is", SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
    assert out[0].outputs[0].text.strip().startswith("Paris")
    llm.shutdown()
