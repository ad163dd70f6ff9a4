"""On GPUs: every torchrun rank builds on its own device (LOCAL_RANK), the NCCL world group runs
the trainer's control collectives, and a Megatron actor's log-probs and training step run with
every parameter and batch tensor on that device (audit #1, #2, #3, #8)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers.models import TINY_MOE
from tests.helpers.rollout import tiny_model_with_tokenizer
from tests.mp.launch import torchrun

pytestmark = pytest.mark.gpu


def test_each_rank_on_its_gpu_with_nccl_collectives_and_a_megatron_step(tmp_path: Path) -> None:
    nproc = min(2, torch.cuda.device_count())       # 2 ranks = TP 2 + SP; 1 GPU: TP 1
    model = tiny_model_with_tokenizer(TINY_MOE, tmp_path / "model", seed=2)
    out = tmp_path / "out"
    out.mkdir()
    torchrun("gpu_worker.py", str(model), str(out), nproc=nproc, cuda=True)
    results = [json.loads((out / f"{r}.json").read_text()) for r in range(nproc)]
    for r in results:
        # The world group is `cpu:gloo,cuda:nccl` (megatron/devices.py): CUDA tensors go over NCCL.
        assert "cuda:nccl" in r["backend"].split(","), r
        assert r["current_device"] == r["local_rank"], r                 # not every rank on cuda:0
        assert r["param_devices"] == [f"cuda:{r['local_rank']}"], r
        assert r["stop_seen"], r                                           # rank 0's stop reached all
        assert r["logprobs_finite"] and r["step_finite"], r
