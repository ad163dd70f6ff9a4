"""A sender per colocated node (`sync/nodes.py`): two torchrun agents as two "nodes" (--nnodes 2,
2 gloo ranks each), a real Megatron actor in TP 2 × PP 2 (stage 1 on node 1), one recording server
per node. Each node's server loads, bit for bit, what rank 0 gathered, from files its own node's
sender (LOCAL_RANK 0) wrote and maps; a restarted server is brought back from its node's copy; a
sender that cannot write makes both senders raise (nobody hangs) and the next sync goes through; a
failed verification's diagnosis re-sends through every node's sender;
nothing is left in /dev/shm."""

from __future__ import annotations

import json
from pathlib import Path

from megatron_rl.rollout.shm import SHM, SYNC_PREFIX
from megatron_rl.weights.tiny import build_tiny_hf_checkpoint
from tests.helpers.models import TINY_MOE
from tests.mp.launch import torchrun_nodes


def test_each_node_loads_rank0s_weights_from_its_own_senders_segments(tmp_path: Path) -> None:
    model = build_tiny_hf_checkpoint(TINY_MOE, tmp_path / "model", seed=3)
    out = tmp_path / "result.json"
    torchrun_nodes("node_sender_worker.py", str(model), str(out), nnodes=2, nproc=2)
    r = json.loads(out.read_text())
    assert r["senders"] == [0, 2] and r["device"] == "cpu"         # each node's LOCAL_RANK 0
    check(r)


def check(r: dict) -> None:
    """What the worker found, on CPU and on GPUs (tests/gpu/test_node_senders_gpu.py)."""
    for version in ("1", "2", "4"):
        s = r["syncs"][version]
        assert s["error"] is None and s["versions"] == [int(version)] * 2, (version, s)
        assert s["server"]["servers"] == 2 and s["server"]["senders"] == 2
        assert s["identical"] == [True, True], version              # bit for bit rank 0's weights
        assert s["writer_pid"] == [True, True] and s["mapped_by_writer"] == [True, True], version
        assert s["mapped_by_rank0"] == [True, False], version       # rank 0 never maps node 1's copy
        assert s["files_equal"] and all(s["files_equal"]), version  # the same layout on both nodes
        assert s["server"]["buckets"] > 1, s["server"]
        # fp32: the 128 KiB embedding and output exceed the 64 KiB bucket and go alone (bf16: they fit)
        assert s["server"]["alone"] == (2 if version != "2" else 0), s["server"]
    assert r["resend"]["version"] == 2
    assert all(p.startswith(f"{SHM}/{SYNC_PREFIX}{r['pids'][1]}-") for p in r["resend"]["segments_node1"])
    # Node 1's sender failed to write version 3: both senders raised, with the cause, at the same point.
    assert r["failed_on"] == r["senders"]
    assert f"node 1 (rank {r['senders'][1]}): OSError" in r["failed_message"], r["failed_message"]
    assert "No space left" in r["failed_message"]
    assert "partly overwritten" in r["resend_after_failure"]      # node 1 holds no complete copy now
    assert r["diagnosis"]["same_on_every_rank"] and r["diagnosis"]["versions"] == [5, 5], r["diagnosis"]
    assert "that the 2 vLLM workers received match what the trainer sent" in r["diagnosis"]["message"], r["diagnosis"]
    assert r["left_in_shm"] == []
    assert not [p for pid in r["pids"] for p in SHM.glob(f"{SYNC_PREFIX}{pid}-*")]
