"""Where a benchmark ran: package versions, the jvllm checkout's commit, the devices."""
from __future__ import annotations

import os
import platform
import re
import subprocess


def git_commit() -> dict:
    """The jvllm checkout's commit (None where there is no git metadata, e.g. a copied tree;
    JVLLM_GIT_COMMIT overrides)."""
    here = os.path.dirname(os.path.abspath(__file__))
    if os.environ.get("JVLLM_GIT_COMMIT"):
        return dict(commit=os.environ["JVLLM_GIT_COMMIT"], dirty=None)
    out = dict(commit=None, dirty=None)
    try:
        p = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10, check=False)
        sha = p.stdout.strip()
        if p.returncode == 0 and re.fullmatch(r"[0-9a-f]{40}", sha):
            out["commit"] = sha
            st = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                                capture_output=True, text=True, timeout=10, check=False)
            out["dirty"] = bool(st.stdout.strip()) if st.returncode == 0 else None
    except Exception:
        pass
    return out


def versions() -> dict:
    """Python and package versions (None for a package that is not installed) and the commit."""
    from importlib import metadata

    v = {"python": platform.python_version()}
    for name in ("jvllm", "jax", "jaxlib", "flax", "transformers", "numpy", "torch"):
        try:
            v[name] = metadata.version(name)
        except Exception:
            v[name] = None
    v["jvllm_git"] = git_commit()
    return v


def device_info() -> dict:
    """The first device's platform and kind, device and process counts, and the host. Initializes
    the JAX backend: claim device memory before calling it."""
    import jax

    devs = jax.devices()
    d = devs[0]
    return dict(platform=d.platform, device_kind=getattr(d, "device_kind", None), count=len(devs),
                process_count=jax.process_count(), local_count=jax.local_device_count(),
                backend=jax.default_backend(), host=platform.node(), host_cpus=os.cpu_count(),
                machine=platform.machine())
