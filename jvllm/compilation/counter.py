"""The process-wide XLA compile counter, JAX's persistent compilation cache, and a report of what
XLA produced for one executable.

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
    with _lock:
        if _installed:
            return
        _installed = True
    jax.monitoring.register_event_duration_secs_listener(_listener)


def compile_count() -> int:
    install_counter()
    return _count


_cache_root: str | None = None  # jvllm's cache directory (enable_persistent_cache), None = off
_jax_dir_set = False  # whether jvllm pointed JAX's persistent cache there


def enable_persistent_cache(path: str | None = None, jax_cache: bool | None = None) -> str | None:
    """Turn on jvllm's persistent cache (default ~/.cache/jvllm/xla, env JVLLM_CACHE_DIR; 'off'
    disables): its executable cache (`jvllm.compilation.executable_cache`, under `executables/`)
    and, with `jax_cache` (default: on accelerators, not on CPU), JAX's own persistent compilation
    cache in the same directory. Returns the directory in use, or None.

    Why not JAX's cache on CPU: an XLA:CPU executable that JAX's cache loaded serializes without
    its kernels, so jvllm's copy of it fails on the next start ("Function ... not found");
    jvllm's executable cache alone holds every engine program there (executable_cache.compile_for_cache
    refuses to store such a copy where JAX's cache is on anyway). Hazard: the directory must be
    trusted: jvllm's executable cache stores pickles."""
    global _cache_root, _jax_dir_set
    path = path or os.environ.get("JVLLM_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "jvllm", "xla")
    disable_persistent_cache()  # what an earlier engine of this process turned on
    if path == "off":
        return None
    if jax_cache is None:
        jax_cache = jax.default_backend() != "cpu"
    try:
        os.makedirs(path, exist_ok=True)
        if jax_cache:
            jax.config.update("jax_compilation_cache_dir", path)
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
            jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
            _jax_dir_set = True
    except Exception:  # read-only home, old jax: run without the cache
        return None
    _cache_root = path
    return path


def disable_persistent_cache():
    """Undo enable_persistent_cache: jvllm's cache off, and JAX's cache dir unset if jvllm set it
    (a directory the user gave JAX is left alone)."""
    global _cache_root, _jax_dir_set
    if _jax_dir_set:
        jax.config.update("jax_compilation_cache_dir", None)
        _jax_dir_set = False
    _cache_root = None


def cache_root() -> str | None:
    """The directory enable_persistent_cache turned on (None: not called, or off)."""
    return _cache_root


def temp_bytes(compiled) -> int | None:
    """XLA's temp allocation of an executable (memory analysis), also for one loaded from jvllm's
    cache on a backend whose loaded executables have no analysis; None when unknown."""
    try:
        return int(compiled.memory_analysis().temp_size_in_bytes)
    except Exception:
        return getattr(compiled, "_jvllm_meta", {}).get("temp_size_in_bytes")


def program_report(compiled) -> dict:
    """What XLA produced for one compiled executable: flops / bytes (cost analysis), memory sizes and
    the number of fusions in the optimized HLO. Fields a backend cannot report are left out."""
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
