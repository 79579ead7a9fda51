"""A GGUF file's tokenizer, built from its metadata without PyTorch.

A GGUF carries no tokenizer.json: llama.cpp stores the vocabulary (`tokenizer.ggml.tokens`), the
token types, scores or merges, the special token ids and the chat template as metadata. This
module reads those keys (through `gguf_file.GGUFFile`) and hands them to transformers' own
GGUF tokenizer builders (`transformers.integrations.gguf.gguf_tokenizer_mapping`, which need only
`tokenizers`), so the result matches `AutoTokenizer.from_pretrained(..., gguf_file=...)` token
for token, without that path's torch import. Both llama.cpp token models jvllm's built-in models
use are covered: `gpt2` (byte-level BPE with merges) and `llama` (SentencePiece-style BPE whose
merges are derived from the scores); the builder picks Gemma's variant by architecture.

The result is a `transformers.PreTrainedTokenizerFast` (the subclass AutoTokenizer would pick for the
architecture) with bos/eos/unk/pad tokens, add_bos/
add_eos flags and the chat template set from the metadata. With a cache dir the built backend and
the wrapper's arguments are kept across starts (`tokenizer_cache`, keyed by the metadata's bytes),
so a warm start skips the builders.
"""
from __future__ import annotations

from .name_map import CheckpointError

# llama.cpp metadata key (after "tokenizer.") -> transformers' name, as transformers reads them
_TOKENIZER_KEYS = {
    "ggml.model": "tokenizer_type",
    "ggml.pre": "pre_tokenizer_type",
    "ggml.tokens": "tokens",
    "ggml.scores": "scores",
    "ggml.token_type": "token_type",
    "ggml.merges": "merges",
    "ggml.precompiled_charsmap": "precompiled_charsmap",
    "ggml.bos_token_id": "bos_token_id",
    "ggml.eos_token_id": "eos_token_id",
    "ggml.unknown_token_id": "unk_token_id",
    "ggml.padding_token_id": "pad_token_id",
    "ggml.add_space_prefix": "add_prefix_space",
}
_CONFIG_KEYS = {"chat_template": "chat_template", "ggml.add_bos_token": "add_bos_token",
                "ggml.add_eos_token": "add_eos_token"}
_SPECIAL_IDS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
                "pad_token": "padding_token_id"}
SUPPORTED_TOKEN_MODELS = ("gpt2", "llama")
_MODEL_TYPE = {"gemma3": "gemma3_text"}  # GGUF architecture -> transformers model type, where they differ


def tokenizer_metadata(r) -> tuple[str, dict, dict]:
    """(architecture, tokenizer_dict, tokenizer_config) from a GGUFFile, in the layout
    transformers' GGUF tokenizer builders take. CheckpointError for a special-token id outside
    the vocabulary."""
    arch = r.get("general.architecture")
    tok = {name: r.get(f"tokenizer.{key}") for key, name in _TOKENIZER_KEYS.items()
           if r.get(f"tokenizer.{key}") is not None}
    cfg = {name: r.get(f"tokenizer.{key}") for key, name in _CONFIG_KEYS.items()
           if r.get(f"tokenizer.{key}") is not None}
    if tok.get("tokenizer_type") == "llama":
        cfg.setdefault("add_bos_token", True)  # llama.cpp adds BOS to a SentencePiece vocab that says nothing
    n = len(tok.get("tokens", ()))
    for name, key in _SPECIAL_IDS.items():
        i = r.get(f"tokenizer.ggml.{key}")
        if i is None:
            cfg[name] = None
            continue
        if not 0 <= int(i) < n:
            raise CheckpointError(f"{r.path}: tokenizer.ggml.{key} = {i} is outside the vocabulary of {n} tokens")
        cfg[name] = tok["tokens"][int(i)]
    return arch, tok, cfg


def tokenizer_from_gguf(r, cache_dir: str | None = None):
    """The tokenizer a GGUFFile describes, or None when it has no `tokenizer.ggml.model`.
    ValueError naming the token model when it is neither of SUPPORTED_TOKEN_MODELS. `cache_dir`:
    where built tokenizers are kept across starts (`tokenizer_cache`; None: built every time)."""
    if r.get("tokenizer.ggml.model") is None:
        return None
    from .tokenizer_cache import cached_tokenizer

    arch, backend, kwargs, _ = cached_tokenizer(r, cache_dir, build_backend)
    return tokenizer_class(arch)(tokenizer_object=backend, **kwargs)


def build_backend(r):
    """(architecture, the `tokenizers.Tokenizer`, the wrapper class's keyword arguments) built
    from GGUFFile `r`'s metadata (the errors of `tokenizer_from_gguf`)."""
    arch, tok, cfg = tokenizer_metadata(r)
    model = tok["tokenizer_type"]
    if model not in SUPPORTED_TOKEN_MODELS:
        raise ValueError(f"{r.path}: GGUF tokenizer model {model!r} is not supported; "
                         f"supported: {', '.join(SUPPORTED_TOKEN_MODELS)}")
    if "tokens" not in tok:
        raise CheckpointError(f"{r.path}: GGUF tokenizer metadata has no tokenizer.ggml.tokens")
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer
    except ImportError as e:
        import transformers

        raise ImportError(f"building a GGUF tokenizer needs transformers>=5 with its GGUF tokenizer builders "
                          f"(found transformers {transformers.__version__}: {e})") from None
    backend, extra = convert_gguf_tokenizer(arch, tok)
    return arch, backend, {**cfg, **extra}


# GGUF architecture -> (module, class) of the tokenizer AutoTokenizer picks for its model type,
# where that is not the generic PreTrainedTokenizerFast. Named directly: importing transformers'
# auto-tokenizer tables imports its configuration code and, where installed, torch (seconds).
_TOKENIZER_CLASSES = {
    **{a: ("transformers.models.gemma.tokenization_gemma", "GemmaTokenizer") for a in ("gemma", "gemma2", "gemma3")},
    **{a: ("transformers.models.qwen2.tokenization_qwen2", "Qwen2Tokenizer")
       for a in ("qwen2", "qwen3", "qwen2moe", "qwen3moe")},
}


def tokenizer_class(arch: str):
    """The tokenizer class AutoTokenizer picks for this architecture's model type (GemmaTokenizer
    for gemma3, which also names `<mask>`; Qwen2Tokenizer for Qwen), else the generic
    PreTrainedTokenizerFast (tests/test_gguf_tokenizer.py checks the table against AutoTokenizer's)."""
    import importlib

    from transformers import PreTrainedTokenizerFast

    where = _TOKENIZER_CLASSES.get(arch)
    return getattr(importlib.import_module(where[0]), where[1]) if where else PreTrainedTokenizerFast
