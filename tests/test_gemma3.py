"""The real Gemma 3 (google/gemma-3-270m, Q4_K_M GGUF: the built-in `gemma3`) against transformers
reading the same file (`gguf_file=`): float32 logits, greedy generation token for token through one
engine, the torch-free tokenizer, and the K-quant dequantization it relies on."""
import numpy as np
import pytest

from jvllm import LLM, SamplingParams

# float32 on both sides; logits of this model reach ~30 over a 262k vocabulary and the observed
# max |difference| is ~7e-5 (reduction order); a wrong norm, scale or rope base gives >= 1e-1
ATOL = 2e-4
TEXTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village by the sea,"]


@pytest.fixture(scope="module")
def gemma3_path():
    from jvllm.converters import resolve_model

    return resolve_model("gemma3").path


@pytest.fixture(scope="module")
def hf_gemma3(gemma3_path):
    import os

    import torch
    import transformers

    d, f = os.path.split(gemma3_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(d, gguf_file=f)
    return model, tok


@pytest.fixture(scope="module")
def gemma3_llm():
    llm = LLM("gemma3", dtype="float32", max_model_len=64, max_num_batched_tokens=32, max_num_seqs=4,
              token_buckets=(32,), use_tqdm_on_load=False)
    yield llm
    llm.shutdown()


def test_config_is_gemma3():
    from jvllm.converters import model_config, resolve_model

    c = model_config(resolve_model("gemma3"))
    assert (c.architecture, c.head_dim, c.vocab_size, c.num_layers) == ("Gemma3ForCausalLM", 256, 262144, 18)
    assert c.layer_windows[5] is None and c.layer_windows[0] == 512 and c.local_rope_theta == 10000.0
    assert c.rope_theta == 1e6 and c.tie_word_embeddings and c.qk_norm and c.norm_unit_offset


def test_tokenizer_matches_transformers(gemma3_llm, hf_gemma3):
    ours = gemma3_llm.get_tokenizer()
    _, theirs = hf_gemma3
    for t in TEXTS + ["  spaces\tand\nnewlines ", "Ünïcödé 日本語 🙂", "<start_of_turn>user\nhi<end_of_turn>"]:
        assert ours(t)["input_ids"] == theirs(t)["input_ids"], t
        assert ours.decode(theirs(t)["input_ids"]) == theirs.decode(theirs(t)["input_ids"])


def test_greedy_matches_transformers(gemma3_llm, hf_gemma3):
    import torch

    model, tok = hf_gemma3
    prompts = [tok(t)["input_ids"] for t in TEXTS]
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = gemma3_llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            ref = model.generate(torch.tensor([p]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
        assert o.outputs[0].token_ids == ref, (tok.decode(p), o.outputs[0].text, tok.decode(ref))
    assert gemma3_llm.get_stats()["compiles_after_warmup"] == 0


def test_logits_match_transformers(gemma3_llm, hf_gemma3, monkeypatch):
    """`jvllm verify gemma3` (its reference: the transformers model already loaded here)."""
    from jvllm import verify as verify_mod

    monkeypatch.setattr(verify_mod, "load_reference", lambda spec: hf_gemma3[0])
    ok, reports = verify_mod.verify("gemma3", prompts=TEXTS, atol=ATOL, log=lambda *a: None)
    assert ok and all(r.max_abs_diff < ATOL and r.top1_agreement == 1.0 for r in reports), \
        [(r.max_abs_diff, r.top1_agreement) for r in reports]


@pytest.mark.filterwarnings("ignore:invalid value encountered")  # random f16 scales include NaN / inf
@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q5_0"])
def test_kquant_dequantization_is_exact(gemma3_path, qtype):
    """jvllm's dequantization equals the gguf package's bit for bit: on the file's own tensors of
    that type where it has some, and on random blocks (every bit pattern of scales and quants)."""
    import gguf

    from jvllm.converters.gguf_dequant import dequantize
    from jvllm.converters.gguf_file import GGUFFile

    t = gguf.GGMLQuantizationType[qtype]
    block, size = gguf.GGML_QUANT_SIZES[t]
    raw = np.random.default_rng(0).integers(0, 256, size * 64, dtype=np.uint8)
    cases = [(raw, (4, 16 * block))]
    r = GGUFFile(gemma3_path)
    own = sorted((x for x in r.tensors if x.ggml_type == t), key=lambda x: int(np.prod(x.numpy_shape)))
    cases += [(r.tensor_bytes(x), x.numpy_shape) for x in own[:2]]  # the smallest two (gguf's kernels are slow)
    for b, shape in cases:
        ours = dequantize(b, t, shape)
        ref = np.asarray(gguf.quants.dequantize(b, t), np.float32).reshape(shape)
        np.testing.assert_array_equal(ours, ref)  # NaNs in the same places count as equal
