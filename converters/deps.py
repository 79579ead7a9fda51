"""Optional dependencies, checked where they are needed, each with one line that says how to get it.

PyTorch is needed only to read PyTorch checkpoints (.bin/.pt) and for transformers' reference
models (`jvllm verify`, the HF comparisons in tests and benchmarks); everything else, including the
built-in GGUF models, runs without it. `MissingDependencyError` is an ImportError whose message is
that one line; the CLI prints it without a traceback.
"""
from __future__ import annotations

TORCH_PIN = "torch==2.13.0"  # the CPU wheel; an unpinned torch pulls a multi-GB CUDA build


class MissingDependencyError(ImportError):
    """An optional package a requested feature needs is not installed (the message says which
    feature, which package and the pip command)."""


def require_torch(purpose: str):
    """Import and return torch, or raise MissingDependencyError: "<purpose> needs PyTorch: pip
    install torch==2.13.0"."""
    try:
        import torch
    except ImportError:
        raise MissingDependencyError(f"{purpose} needs PyTorch: pip install {TORCH_PIN}") from None
    return torch
