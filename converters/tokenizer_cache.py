"""A GGUF's built tokenizer, kept on disk so a warm start does not build it again.

Building the tokenizer from a GGUF's metadata (`gguf_tokenizer.tokenizer_from_gguf`) imports
transformers' GGUF builders and derives the vocabulary and merges in Python every start. An
entry here is the built backend's `tokenizer.json` text plus the keyword arguments the wrapper
class took, in one JSON file `<dir>/<key>.json`; loading it is `tokenizers.Tokenizer.from_str`
and the same wrapper construction as the build's, so the result is the same tokenizer (tests
compare encodings, decodings, special tokens and chat templates of a loaded entry with a fresh
build).

The key is content-addressed, so a stale entry cannot be found: sha256 of every metadata byte of
the GGUF (the header up to the tensor table: vocabulary, merges, scores, special ids, chat
template, architecture), the source of the modules that turn metadata into a tokenizer
(`gguf_file`, `gguf_tokenizer`, this one) and the versions of transformers and tokenizers. A file
replaced in place, a new jvllm or a new transformers each give another key. Entries are written
atomically (a temporary file renamed over), so concurrent starts never read half a file; an
unreadable entry is rebuilt and rewritten. Entries are JSON, never executed.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile

FORMAT = 1  # bump when an entry's layout changes


def _sources() -> bytes:
    from . import gguf_file, gguf_tokenizer

    out = b""
    for mod in (gguf_file, gguf_tokenizer):
        with open(mod.__file__, "rb") as f:
            out += f.read() + b"\0"
    with open(__file__, "rb") as f:
        return out + f.read()


def entry_key(r) -> str:
    """The cache key of GGUFFile `r`'s tokenizer (see the module docstring)."""
    import tokenizers
    import transformers

    h = hashlib.sha256()
    h.update(f"jvllm-gguf-tokenizer {FORMAT} transformers {transformers.__version__} "
             f"tokenizers {tokenizers.__version__}\0".encode())
    h.update(r.metadata_bytes())
    h.update(_sources())
    return h.hexdigest()


def _load(path: str):
    """(architecture, backend, kwargs) of entry `path`, or None when absent or unreadable."""
    import tokenizers

    try:
        with open(path, encoding="utf-8") as f:
            e = json.load(f)
        if e.get("format") != FORMAT:
            return None
        return e["architecture"], tokenizers.Tokenizer.from_str(e["tokenizer"]), dict(e["kwargs"])
    except Exception:  # unreadable, not JSON, missing keys, or a tokenizer.json tokenizers refuses
        return None


def _store(path: str, arch: str, backend, kwargs: dict) -> bool:
    try:
        blob = json.dumps(dict(format=FORMAT, architecture=arch, kwargs=kwargs, tokenizer=backend.to_str()))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(blob)
        os.replace(tmp, path)
    except (OSError, TypeError, ValueError):  # a read-only cache, a value JSON cannot hold: run uncached
        return False
    return True


def cached_tokenizer(r, cache_dir: str | None, build):
    """The tokenizer of GGUFFile `r`: from the entry under `cache_dir` when there is one, else
    `build(r)` -> (architecture, backend, kwargs) (stored for the next start when `cache_dir` is
    set). Returns (architecture, backend, kwargs, hit)."""
    path = os.path.join(cache_dir, entry_key(r) + ".json") if cache_dir else None
    got = _load(path) if path else None
    if got is not None:
        return (*got, True)
    arch, backend, kwargs = build(r)
    if path:
        _store(path, arch, backend, kwargs)
    return arch, backend, kwargs, False
