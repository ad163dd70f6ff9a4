"""A real vLLM server on the GPU takes the trainer's weights (file transport, layer-wise reload
on CUDA): after a training step it is stale, after the sync its log-probs equal the trainer's, and
a corrupted tensor shows. fp32 on both sides, TF32 off for the run and the server (tests/gpu/conftest.py:
TE asks cuBLASLt for TF32 on fp32 GEMMs whatever torch's flags say; NVIDIA_TF32_OVERRIDE=0 overrides
that too); 2e-3 is then fp32 round-off with a wide margin at the tiny model's logits of order 1."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.gpu import require
from tests.helpers.models import TINY_MOE
from tests.helpers.rollout import start_server, tiny_model_with_tokenizer
from tests.mp.launch import torchrun

pytestmark = pytest.mark.gpu
TOLERANCE = 2e-3


def test_cuda_server_reloads_synced_weights(tmp_path: Path) -> None:
    require("vllm", why="a vLLM server on the GPU")
    model = tiny_model_with_tokenizer(TINY_MOE, tmp_path / "model", seed=4)
    server = start_server(model, tmp_path / "run", gpu_memory_utilization=0.3)
    try:
        out = tmp_path / "sync.json"
        torchrun("sync_worker.py", str(model), server.base_url, str(server.rollout_dir / "token"), "tp1", str(out),
                 nproc=1, cuda=True)
    finally:
        server.stop()
    r = json.loads(out.read_text())["tp1"]
    for attempt in ("first", "second"):
        assert r[f"{attempt}_before_sync"] > 10 * TOLERANCE, (attempt, r)
        assert r[f"{attempt}_after_sync"] <= TOLERANCE, (attempt, r)
    assert r["corrupted_after_sync"] > 10 * TOLERANCE, r
    # The CPU grouped-GEMM repack is CPU-only: GPU workers reload layer-wise (rollout/worker_ext.py).
    assert r["first_server"]["moe_layers_repacked"] == 0
