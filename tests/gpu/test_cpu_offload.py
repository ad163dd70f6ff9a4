"""megatron-core's HybridDeviceOptimizer (Adam on the host, the 235B recipes' optimizer offload) on a GPU."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.models import _memory_options


@pytest.mark.gpu
def test_cpu_offload_trains_like_the_gpu_optimizer(tiny_moe: Path, tmp_path: Path) -> None:
    """HybridDeviceOptimizer steps only with parameters on a GPU: Adam on the host gives the same
    bf16 weights as Adam on the device, to bf16 rounding."""
    r = _memory_options(tiny_moe, tmp_path / "memory.json", nproc=1, cuda=True)   # CPU workers hide CUDA
    assert r["cpu_offload_bf16"]["built"]["inner_optimizers"] == ["HybridDeviceOptimizer"]
    assert r["cpu_offload_bf16"]["losses"] == pytest.approx(r["default_bf16"]["losses"], rel=1e-2)
    assert r["cpu_offload_bf16"]["max_weight_diff"] <= 1e-2
