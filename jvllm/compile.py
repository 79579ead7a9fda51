"""Compile bookkeeping: a process-wide XLA compile counter, the persistent compilation cache, and
a per-program report of what XLA produced.

`compile_count()` counts every backend compile in this process (jax.monitoring's
'/jax/core/compile/backend_compile_duration' event), whoever triggered it, so a test can prove that
serving after warm-up compiles nothing: not the step, not the sampler, not a stray eager jnp op.
"""
from __future__ import annotations

import os
import threading

import jax

_lock = threading.Lock()
_count = 0
_installed = False


def _listener(name, duration, **kwargs):
    global _count
    if name == "/jax/core/compile/backend_compile_duration":
        with _lock:
            _count += 1


def install_counter():
    global _installed
    if not _installed:
        jax.monitoring.register_event_duration_secs_listener(_listener)
        _installed = True


def compile_count() -> int:
    install_counter()
    return _count


def enable_persistent_cache(path: str | None = None) -> str | None:
    """Turn on JAX's persistent compilation cache (default ~/.cache/jvllm/xla, env JVLLM_CACHE_DIR;
    'off' disables). Returns the directory in use."""
    path = path or os.environ.get("JVLLM_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "jvllm", "xla")
    if path == "off":
        return None
    try:
        os.makedirs(path, exist_ok=True)
        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    except Exception:  # read-only home, old jax: run without the cache
        return None
    return path


def program_report(compiled) -> dict:
    """What XLA produced for one compiled executable: flops / bytes (cost analysis), memory sizes and
    the number of fusions in the optimized HLO."""
    out: dict = {}
    try:
        ca = compiled.cost_analysis()
        ca = ca[0] if isinstance(ca, (list, tuple)) else ca
        out["flops"] = float(ca.get("flops", 0.0))
        out["bytes_accessed"] = float(ca.get("bytes accessed", 0.0))
    except Exception:
        pass
    try:
        ma = compiled.memory_analysis()
        out.update(argument_bytes=ma.argument_size_in_bytes, output_bytes=ma.output_size_in_bytes,
                   temp_bytes=ma.temp_size_in_bytes, alias_bytes=ma.alias_size_in_bytes)
    except Exception:
        pass
    try:
        text = compiled.as_text()
        # instructions of the form "%name = type fusion(operands), kind=kLoop, calls=..."
        out["fusions"] = sum(1 for line in text.splitlines() if " fusion(" in line and "kind=" in line)
        out["hlo_instructions"] = sum(1 for line in text.splitlines() if " = " in line)
    except Exception:
        pass
    return out


# --------------------------------------------------------------------------- executable cache
# JAX's persistent cache keys an executable by its lowered HLO, so even a hit costs a trace and a
# lowering (1.9-3.0 s per Llama-3-8B step program on a 2-core CPU). jvllm's own cache keys by
# what determines the program instead (the abstract inputs with their shardings, the program kind
# and static options, the model config, the jvllm sources, jax version, XLA flags and devices) and
# stores the serialized executable, so a warm start loads without tracing. Single-device runners
# only (a serialized executable carries its device assignment); any failure falls back to compiling.

_source_digest: str | None = None
_exe_stats = dict(loaded=0, stored=0, failed=0)


def source_digest() -> str:
    """sha256 over jvllm's own .py files (any code change invalidates cached executables)."""
    global _source_digest
    if _source_digest is None:
        import hashlib

        root = os.path.dirname(os.path.abspath(__file__))
        h = hashlib.sha256()
        for dirpath, dirnames, files in sorted(os.walk(root)):
            dirnames.sort()
            for f in sorted(files):
                if f.endswith(".py"):
                    with open(os.path.join(dirpath, f), "rb") as fh:
                        h.update(f.encode() + b"\0" + fh.read())
        _source_digest = h.hexdigest()
    return _source_digest


def executable_cache_dir() -> str | None:
    """<persistent cache dir>/executables, or None when the persistent cache is off."""
    path = jax.config.jax_compilation_cache_dir
    return os.path.join(path, "executables") if path else None


def executable_key(*parts) -> str:
    import hashlib

    from jax._src.lib import version_str as jaxlib_version

    env = (jax.__version__, jaxlib_version, os.environ.get("XLA_FLAGS", ""), jax.default_backend(),
           tuple(d.device_kind for d in jax.devices()), jax.device_count(), jax.process_count(), source_digest())
    return hashlib.sha256(repr((env, parts)).encode()).hexdigest()


def load_executable(key: str, devices=None):
    """The cached executable for `key` loaded onto `devices` (the devices it was compiled for, in
    its order; default: all of the backend's), or None (absent, unreadable, another jax / device)."""
    import pickle

    from jax.experimental import serialize_executable as se

    d = executable_cache_dir()
    path = os.path.join(d, key + ".exe") if d else None
    if not path or not os.path.isfile(path):
        return None
    try:
        with open(path, "rb") as f:
            payload, in_tree, out_tree, meta = pickle.load(f)
        exe = se.deserialize_and_load(payload, in_tree, out_tree, execution_devices=devices)
        exe._jvllm_meta = meta  # what the compiling process saw (memory analysis), see temp_bytes()
    except Exception:
        _exe_stats["failed"] += 1
        return None
    _exe_stats["loaded"] += 1
    return exe


def store_executable(key: str, compiled) -> bool:
    import pickle
    import tempfile

    from jax.experimental import serialize_executable as se

    d = executable_cache_dir()
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
        _exe_stats["failed"] += 1
        return False
    _exe_stats["stored"] += 1
    return True


def temp_bytes(compiled) -> int | None:
    """XLA's temp allocation of an executable (memory analysis), also for one loaded from jvllm's
    cache on a backend whose loaded executables have no analysis; None when unknown."""
    try:
        return int(compiled.memory_analysis().temp_size_in_bytes)
    except Exception:
        return getattr(compiled, "_jvllm_meta", {}).get("temp_size_in_bytes")


def executable_cache_stats() -> dict:
    return dict(_exe_stats)
