"""What `convert_to_orbax` did, as a typed value with a readable table (`jvllm convert` prints it)."""
from __future__ import annotations

import dataclasses
import os


@dataclasses.dataclass(frozen=True)
class ConvertReport:
    src: str             # the model argument as given
    src_path: str        # the checkpoint it resolved to
    src_kind: str        # hf | gguf | orbax | random
    dst: str
    dtype: str
    num_tensors: int
    num_params: int      # parameter values written
    load_s: float        # reading + converting the source
    save_s: float        # writing the Orbax folder, config and tokenizer
    has_tokenizer: bool

    def table(self, reload_s: float | None = None) -> str:
        rows = [("source", f"{self.src_path} ({self.src_kind})"), ("destination", self.dst),
                ("dtype", self.dtype), ("tensors", f"{self.num_tensors:,}"),
                ("parameters", f"{self.num_params:,}"), ("size on disk", _size(self.dst)),
                ("tokenizer", "saved" if self.has_tokenizer else "none in the source"),
                ("read + convert", f"{self.load_s:.1f} s"), ("write", f"{self.save_s:.1f} s")]
        if reload_s is not None:
            rows.append(("reload check", f"{reload_s:.1f} s"))
        w = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{w}}  {v}" for k, v in rows)


def _size(path: str) -> str:
    n = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)
    return f"{n / 2**20:,.1f} MiB"
