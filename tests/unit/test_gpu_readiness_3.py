"""Audit 3's GPU findings whose logic runs on the CPU (../shared/notes/gpu-readiness-audit-3.md):
the GPU tests' inputs on the model's device and their TF32 switch, the image self-test's order,
and the weight transports' early failures."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


class _DeviceStrictModel(torch.nn.Module):
    """GPTModel's call signature with CUDA's rule: inputs on another device than the weights raise
    (the meta device stands in for the GPU; F.embedding on meta accepts anything)."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = torch.nn.Parameter(torch.zeros(8, 4, device="meta"))
        self.embedding.main_grad = torch.zeros(8, 4, device="meta")   # type: ignore[attr-defined]

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, mask: Any) -> torch.Tensor:
        for t in (tokens, positions):
            if t.device != self.embedding.device:
                raise RuntimeError(f"Expected all tensors to be on the same device, got {t.device} "
                                   f"and {self.embedding.device}")
        return self.embedding[tokens] + positions[..., None]


def test_memory_options_worker_feeds_the_model_on_its_own_device() -> None:
    """Audit 3 #1: tests/gpu/test_cpu_offload.py's worker built its tokens on the host and fed them
    to the CUDA GPTModel, so the first option set crashed before the offloaded optimizer stepped."""
    sys.path.insert(0, str(REPO / "tests" / "mp"))
    try:
        from tests.mp.memory_options_worker import saved_activation_bytes
    finally:
        sys.path.remove(str(REPO / "tests" / "mp"))
    tokens = torch.randint(0, 8, (2, 5))                 # the worker's batch: on the host
    nbytes, grads = saved_activation_bytes(_DeviceStrictModel(), tokens)
    assert isinstance(nbytes, int)                      # meta storages have no address to count
    assert set(grads) == {"embedding"} and grads["embedding"].device.type == "meta"


def test_gpu_tests_switch_tf32_off_and_say_so() -> None:
    """Audit 3 #2: under the NGC base's TF32 override the fp32 GPU bounds fail; tests/gpu/conftest.py
    turns both switches off for the run and its children and names what it found."""
    from tests.gpu.conftest import TF32_OFF, tf32_off

    ngc = {"TORCH_ALLOW_TF32_CUBLAS_OVERRIDE": "1", "PATH": "/usr/bin"}
    header = tf32_off(ngc)
    assert ngc == {**TF32_OFF, "PATH": "/usr/bin"}
    assert "TF32 off" in header and "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE was '1'" in header
    assert "was" not in tf32_off({})
    # torch reads the override as a boolean: "0" must be one of its false spellings.
    assert TF32_OFF["TORCH_ALLOW_TF32_CUBLAS_OVERRIDE"] in ("0", "OFF", "NO", "FALSE", "N")
