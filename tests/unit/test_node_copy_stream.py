"""The stream of `sync/network.py` over real gloo: trainer rank 0 here, two rollout nodes'
receivers on threads, each with a directory standing for its node's /dev/shm, and a recording
server per node that decodes what its manifest names (the `mrl_shm` engine's own decoder). A
receiver that cannot write is named on rank 0, keeps the stream going, and the next sync lands on
both; closing the group ends the receivers and removes their copies."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch

from megatron_rl.ports import free_port
from megatron_rl.sync.network import (
    CopyGroup,
    CopyGroupAddress,
    NetworkCopyTransport,
    NodeCopyReceiver,
    nccl_hosts_problem,
)
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


def _receivers(tmp_path: Path, address: CopyGroupAddress, ranks: tuple[int, ...],
               errors: list[BaseException]) -> tuple[dict[int, NodeCopyReceiver], list[threading.Thread]]:
    receivers: dict[int, NodeCopyReceiver] = {}

    def receive(rank: int) -> None:
        try:
            (tmp_path / f"node{rank}").mkdir()
            receivers[rank] = NodeCopyReceiver(CopyGroup(address, rank), BUCKET, tmp_path / f"node{rank}")
            receivers[rank].serve()
        except BaseException as exc:   # noqa: BLE001 -- the test asserts there was none
            errors.append(exc)

    threads = [threading.Thread(target=receive, args=(k,), daemon=True) for k in ranks]
    for t in threads:
        t.start()
    return receivers, threads


def test_delta_rounds_send_the_patches_to_every_node_whose_copy_then_holds_the_new_version(tmp_path: Path) -> None:
    """`rollout.sync_delta` over the network: the owner compares with its own host copy (here one
    rank owning every tensor), only the patches go, every server loads its node's previous
    version with them, and every node's copy is then the new version byte for byte (what a
    restarted server is brought back from)."""
    from megatron_rl.rollout.engines.loaded import views
    from tests.helpers.owner_sync import owner_sync
    from tests.unit.test_sync_delta import _digests, _model, _step
    from tests.unit.test_sync_shm import EngineRecorder

    address = CopyGroupAddress("127.0.0.1", free_port("127.0.0.1"), 3, 30.0)
    errors: list[BaseException] = []
    receivers, threads = _receivers(tmp_path, address, (1, 2), errors)
    servers = [EngineRecorder("node1"), EngineRecorder("node2")]
    transport = NetworkCopyTransport(servers, CopyGroup(address, 0), segment_bytes=BUCKET, delta="auto",
                                     dense_every=10)

    def sync(version: int, state: dict[str, torch.Tensor], only: set[str] | None = None) -> None:
        owner_sync(transport, version, state, torch.bfloat16, only)

    def node_copy(k: int) -> dict[str, torch.Tensor]:
        latest = transport.copies[k].latest
        assert latest is not None
        spec = json.loads(latest[1])
        files = [torch.frombuffer(bytearray(Path(p).read_bytes()[:size]), dtype=torch.uint8)
                 for p, size in spec["segments"]]
        return dict(views(spec["tensors"], files))

    try:
        v1 = _model(0)
        sync(1, v1)
        assert transport.stats.dense
        dense_bytes = transport.stats.bytes
        v2 = _step(v1, 0.03, 1)
        buckets_dense = transport.buckets
        sync(2, v2)
        stats = transport.stats
        assert not stats.dense and stats.bytes <= 0.10 * dense_bytes, (stats.bytes, dense_bytes)
        frac = sum(int((v2[n].view(torch.int16) != v1[n].view(torch.int16)).sum()) for n in v1) / \
            sum(x.numel() for x in v1.values())
        assert stats.report()["changed_frac"] == pytest.approx(frac) and 0 < frac < 0.05
        assert transport.buckets < buckets_dense                      # the patch files, not the tensors
        for k, server in enumerate(servers):
            assert server.patched == 4 and server.version == 2        # the norm did not change
            assert _digests(server.loaded) == _digests(v2)            # every tensor, bit for bit
            assert all(Path(p).parent.parent == tmp_path / f"node{k + 1}" for p, _ in server.manifests[-1]["segments"])
            assert _digests(node_copy(k)) == _digests(v2)             # the node's copy took the patches
        assert transport.copies[0].latest is not None and transport.copies[0].latest[0] == 2
        servers[1].restarts += 1                                      # restarted: its node's copy, whole
        assert transport.links[1].resend_latest() is not None and servers[1].patched == 0
        assert _digests(servers[1].loaded) == _digests(v2)
        # Another set of tensors than the last round's (LoRA's first adapted-only sync): whole.
        v3 = {n: t for n, t in _step(v2, 0.03, 2).items() if n != "model.norm.weight"}
        sync(3, v3, only=set(v3))
        assert transport.stats.dense and all(_digests(s.loaded) == _digests(v3) for s in servers)
        assert all(_digests(node_copy(k)) == _digests(v3) for k in range(2))
        # A node whose patch files cannot be written is named; the next round is whole and lands.
        v4 = _step(v3, 0.03, 3)
        sync(4, v4, only=set(v4))
        assert not transport.stats.dense
        failing = receivers[2].patches
        assert failing is not None

        def full(*args: object) -> None:
            raise OSError(28, "No space left on device (simulated)")

        failing.put = full                                            # type: ignore[method-assign]
        v5 = _step(v4, 0.03, 4)
        with pytest.raises(RuntimeError, match=r"rollout node 1 \(receiver pid \d+\): OSError.*No space left"):
            sync(5, v5, only=set(v5))
        assert servers[1].version == 4
        del failing.put
        sync(6, v5, only=set(v5))
        assert transport.stats.dense and all(_digests(s.loaded) == _digests(v5) for s in servers)
        sync(7, _step(v5, 0.03, 5), only=set(v5))
        assert not transport.stats.dense
    finally:
        transport.close()
        for t in threads:
            t.join(timeout=30)
    assert not errors and not any(t.is_alive() for t in threads), errors


def test_an_nccl_group_refuses_two_members_on_one_host() -> None:
    """Each member is on its host's GPU 0: NCCL refuses two of them on one host at init, so the
    trainer names the nodes before it opens the group."""
    assert nccl_hosts_problem("train-0", ["roll-0", "roll-1"]) is None
    assert "rollout node 1 runs on the trainer's host 'train-0'" in nccl_hosts_problem("train-0", ["roll-0", "train-0"])
    assert "rollout nodes 0 and 2 both run on host 'roll-0'" in nccl_hosts_problem("t", ["roll-0", "roll-1", "roll-0"])


def test_a_disabled_nccl_communicator_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's PyNcclCommunicator without libnccl (or with VLLM_DISABLE_PYNCCL) makes every
    broadcast a no-op that returns: the receivers would keep their old bytes. Refused at the join."""
    import contextlib
    import types

    import vllm.distributed.weight_transfer.nccl_common as common

    from megatron_rl.rollout import nccl_sender

    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    for disabled in (True, False):
        comm = types.SimpleNamespace(disabled=disabled)
        monkeypatch.setattr(common, "stateless_init_process_group", lambda *args, comm=comm: comm)
        if disabled:
            with pytest.raises(RuntimeError, match="PyNcclCommunicator is disabled"):
                nccl_sender.open_member("127.0.0.1", 1, 1, 2, torch.device("cuda", 0))
        else:
            assert nccl_sender.open_member("127.0.0.1", 1, 1, 2, torch.device("cuda", 0)) is comm


def test_nccl_unusable_says_why_before_any_member_joins(monkeypatch: pytest.MonkeyPatch) -> None:
    """What would make vLLM's communicator come up disabled, checked the way its constructor does:
    here (no GPU build of libnccl) the library does not load; with VLLM_DISABLE_PYNCCL that is said."""
    from megatron_rl.rollout.nccl_sender import nccl_unusable

    monkeypatch.setenv("VLLM_DISABLE_PYNCCL", "1")
    assert nccl_unusable() == "VLLM_DISABLE_PYNCCL is set"
    monkeypatch.setenv("VLLM_DISABLE_PYNCCL", "0")
    monkeypatch.setenv("VLLM_NCCL_SO_PATH", "/nonexistent/libnccl.so.2")
    assert "libnccl did not load" in (nccl_unusable() or "")


def test_a_member_whose_nccl_would_be_disabled_stops_every_member_at_the_join(monkeypatch: pytest.MonkeyPatch) -> None:
    """Receiver 1 (a thread here) has no usable NCCL: it would never reach ncclCommInitRank, where
    the others would wait with no deadline. Every member says first over gloo, so both ends raise at
    once, naming it, and nobody opens a communicator."""
    from megatron_rl.rollout import nccl_sender

    monkeypatch.setattr(nccl_sender, "nccl_unusable",
                        lambda: "libnccl did not load" if threading.current_thread().name == "member1" else None)
    monkeypatch.setattr(nccl_sender, "open_member", lambda *a: pytest.fail("no member may open NCCL"))
    address = CopyGroupAddress("127.0.0.1", free_port("127.0.0.1"), 2, timeout_s=30.0, nccl_port=1)
    errors: dict[int, BaseException] = {}

    def join(rank: int) -> None:
        try:
            CopyGroup(address, rank, torch.device("cuda", 0))
        except RuntimeError as exc:
            errors[rank] = exc

    member = threading.Thread(target=join, args=(1,), name="member1", daemon=True)
    member.start()
    join(0)
    member.join(timeout=30)
    assert sorted(errors) == [0, 1]
    for exc in errors.values():
        assert "NCCL cannot form: the receiver of rollout node 0: libnccl did not load" in str(exc)
