"""converters.tokenizer_cache: a GGUF tokenizer loaded from its cache entry is the tokenizer a
fresh build gives, and no entry is ever found for other metadata, other code or other versions."""
from __future__ import annotations

import os

import pytest

from jvllm.converters import gguf_tokenizer as gt
from jvllm.converters import tokenizer_cache
from jvllm.converters.gguf_file import GGUFFile
from tests.test_gguf_tokenizer import CHAT, SPM_TEXTS, TEXTS, assert_same, write_spm_gguf

TPL = "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"


def load(path, cache_dir):
    """(tokenizer, whether it came from the cache)."""
    r = GGUFFile(path)
    arch, backend, kwargs, hit = tokenizer_cache.cached_tokenizer(r, cache_dir, gt.build_backend)
    return gt.tokenizer_class(arch)(tokenizer_object=backend, **kwargs), hit


def assert_same_tokenizer(a, b, texts):
    assert type(a) is type(b)
    assert_same(a, b, texts)
    assert a.chat_template == b.chat_template
    assert a.get_vocab() == b.get_vocab()
    if a.chat_template:
        for gen in (False, True):
            assert (a.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=gen)
                    == b.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=gen))


def test_smollm2_entry_is_the_built_tokenizer(smollm2_path, tmp_path):
    built = gt.tokenizer_from_gguf(GGUFFile(smollm2_path))
    first, hit1 = load(smollm2_path, str(tmp_path))
    second, hit2 = load(smollm2_path, str(tmp_path))
    assert (hit1, hit2) == (False, True) and len(os.listdir(tmp_path)) == 1
    specials = ["<|im_start|>user\nhi<|im_end|>", "a<|endoftext|>b"]
    assert_same_tokenizer(second, built, TEXTS + specials)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_sentencepiece_entry_is_the_built_tokenizer(tmp_path, arch):
    path = write_spm_gguf(str(tmp_path / f"spm-{arch}.gguf"), arch, template=TPL)
    built = gt.tokenizer_from_gguf(GGUFFile(path))
    load(path, str(tmp_path / "c"))
    cached, hit = load(path, str(tmp_path / "c"))
    assert hit
    assert_same_tokenizer(cached, built, SPM_TEXTS)
    assert cached("hello")["input_ids"][0] == 1  # add_bos_token survives the entry


def test_file_rewritten_in_place_is_not_served_from_the_cache(tmp_path):
    """Same path, same size class, other metadata (a chat template): another key, the new template."""
    path = str(tmp_path / "m.gguf")
    cache = str(tmp_path / "c")
    write_spm_gguf(path, template=TPL)
    assert load(path, cache)[0].chat_template == TPL
    write_spm_gguf(path, template=TPL.replace(": ", " says "))
    tok, hit = load(path, cache)
    assert not hit and tok.chat_template == TPL.replace(": ", " says ")
    assert len(os.listdir(cache)) == 2


def test_key_covers_code_and_versions(tmp_path, monkeypatch):
    path = write_spm_gguf(str(tmp_path / "m.gguf"))
    r = GGUFFile(path)
    k = tokenizer_cache.entry_key(r)
    assert tokenizer_cache.entry_key(GGUFFile(path)) == k  # stable across readers
    monkeypatch.setattr(tokenizer_cache, "_sources", lambda: b"other code")
    assert tokenizer_cache.entry_key(r) != k
    monkeypatch.undo()
    import transformers

    monkeypatch.setattr(transformers, "__version__", "0.0.0")
    assert tokenizer_cache.entry_key(r) != k
    monkeypatch.undo()
    monkeypatch.setattr(tokenizer_cache, "FORMAT", tokenizer_cache.FORMAT + 1)
    assert tokenizer_cache.entry_key(r) != k


@pytest.mark.parametrize("damage", [b"", b"{not json", b'{"format": 1}',
                                    b'{"format": 1, "architecture": "llama", "kwargs": {}, "tokenizer": "{}"}'])
def test_unreadable_entry_is_rebuilt(tmp_path, damage):
    path = write_spm_gguf(str(tmp_path / "m.gguf"), template=TPL)
    cache = str(tmp_path / "c")
    load(path, cache)
    (entry,) = os.listdir(cache)
    with open(os.path.join(cache, entry), "wb") as f:
        f.write(damage)
    tok, hit = load(path, cache)
    assert not hit and tok.chat_template == TPL
    assert load(path, cache)[1]  # rewritten whole


def test_no_cache_dir_builds_every_time(tmp_path):
    path = write_spm_gguf(str(tmp_path / "m.gguf"))
    assert load(path, None)[1] is False and load(path, None)[1] is False


def test_worker_builds_the_tokenizer_beside_the_weights(tmp_path, monkeypatch):
    """Worker.load starts the tokenizer's build (cached under <cache dir>/tokenizers, a hit on the
    next start) and Worker.tokenizer() returns it; on a CPU the build starts after the weights and
    its errors come from tokenizer() (on accelerators from load()); skip_tokenizer_init never
    starts it. An engine whose tokenizer fails is not built."""
    import jvllm.converters as conv
    from jvllm import LLM
    from jvllm.engine.engine_config import EngineConfig
    from jvllm.worker.worker import Worker

    cfg = EngineConfig(model="smollm2", max_model_len=64, compilation_cache_dir=str(tmp_path))
    w = Worker(cfg)
    assert w.load() > 0
    tok = w.tokenizer()
    assert w.tokenizer() is tok  # waited for once
    assert len(os.listdir(tmp_path / "tokenizers")) == 1
    assert w.tokenizer_seconds > 0 and w.init_parts["tokenizer_s"] >= 0
    real = conv.load_tokenizer
    hits = []
    monkeypatch.setattr(conv, "load_tokenizer", lambda spec, d: hits.append(d) or real(spec, d))
    w2 = Worker(cfg)
    w2.load()
    tok2 = w2.tokenizer()
    assert hits == [str(tmp_path / "tokenizers")] and tok2("Hi there")["input_ids"] == tok("Hi there")["input_ids"]

    def boom(spec, d):
        raise ValueError("tokenizer boom")

    monkeypatch.setattr(conv, "load_tokenizer", boom)
    w3 = Worker(cfg)
    w3.load()  # a CPU: the build runs after the weights
    for _ in range(2):  # the error again on a second call, never a silent None
        with pytest.raises(ValueError, match="tokenizer boom"):
            w3.tokenizer()
    with pytest.raises(ValueError, match="tokenizer boom"):
        LLM("smollm2", max_model_len=64, compilation_cache_dir=str(tmp_path), use_tqdm_on_load=False)
    import dataclasses

    w4 = Worker(dataclasses.replace(cfg, skip_tokenizer_init=True))
    w4.load()
    tok3 = w4.tokenizer()
    assert tok3 is None
