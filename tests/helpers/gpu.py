"""What the GPU tests need besides CUDA, each skipped with a reason that names it (a bare CUDA box
with torch and megatron-core runs what it can: `tools/gpu_first_hour.sh`)."""

from __future__ import annotations

import importlib.util

import pytest

PACKAGES = {"vllm": "vLLM", "transformer_engine": "Transformer Engine", "fla": "flash-linear-attention (fla)",
            "torchao": "torchao"}


def missing(*modules: str) -> list[str]:
    """The packages among `modules` (import names, keys of PACKAGES) that are not installed."""
    return [PACKAGES.get(m, m) for m in modules if importlib.util.find_spec(m) is None]


def require(*modules: str, why: str = "") -> None:
    """Skip the calling test unless every package is installed, naming the absent ones."""
    absent = missing(*modules)
    if absent:
        pytest.skip(f"needs {' and '.join(absent)} (not installed){': ' + why if why else ''}")
