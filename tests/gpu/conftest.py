"""The GPU tests compute in IEEE fp32 where they say fp32: TF32 off, in this process and every child.

NGC's PyTorch bases (the image's `From:`) set `TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1`, which turns
every fp32 cuBLAS GEMM into TF32 (10 mantissa bits, ~5e-4 relative) whatever torch's flags say;
the fp32 bounds here (1e-4 of the logits' spread against float64, 2e-3 after a weight sync) are
fp32 round-off bounds and would fail or sit at their margin (audit 3 #2). So, before any test
starts CUDA: torch's override off, and NVIDIA's library-wide switch off (cuBLAS, cuBLASLt — TE's
fp32 GEMMs — and cuDNN read it), so torchrun workers and vLLM servers, which inherit this
environment, run fp32 too. Both are read once per process, at its first GEMM: setting them here,
at collection, is early enough for this process; children read them at their start.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

import pytest

TF32_OFF = {"TORCH_ALLOW_TF32_CUBLAS_OVERRIDE": "0", "NVIDIA_TF32_OVERRIDE": "0"}


def tf32_off(environ: MutableMapping[str, str]) -> str:
    """Switch TF32 off in `environ` (os.environ here); the line the run's header shows."""
    before = {k: environ.get(k) for k in TF32_OFF}
    environ.update(TF32_OFF)
    was = ", ".join(f"{k} was {v!r}" for k, v in before.items() if v not in (None, TF32_OFF[k]))
    return ("GPU tests: TF32 off (" + ", ".join(f"{k}={v}" for k, v in TF32_OFF.items())
            + ", torch.backends.cuda.matmul/cudnn.allow_tf32=False)" + (f"; {was}" if was else ""))


KEEP_TF32_ENV = "MEGATRON_RL_GPU_TESTS_KEEP_TF32"
"""Set to 1 to leave TF32 as the environment has it (tools/gpu_first_hour.sh measures finding 2 so)."""
KEEP = os.environ.get(KEEP_TF32_ENV) == "1"
HEADER = f"GPU tests: TF32 left as the environment sets it ({KEEP_TF32_ENV}=1)" if KEEP else tf32_off(os.environ)


def pytest_configure(config: pytest.Config) -> None:
    import torch

    if not KEEP:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False


def pytest_report_header(config: pytest.Config) -> str:
    return HEADER
