"""jvllm's executable cache: serialized executables under <persistent cache dir>/executables.

Beside JAX's persistent cache, each entry also keeps what the compiling process's memory analysis
said (a loaded executable has none on some backends, and the KV sizing reads it). An entry is
keyed by what the program IS: the sha256 of the lowered module's text (so two models whose inputs
have equal shapes never share an entry), its devices, the jax / jaxlib versions, the backend and
XLA_FLAGS. A warm start therefore still pays a trace and a lowering per program, never a compile.

Hazards: entries are pickles, so the cache directory must be trusted (whoever can write it can run
code in every process that loads from it). Single-process runs only (a serialized executable
carries its device assignment, and every process of a multi-process run would need the same entry
at once); any failure to load or store falls back to compiling and is counted in `stats()`.
"""
from __future__ import annotations

import hashlib
import os
import pickle
import tempfile
import threading

import jax

from jvllm.compilation.counter import temp_bytes

_lock = threading.Lock()
_stats = dict(loaded=0, stored=0, failed=0)


def _bump(name: str):
    with _lock:
        _stats[name] += 1


def cache_dir() -> str | None:
    """<persistent cache dir>/executables, or None when the persistent cache is off."""
    path = jax.config.jax_compilation_cache_dir
    return os.path.join(path, "executables") if path else None


def enabled() -> bool:
    """Whether programs go through this cache: a single-process run with the persistent cache on,
    unless JVLLM_EXECUTABLE_CACHE=0."""
    return (os.environ.get("JVLLM_EXECUTABLE_CACHE", "1") != "0" and jax.process_count() == 1
            and cache_dir() is not None)


def executable_key(lowered, devices) -> str:
    """sha256 of the lowered module's text, the devices it runs on (in order), versions and flags."""
    from jax._src.lib import version_str as jaxlib_version

    h = hashlib.sha256()
    h.update(lowered.as_text().encode())
    env = (jax.__version__, jaxlib_version, os.environ.get("XLA_FLAGS", ""), jax.default_backend(),
           tuple((d.id, d.device_kind) for d in devices), jax.process_count())
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


def store(key: str, compiled) -> bool:
    from jax.experimental import serialize_executable as se

    d = cache_dir()
    if not d:
        return False
    try:
        blob = pickle.dumps((*se.serialize(compiled), dict(temp_size_in_bytes=temp_bytes(compiled))))
        os.makedirs(d, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=d, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
        os.replace(tmp, os.path.join(d, key + ".exe"))  # atomic: concurrent starts never read half a file
    except Exception:
        _bump("failed")
        return False
    _bump("stored")
    return True


def stats() -> dict:
    with _lock:
        return dict(_stats)
