"""The stream of `sync/network.py` over real gloo: trainer rank 0 here, two rollout nodes'
receivers on threads, each with a directory standing for its node's /dev/shm, and a recording
server per node that decodes what its manifest names (the `mrl_shm` engine's own decoder). A
receiver that cannot write is named on rank 0, keeps the stream going, and the next sync lands on
both; closing the group ends the receivers and removes their copies."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from megatron_rl.ports import free_port
from megatron_rl.sync.network import CopyGroup, CopyGroupAddress, NetworkCopyTransport, NodeCopyReceiver
from tests.helpers.recording_server import Server

BUCKET = 4 << 10


def weights(version: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(version)
    return {"embed": torch.randn(64, 32, generator=g),                      # 8 KiB: alone
            **{f"layer{i}.w": torch.randn(16, 16, generator=g).to(torch.bfloat16) for i in range(6)},
            "norm": torch.randn(32, generator=g)}


def test_each_node_gets_its_copy_and_a_failing_one_is_named(tmp_path: Path) -> None:
    address = CopyGroupAddress("127.0.0.1", free_port("127.0.0.1"), 3, 30.0)
    receivers: dict[int, NodeCopyReceiver] = {}
    errors: list[BaseException] = []

    def receive(rank: int) -> None:
        try:
            (tmp_path / f"node{rank}").mkdir()
            receivers[rank] = NodeCopyReceiver(CopyGroup(address, rank), BUCKET, tmp_path / f"node{rank}")
            receivers[rank].serve()
        except BaseException as exc:   # noqa: BLE001 -- the test asserts there was none
            errors.append(exc)

    threads = [threading.Thread(target=receive, args=(k,), daemon=True) for k in (1, 2)]
    for t in threads:
        t.start()
    servers = [Server("node1"), Server("node2")]
    transport = NetworkCopyTransport(servers, CopyGroup(address, 0), segment_bytes=BUCKET)

    def sync(version: int) -> dict[str, torch.Tensor]:
        sent = weights(version)
        transport.begin(version)
        transport.send_bucket(dict(list(sent.items())[:4]))
        transport.send_bucket(dict(list(sent.items())[4:]))
        transport.finish(list(sent))
        return sent

    try:
        sent = sync(1)
        for k, server in enumerate(servers, start=1):
            assert server.version == 1 and sorted(server.loaded) == sorted(sent)
            assert all(server.loaded[n].dtype == t.dtype and torch.equal(server.loaded[n], t) for n, t in sent.items())
            assert all(Path(p).parent.parent == tmp_path / f"node{k}" for p in server.segments)
        assert transport.buckets >= 2
        # Node 2's /dev/shm is full at version 2: named on rank 0; the other node's copy went on.
        failing = receivers[2].writer

        def full(tensors: dict[str, torch.Tensor]) -> None:
            raise OSError(28, "No space left on device (simulated)")

        failing.send_bucket = full              # type: ignore[method-assign]
        with pytest.raises(RuntimeError, match=r"rollout node 1 \(receiver pid \d+\): OSError.*No space left"):
            sync(2)
        assert servers[1].version == 1                             # never told to load a broken copy
        with pytest.raises(RuntimeError, match="partly overwritten"):
            transport.links[1].resend_latest()
        del failing.send_bucket
        sent = sync(3)                                             # the stream is intact: both land
        assert [s.version for s in servers] == [3, 3]
        assert all(torch.equal(servers[1].loaded[n], t) for n, t in sent.items())
        servers[0].loaded = {}                                     # node 1's server restarted
        assert transport.links[0].resend_latest() is not None and torch.equal(servers[0].loaded["embed"],
                                                                             sent["embed"])
    finally:
        transport.close()
        for t in threads:
            t.join(timeout=30)
    assert not errors and not any(t.is_alive() for t in threads), errors
    assert not list((tmp_path / "node1").iterdir()) and not list((tmp_path / "node2").iterdir())
