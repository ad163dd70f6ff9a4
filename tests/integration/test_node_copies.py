"""Disaggregated rollout without the shared file system (`sync/network.py`): this process is
trainer rank 0, a receiver process stands for a rollout node, a directory of its own for that
node's /dev/shm. Each version arrives there over gloo and the shared server (the rollout node's
server) loads it from there bit for bit, with no run dir at all; a restarted server is brought
back from that node's copy; a receiver that dies fails the next sync at once, naming it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from megatron_rl.ports import free_port
from megatron_rl.rollout.server import RolloutServer
from megatron_rl.sync.network import CopyGroup, CopyGroupAddress, NetworkCopyTransport
from tests.helpers.owner_sync import owner_sync
from tests.helpers.rollout import REPO, demo_assets

RECEIVER = """
import sys
from pathlib import Path
from megatron_rl.sync.network import CopyGroupAddress, serve_node_copy
serve_node_copy(CopyGroupAddress("127.0.0.1", int(sys.argv[1]), 2, 60.0), 1, 64 << 10, Path(sys.argv[2]))
"""


def test_a_rollout_nodes_copy_arrives_over_gloo_into_its_shm(demo_weights_server: RolloutServer,
                                                              tmp_path: Path) -> None:
    from megatron_rl.rollout.engines.digest import tensor_digest
    from megatron_rl.sync.diagnose import compare
    from megatron_rl.weights.hf_io import HFCheckpointReader

    server = demo_weights_server
    node_shm = tmp_path / "node1-dev-shm"
    node_shm.mkdir()
    port = free_port("127.0.0.1")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    receiver = subprocess.Popen([sys.executable, "-c", RECEIVER, str(port), str(node_shm)], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    reader = HFCheckpointReader(demo_assets()["model"])
    names = sorted(reader.names())
    v1 = {n: reader.get(n) for n in names}
    g = torch.Generator().manual_seed(5)
    v2 = {n: x + 1e-3 * torch.randn(x.shape, generator=g, dtype=x.dtype) for n, x in v1.items()}

    def sync(version: int, state: dict[str, torch.Tensor]) -> dict:
        server.rpc("mrl_digest_arm")
        # Two parts, as the gather hands them over; this rank owns (and compares) every tensor.
        report = owner_sync(transport, version, state, torch.float32, per_part=len(names) // 2 + 1)
        assert report["version"] == version and (report["buckets"] > 10 or not transport.stats.dense), report
        return compare({n: tensor_digest(x) for n, x in state.items()},
                       [(server.base_url, server.rpc("mrl_digests"))]).differ

    transport = NetworkCopyTransport([server], CopyGroup(CopyGroupAddress("127.0.0.1", port, 2, 60.0), 0),
                                     segment_bytes=64 << 10,   # the 128 KiB embeddings go alone
                                     delta="auto")
    try:
        assert sync(3_000_001, v1) == {}
        # A sparse delta round, then one where every element moved (each tensor's patch whole): the
        # server applies its node's patch files through vLLM's own patch loader.
        sparse = {n: x.clone() for n, x in v1.items()}
        for n in names[:3]:
            sparse[n].view(-1)[::97] += 0.01                      # ~1 % of three tensors' elements
        assert sync(3_000_002, sparse) == {}
        assert not transport.stats.dense and transport.stats.report()["changed_frac"] < 0.01
        assert sync(3_000_003, v2) == {}                          # the new weights
        assert not transport.stats.dense                          # whole patches, each
        assert transport.stats.bytes == sum(x.nbytes for x in v2.values())
        link = transport.links[0]
        assert link.latest is not None
        segments = [p for p, _ in json.loads(link.latest[1])["segments"]]
        assert segments and all(Path(p).parent.parent == node_shm for p in segments), segments
        maps = Path("/proc/self/maps").read_text()
        assert not any(p in maps for p in segments)               # rank 0 never touched that node's copy
        # The server restarted: brought back from its node's copy, which the receiver holds.
        server.rpc("mrl_digest_arm")
        again = link.resend_latest()
        assert again is not None and again["version"] == 3_000_003
        assert compare({n: tensor_digest(x) for n, x in v2.items()},
                       [(server.base_url, server.rpc("mrl_digests"))]).differ == {}
        # A receiver that dies alone: the next sync fails at once, naming what failed.
        receiver.kill()
        receiver.wait()
        start = time.monotonic()
        try:
            sync(3_000_004, v1)
            raise AssertionError("a sync to a dead receiver went through")
        except RuntimeError as exc:
            assert "receivers (1) failed at version 3000004" in str(exc), exc
        assert time.monotonic() - start < 30
    finally:
        transport.close()                  # also after the receiver died: rank 0's patch files go
        if receiver.poll() is None:
            receiver.wait(timeout=30)
        out = receiver.stdout.read() if receiver.stdout else ""
    assert receiver.returncode != 0, out                        # it was killed, not closed
    assert transport.patches is not None and not transport.patches.dir.exists()   # rank 0's patch files went
