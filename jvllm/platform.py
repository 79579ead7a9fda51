"""Which JAX accelerator platforms this installation can use, found without initializing JAX.

JAX registers a TPU backend factory in every install and tries it when `JAX_PLATFORMS` is unset;
without libtpu that attempt logs "Unable to initialize backend 'tpu'" (INFO, shown by any
program that logs at INFO, such as `jvllm serve`). `cpu_only_default()` avoids the attempt on
machines that have no accelerator plugin at all, and leaves every other machine alone: when a
CUDA/ROCm plugin (a `jax_plugins` entry point or module) or libtpu is installed, JAX's own
discovery still runs and GPUs/TPUs are used.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import pkgutil
import sys


def accelerator_plugins() -> tuple[str, ...]:
    """Names of the installed JAX accelerator plugins (entry points in group `jax_plugins`,
    modules of the `jax_plugins` namespace package, and `libtpu`), sorted; () on a CPU-only
    install."""
    names = set()
    try:
        names.update(ep.name for ep in importlib.metadata.entry_points(group="jax_plugins"))
    except Exception:  # broken distribution metadata: fall back to the module scan below
        pass
    try:
        import jax_plugins

        names.update(m.name for m in pkgutil.iter_modules(jax_plugins.__path__))
    except ImportError:
        pass
    for mod in ("libtpu", "libtpu_nightly"):
        if importlib.util.find_spec(mod) is not None:
            names.add(mod)
    return tuple(sorted(names))


def cpu_only_default() -> bool:
    """Set JAX_PLATFORMS=cpu (and jax's `jax_platforms` option, if jax is imported already) when
    the user set no JAX_PLATFORMS and no accelerator plugin is installed; returns whether it did.
    Only effective before JAX initializes its backends (the first jax.devices() or computation)."""
    if os.environ.get("JAX_PLATFORMS") or os.environ.get("JAX_PLATFORM_NAME"):
        return False
    if accelerator_plugins():
        return False
    os.environ["JAX_PLATFORMS"] = "cpu"  # for child processes, and for jax when it is imported later
    if "jax" in sys.modules:  # jax reads the variable at import: tell its config too
        sys.modules["jax"].config.update("jax_platforms", "cpu")
    return True
