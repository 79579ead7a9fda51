"""jvllm's executable cache: serialized executables under <persistent cache dir>/executables.

Beside JAX's persistent cache, each entry also keeps what the compiling process's memory analysis
said (a loaded executable has none on some backends, and the KV sizing reads it), inside the entry
and in a small `<key>.json` beside it (read by the KV sizing without loading the executable). An
entry is keyed by what the program is made from: its fingerprint (`fingerprint.py`: jvllm's source,
library versions, the jitted function's closure and abstract arguments, jax's config, XLA_FLAGS,
devices), computed without tracing, so a warm start neither traces, lowers nor compiles. A program
with no exact fingerprint is keyed by the sha256 of its lowered module's text (`executable_key`)
plus the same environment, at the price of a trace and a lowering.

Hazards: entries are pickles, so the cache directory must be trusted (whoever can write it can run
code in every process that loads from it). Single-process runs only (a serialized executable
carries its device assignment, and every process of a multi-process run would need the same entry
at once); any failure to load or store falls back to compiling and is counted in `stats()`. On
CPU, JAX's own cache stays off (counter.enable_persistent_cache says why) and a program JAX's cache
served anyway is not stored (`compile_for_cache`).
"""
from __future__ import annotations

import hashlib
import json
import os
import pickle
import tempfile
import threading

import jax

from jvllm.compilation.counter import temp_bytes

_lock = threading.Lock()
_stats = dict(loaded=0, stored=0, failed=0, skipped=0)


def _bump(name: str):
    with _lock:
        _stats[name] += 1


def cache_dir() -> str | None:
    """<jvllm's cache dir>/executables (counter.enable_persistent_cache), else under JAX's
    persistent cache dir when a user set one; None when neither is on."""
    from jvllm.compilation.counter import cache_root

    path = cache_root() or jax.config.jax_compilation_cache_dir
    return os.path.join(path, "executables") if path else None


_tls = threading.local()  # per compiling thread: JAX persistent-cache hits seen
_listening = False


def _on_event(event: str, **kwargs):
    if event == "/jax/compilation_cache/cache_hits":
        _tls.hits = getattr(_tls, "hits", 0) + 1


def compile_for_cache(lowered, devices):
    """(lowered.compile(), whether jvllm may store it). Not storable: an XLA:CPU executable that
    JAX's persistent cache served (its serialized copy lacks the kernels, so loading it on the next
    start fails at the first call with "Function ... not found"); counted as `skipped`. Hits are
    seen through jax.monitoring in the compiling thread (the event fires there, synchronously)."""
    global _listening
    with _lock:
        if not _listening:
            jax.monitoring.register_event_listener(_on_event)
            _listening = True
    before = getattr(_tls, "hits", 0)
    exe = lowered.compile()
    served = getattr(_tls, "hits", 0) > before
    if served and any(d.platform == "cpu" for d in devices):
        _bump("skipped")
        return exe, False
    return exe, True


def enabled() -> bool:
    """Whether programs go through this cache: a single-process run with the persistent cache on,
    unless JVLLM_EXECUTABLE_CACHE=0."""
    return (os.environ.get("JVLLM_EXECUTABLE_CACHE", "1") != "0" and jax.process_count() == 1
            and cache_dir() is not None)


def executable_key(lowered, devices) -> str:
    """sha256 of the lowered module's text, its argument and result trees, the devices it runs on
    (in order) and the environment of `fingerprint.environment` (versions, jax config, XLA_FLAGS,
    backend). The trees matter: unused arguments are pruned from the module, so two signatures
    that differ only in an unused argument (None or an array) lower to the same text, and the
    stored executable only accepts the tree it was compiled with."""
    from jvllm.compilation.fingerprint import environment

    h = hashlib.sha256()
    h.update(lowered.as_text().encode())
    h.update(repr((lowered.in_tree, lowered.out_tree)).encode())
    env = (environment(), tuple((d.id, d.device_kind) for d in devices))
    h.update(repr(env).encode())
    return h.hexdigest()


def load(key: str, devices):
    """The cached executable for `key` loaded onto `devices` (the devices it was compiled for, in
    its order), or None (absent, unreadable, another jax or device)."""
    from jax.experimental import serialize_executable as se

    d = cache_dir()
    path = os.path.join(d, key + ".exe") if d else None
    if not path or not os.path.isfile(path):
        return None
    try:
        with open(path, "rb") as f:
            payload, in_tree, out_tree, meta = pickle.load(f)
        exe = se.deserialize_and_load(payload, in_tree, out_tree, execution_devices=list(devices))
        exe._jvllm_meta = meta  # what the compiling process saw (memory analysis), see temp_bytes()
    except Exception:
        _bump("failed")
        return None
    _bump("loaded")
    return exe


def load_meta(key: str) -> dict | None:
    """What the compiling process's memory analysis said about entry `key` ({"temp_size_in_bytes":
    int | None}), without loading the executable; None when there is no readable entry."""
    d = cache_dir()
    if not d or not os.path.isfile(os.path.join(d, key + ".exe")):
        return None
    try:
        with open(os.path.join(d, key + ".json")) as f:
            meta = json.load(f)
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


def _write_atomic(d: str, name: str, data: bytes):
    fd, tmp = tempfile.mkstemp(dir=d, suffix=".tmp")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, os.path.join(d, name))  # atomic: concurrent starts never read half a file


def store(key: str, compiled) -> bool:
    """Serialize `compiled` under `key` (and its memory analysis beside it); False on failure."""
    from jax.experimental import serialize_executable as se

    d = cache_dir()
    if not d:
        return False
    try:
        meta = dict(temp_size_in_bytes=temp_bytes(compiled))
        blob = pickle.dumps((*se.serialize(compiled), meta))
        os.makedirs(d, exist_ok=True)
        _write_atomic(d, key + ".json", json.dumps(meta).encode())  # first: an .exe never lacks its meta
        _write_atomic(d, key + ".exe", blob)
    except Exception:
        _bump("failed")
        return False
    _bump("stored")
    return True


def stats() -> dict:
    with _lock:
        return dict(_stats)
