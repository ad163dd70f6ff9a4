"""A sender per colocated node on GPUs (`sync/nodes.py`): two "nodes" of one GPU each (a torchrun
agent per node, each seeing its own GPU as cuda:0), a Megatron actor in PP 2; rank 0 broadcasts
the buckets from its CUDA device to node 1's sender over NCCL, which copies them into its node's
/dev/shm. The same checks as the CPU test (tests/integration/test_node_senders.py): bit-identical
weights from each node's own segments, a restart, a failing sender, nothing left behind."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatron_rl.weights.tiny import build_tiny_hf_checkpoint
from tests.helpers.models import TINY_MOE
from tests.integration.test_node_senders import check
from tests.mp.launch import torchrun_nodes

pytestmark = pytest.mark.gpu


def test_node_senders_broadcast_from_cuda_over_nccl(tmp_path: Path) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("two GPUs: NCCL refuses two ranks on one device")
    model = build_tiny_hf_checkpoint(TINY_MOE, tmp_path / "model", seed=3)
    out = tmp_path / "result.json"
    torchrun_nodes("node_sender_worker.py", str(model), str(out), nnodes=2, nproc=1, cuda=True)
    r = json.loads(out.read_text())
    assert r["senders"] == [0, 1] and r["device"] == "cuda:0"
    check(r)
