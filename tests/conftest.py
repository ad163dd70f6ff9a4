"""Shared pytest set-up: GPU tests are skipped (with the reason) when CUDA is absent."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from megatron_rl.console import KNOWN_WARNINGS, quiet_third_party

REPO_ROOT = Path(__file__).resolve().parents[1]

# Two cores: keep each test process from oversubscribing them.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def pytest_configure(config: pytest.Config) -> None:
    """Hide the known third-party warnings the CLI hides (megatron-core imported in-process); ours
    still show. pytest resets `warnings` filters around collection and each test, so they go in
    as `filterwarnings` lines."""
    quiet_third_party()
    for category, message, module in KNOWN_WARNINGS:
        config.addinivalue_line("filterwarnings", f"ignore:{message}:{category.__name__}:{module}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _cuda_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA (no GPU on this machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
