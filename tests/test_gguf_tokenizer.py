"""The GGUF tokenizer built from metadata (no torch) against transformers' own GGUF tokenizer
(`AutoTokenizer.from_pretrained(..., gguf_file=...)`, which needs torch, installed for tests)."""
from __future__ import annotations

import os

import pytest

from jvllm.converters.gguf import gguf_tokenizer

TEXTS = [
    "Hello world",
    "  leading spaces,\ttabs\n\nand newlines  ",
    "héllo wörld — ünïcödé ✓ 日本語 🤖 naïve café",
    "1234567 + 89 = ? x^2",
    "",
]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there, ça va?"}]


def reference(path):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


def assert_same(mine, ref, texts):
    assert len(mine) == len(ref)
    for k in ("bos_token", "eos_token", "unk_token", "pad_token", "bos_token_id", "eos_token_id", "pad_token_id"):
        assert getattr(mine, k) == getattr(ref, k), k
    assert mine.all_special_tokens == ref.all_special_tokens
    for s in texts:
        a, b = mine(s)["input_ids"], ref(s)["input_ids"]
        assert a == b, (s, a, b)
        assert mine.decode(a) == ref.decode(b), s
        assert mine.decode(a, skip_special_tokens=True) == ref.decode(b, skip_special_tokens=True), s
        assert mine.convert_ids_to_tokens(a) == ref.convert_ids_to_tokens(b), s


def test_smollm2_gpt2_bpe_matches_transformers(smollm2_path):
    mine, ref = gguf_tokenizer(smollm2_path), reference(smollm2_path)
    specials = ["<|im_start|>user\nhi<|im_end|>", "a<|endoftext|>b", "<|im_end|><|im_end|>"]
    assert_same(mine, ref, TEXTS + specials)
    assert mine.chat_template == ref.chat_template
    for gen in (False, True):
        assert (mine.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=gen)
                == ref.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=gen))
    ids = mine.apply_chat_template(CHAT, add_generation_prompt=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    ref_ids = ref.apply_chat_template(CHAT, add_generation_prompt=True)
    assert list(ids) == list(ref_ids["input_ids"] if hasattr(ref_ids, "keys") else ref_ids)


# A tiny SentencePiece-style ("llama" token model) vocabulary: control tokens, the 256 byte
# tokens, single characters and a few merged pieces with scores (higher merges first).
_PIECES = ["▁", "e", "l", "o", "h", "w", "r", "d", "a", "t", "n", "s", "i", "c", "é", ",", "!",
           "▁h", "el", "ll", "lo", "▁w", "or", "ld", "▁t", "he", "▁the", "▁hel", "▁hell", "▁hello", "▁wor",
           "▁world", "in", "▁in", "at", "▁at", "an", "▁an", "▁and"]


def write_spm_gguf(path: str, arch: str = "llama", template: str | None = None):
    import gguf

    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + _PIECES
    types = [2, 3, 3] + [6] * 256 + [1] * len(_PIECES)   # UNKNOWN, CONTROL, BYTE, NORMAL
    scores = [0.0, 0.0, 0.0] + [0.0] * 256 + [-float(i) if len(p) == 1 else float(len(p)) for i, p in
                                              enumerate(_PIECES)]
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(16)
    w.add_feed_forward_length(32)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_scores(scores)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(0)
    if template:
        w.add_chat_template(template)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


SPM_TEXTS = ["hello world", "the hello and the world", " hello", "héllo, wörld!", "日本 🤖", "in at an",
             "<s>hello</s>", ""]


@pytest.mark.parametrize("arch", ["llama", "gemma3", "phi3"])
def test_sentencepiece_llama_model_matches_transformers(tmp_path, arch):
    tpl = "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
    path = write_spm_gguf(str(tmp_path / f"spm-{arch}.gguf"), arch, template=tpl)
    mine, ref = gguf_tokenizer(path), reference(path)
    assert_same(mine, ref, SPM_TEXTS)
    assert mine("hello")["input_ids"][0] == 1  # a llama-model vocabulary adds BOS unless told not to
    assert mine.chat_template == tpl
    assert mine.apply_chat_template(CHAT, tokenize=False) == ref.apply_chat_template(CHAT, tokenize=False)


def test_unsupported_token_model_is_named(tmp_path):
    import gguf

    path = str(tmp_path / "t5.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_tokenizer_model("t5")
    w.add_token_list(["<pad>", "a"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"tokenizer model 't5' is not supported; supported: gpt2, llama"):
        gguf_tokenizer(path)


def test_special_id_outside_vocab_is_an_error(tmp_path):
    from jvllm.converters import CheckpointError

    path = write_spm_gguf(str(tmp_path / "bad.gguf"))
    import gguf

    r = gguf.GGUFReader(path)
    bad = str(tmp_path / "bad2.gguf")
    w = gguf.GGUFWriter(bad, "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(list(r.fields["tokenizer.ggml.tokens"].contents()))
    w.add_eos_token_id(10_000)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CheckpointError, match=r"eos_token_id = 10000 is outside the vocabulary of \d+ tokens"):
        gguf_tokenizer(bad)


def test_no_tokenizer_metadata_gives_none(tmp_path):
    import gguf

    path = str(tmp_path / "none.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert gguf_tokenizer(path) is None


def test_tokenizer_class_table_matches_autotokenizer():
    """jvllm names the tokenizer class per GGUF architecture itself (importing AutoTokenizer's
    tables imports torch where installed); the table must agree with AutoTokenizer's choice."""
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES, tokenizer_class_from_name

    from transformers import PreTrainedTokenizerFast

    from jvllm.converters.gguf_tokenizer import _MODEL_TYPE, tokenizer_class

    for arch in ("llama", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "qwen2moe", "qwen3moe", "mistral", "phi3"):
        model_type = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}.get(arch, _MODEL_TYPE.get(arch, arch))
        name = TOKENIZER_MAPPING_NAMES.get(model_type)
        want = tokenizer_class_from_name(name) if isinstance(name, str) else None
        got = tokenizer_class(arch)
        if want is None or want is PreTrainedTokenizerFast or want.__name__ == "LlamaTokenizer":
            assert got is PreTrainedTokenizerFast, (arch, got)
        else:
            assert got is want, (arch, got, want)
