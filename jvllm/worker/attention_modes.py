"""attention_backend -> the attention mode of each step variant (see LlamaForCausalLM.__call__):
(decode-only steps, mixed / prefill steps). "auto" is "ragged" on GPUs (jvllm's ragged kernel,
the fastest measured there: README.md, "Measured so far") and "xla" elsewhere."""
from __future__ import annotations

ATTENTION_MODES = {"xla": ("xla", "xla"), "pallas": ("pallas", "ragged"), "pallas_decode": ("pallas", "xla"),
                   "ragged": ("ragged", "ragged"), "ragged_split": ("ragged_split", "ragged")}


def attention_modes(backend: str, platform: str | None = None) -> tuple[str, dict[bool, str]]:
    """attention_backend -> (the backend, {decode-only step?: attention mode}). `platform`: the
    default backend (asked from jax when None and needed). Raises ValueError naming the accepted values."""
    if backend == "auto":
        if platform is None:
            import jax

            platform = jax.default_backend()
        backend = "ragged" if platform == "gpu" else "xla"
    base = backend.removesuffix("_interpret")
    if base not in ATTENTION_MODES:
        raise ValueError(f"attention_backend must be auto or one of {', '.join(ATTENTION_MODES)} (optionally "
                         f"with _interpret), got {backend!r}")
    suffix = "_interpret" if backend.endswith("_interpret") else ""
    return backend, {dec: (m if m == "xla" else m + suffix) for dec, m in zip((True, False), ATTENTION_MODES[base])}
