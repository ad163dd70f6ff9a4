"""Topology as pure functions (`megatron_rl/topology.py`), over every production recipe: who joins
the `nccl` weight-transfer group on which GPU, which GPUs each data-parallel engine of a server uses
(the CUDA IPC handles it needs), who writes the `shm` segments each server reads (a sender per
colocated node) and what one sync moves per node, and where rank 0's rendezvous address comes from."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from megatron_rl.config import load_recipe
from megatron_rl.planner import count_params
from megatron_rl.planner.host import sync_bytes
from megatron_rl.slurm.render import total_nodes
from megatron_rl.sync.gpu import master_address
from megatron_rl.topology import (
    NodeSyncBytes,
    ShmSender,
    data_parallel_replicas,
    duplicate_gpus,
    engine_devices,
    ipc_devices,
    nccl_weight_group,
    recipe_shm_senders,
    server_nodes,
    shm_senders,
    sync_traffic,
)

REPO = Path(__file__).resolve().parents[2]
PRODUCTION = sorted(p for p in (REPO / "recipes").glob("qwen3_*/*.yaml") if p.name != "base.yaml")
IDS = [f"{p.parent.name}/{p.stem}" for p in PRODUCTION]


@pytest.mark.parametrize("recipe", PRODUCTION, ids=IDS)
def test_nccl_group_of_each_production_layout(recipe: Path) -> None:
    cfg = load_recipe(recipe)
    r = cfg.rollout
    members = nccl_weight_group(cfg)
    per_server = r.tensor_parallel_size * r.data_parallel_size
    servers = server_nodes(cfg)
    assert len(servers) == (cfg.parallelism.nodes if r.placement == "colocated" else r.nodes)
    assert [m.rank for m in members] == list(range(1 + len(servers) * per_server))
    assert members[0] == type(members[0])(0, 0, 0, "trainer rank 0")
    for k, node in enumerate(servers):                  # server k's workers from rank_offset 1 + k · size
        mine = members[1 + k * per_server:1 + (k + 1) * per_server]
        assert {m.node for m in mine} == {node} and [m.gpu for m in mine] == list(range(per_server))
        assert all(m.role.startswith(f"server {k} ") for m in mine)
    assert max(m.node for m in members) < total_nodes(cfg)                  # the nodes the job allocates
    assert max(m.gpu for m in members) < cfg.parallelism.gpus_per_node
    shared = duplicate_gpus(members)
    if r.placement == "colocated":
        # Only rank 0 of the trainer joins; it shares GPU 0 of node 0 with server 0's first worker.
        assert [[m.role for m in g] for g in shared] == [["trainer rank 0", "server 0 engine 0 worker 0"]]
    else:
        assert shared == []


@pytest.mark.parametrize("recipe", PRODUCTION, ids=IDS)
def test_shm_senders_of_each_production_layout(recipe: Path) -> None:
    """Every server reads segments written on its own node, by that node's LOCAL_RANK 0, unless
    it sits on a rollout node (then rank 0 writes once into the shared run directory)."""
    cfg = load_recipe(recipe)
    p, r = cfg.parallelism, cfg.rollout
    senders, nodes = recipe_shm_senders(cfg), server_nodes(cfg)
    assert sorted(k for s in senders for k in s.servers) == list(range(len(nodes)))   # each server once
    assert senders[0].rank == 0 and len({s.rank for s in senders}) == len(senders)
    for s in senders:
        assert s.rank % p.gpus_per_node == 0 and s.rank // p.gpus_per_node == s.node < p.nodes   # LOCAL_RANK 0
        assert s.rank < p.world_size
        if not s.shared:                                   # /dev/shm: only servers of its own node
            assert {nodes[k] for k in s.servers} == {s.node}
    if r.placement == "colocated" and p.nodes > 1:
        assert [s.node for s in senders] == list(range(p.nodes)) and not any(s.shared for s in senders)
    else:
        assert len(senders) == 1 and senders[0].shared == (r.placement != "colocated")


def test_shm_senders_keep_one_writer_where_one_suffices() -> None:
    assert shm_senders(True, 1, 8, 1) == [ShmSender(0, 0, (0,), False)]              # lone server: /dev/shm
    assert shm_senders(False, 2, 8, 3) == [ShmSender(0, 0, (0, 1, 2), True)]         # rollout nodes: run dir
    assert shm_senders(True, 2, 3, 2) == [ShmSender(0, 0, (0,), False), ShmSender(3, 1, (1,), False)]
    with pytest.raises(ValueError, match="one server per node"):
        shm_senders(True, 2, 8, 1)
    with pytest.raises(ValueError):
        shm_senders(True, 0, 8, 1)


QNEXT_GRPO = REPO / "recipes" / "qwen3_next_80b_a3b" / "grpo.yaml"


def _sum(rows: list[NodeSyncBytes], field: str) -> int:
    return sum(getattr(row, field) for row in rows)


def test_sync_traffic_of_the_80b_colocated_layout_before_and_after_node_senders() -> None:
    """Qwen3-Next-80B GRPO (8 nodes, a TP 2 × DP 4 server on each): one writer into the shared run
    directory (before) against a sender per node (now). The server reads are the same; what moves
    off the shared file system onto the interconnect is the update once per other node."""
    import json

    cfg = load_recipe(QNEXT_GRPO)
    hf = json.loads((REPO / "recipes" / "models" / "qwen3_next_80b_a3b" / "config.json").read_text())
    update = int(sync_bytes(count_params(hf), cfg))
    assert 158e9 < update < 162e9                           # 80B parameters in bf16
    nodes, dp = server_nodes(cfg), cfg.rollout.data_parallel_size
    before = sync_traffic([ShmSender(0, 0, tuple(range(len(nodes))), True)], nodes, update, dp)
    after = sync_traffic(recipe_shm_senders(cfg), nodes, update, dp)
    assert [row.node for row in before] == [row.node for row in after] == list(range(8))
    # Before: rank 0 writes the update into the shared FS; the 7 other nodes fetch it every step.
    assert before[0] == NodeSyncBytes(0, 0, update, 0, 0, dp * update)
    assert all(row == NodeSyncBytes(row.node, 0, 0, update, 0, dp * update) for row in before[1:])
    assert _sum(before, "fs_written") + _sum(before, "fs_fetched") == 8 * update      # ~1.28 TB through the FS
    # Now: every node writes its own /dev/shm copy; the other 7 receive rank 0's broadcast.
    assert after[0] == NodeSyncBytes(0, update, 0, 0, 0, dp * update)
    assert all(row == NodeSyncBytes(row.node, update, 0, 0, update, dp * update) for row in after[1:])
    assert _sum(after, "fs_written") + _sum(after, "fs_fetched") == 0
    assert _sum(after, "worker_reads") == _sum(before, "worker_reads") == 8 * dp * update


def test_sync_traffic_of_a_disaggregated_layout_is_the_shared_directory() -> None:
    senders = shm_senders(False, 8, 8, 4)
    rows = sync_traffic(senders, [8, 9, 10, 11], 100, 2)
    assert rows[0] == NodeSyncBytes(0, 0, 100, 0, 0, 0)                  # rank 0's node: no server
    assert rows[1:] == [NodeSyncBytes(n, 0, 0, 100, 0, 200) for n in (8, 9, 10, 11)]
    with pytest.raises(ValueError, match="exactly once"):
        sync_traffic(senders, [8, 9], 100, 2)


def test_engine_devices_follow_vllms_dp_slices() -> None:
    gpus = list(range(8))
    assert engine_devices(gpus, 4, 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]           # 235B servers: TP 4 × DP 2
    assert engine_devices(gpus, 2, 4) == [[0, 1], [2, 3], [4, 5], [6, 7]]       # 80B servers: TP 2 × DP 4
    assert engine_devices(["a", "b", "c"], 1, 2) == [["a"], ["b"]]
    with pytest.raises(ValueError, match="do not fit"):
        engine_devices(gpus, 4, 4)


@pytest.mark.parametrize("recipe", PRODUCTION, ids=IDS)
def test_ipc_handles_cover_every_engine_of_a_server(recipe: Path) -> None:
    """/collective_rpc under DP > 1 reports engine 0's GPUs only; the handles must reach all."""
    r = load_recipe(recipe).rollout
    uuids = [f"GPU-{i}" for i in range(8)]
    reported = uuids[:r.tensor_parallel_size]
    got = ipc_devices(uuids, r.tensor_parallel_size * r.data_parallel_size, reported)
    assert got == uuids[:r.tensor_parallel_size * r.data_parallel_size] and len(got) == 8
    with pytest.raises(ValueError, match="different GPUs"):
        ipc_devices(uuids, 8, uuids[1:1 + r.tensor_parallel_size])


def test_rendezvous_address_is_routed_not_the_hostname() -> None:
    assert master_address(["127.0.0.1", "localhost"]) == "127.0.0.1"
    # A remote server gets this host's address on the route to it (here a loopback alias: 127.0.0.1).
    assert master_address(["localhost", "127.0.0.2"]) == "127.0.0.1"


def _recording_transport(bucket_bytes: int) -> Any:
    """A `_GpuTransport` whose sends are recorded (the send itself needs CUDA): its real buffering."""
    import torch

    from megatron_rl.sync.gpu import _GpuTransport

    class Recording(_GpuTransport):
        def __init__(self) -> None:
            super().__init__([], torch.device("cuda", 0), bucket_bytes=bucket_bytes)
            self.buckets: list[list[str]] = []

        def _send(self, tensors: dict[str, torch.Tensor]) -> None:
            self.buckets.append(list(tensors))
            self.sent += list(tensors)

    return Recording()


def _buckets(sizes: list[int], bucket_bytes: int) -> list[list[int]]:
    """The parts (by index) of each bucket the GPU transports send, when parts of `sizes` bytes are
    handed over in order and the rest is flushed (as `finish` does). Meta tensors: no memory."""
    import torch

    t = _recording_transport(bucket_bytes)
    for i, size in enumerate(sizes):
        t.send_bucket({str(i): torch.empty(size, dtype=torch.uint8, device="meta")})
    t.flush()
    return [[int(n) for n in bucket] for bucket in t.buckets]


def test_nccl_parts_are_coalesced_into_buckets() -> None:
    """Each bucket is one /update_weights per server, one engine round and one device synchronise,
    instead of one per ~32 MiB gather part (~5,000 round trips per 80B sync)."""
    mib = 1 << 20
    assert _buckets([32 * mib] * 5, 64 * mib) == [[0, 1], [2, 3], [4]]
    assert _buckets([600 * mib, 10, 10], 512 * mib) == [[0], [1, 2]]        # a large part goes alone
    assert _buckets([], 512 * mib) == []
    # An 80B sync: ~160 GB in ~32 MiB gather parts → ~5,000 rounds, 512 MiB buckets → ~300.
    parts = [32 * mib] * 5000
    assert len(_buckets(parts, 512 * mib)) == -(-5000 * 32 // 512) == 313


def test_ipc_buckets_are_capped_nccl_buckets_are_the_recipes() -> None:
    """ipc copies each bucket to every server GPU (kept by rank 0's allocator): at most 128 MiB,
    whatever rollout.sync_bucket_mb says; nccl and the shm segments take it as given. The real
    `make_transport` (constructing a GPU transport touches no CUDA)."""
    import torch

    from megatron_rl.config.schema import RolloutConfig
    from megatron_rl.sync import make_transport
    from megatron_rl.topology import IPC_BUCKET_CAP_BYTES, transport_bucket_bytes

    mib, default = 1 << 20, RolloutConfig().sync_bucket_mb << 20
    assert IPC_BUCKET_CAP_BYTES == 128 * mib < default
    assert transport_bucket_bytes("ipc", default) == 128 * mib
    assert transport_bucket_bytes("ipc", 64 * mib) == 64 * mib
    assert transport_bucket_bytes("nccl", default) == transport_bucket_bytes("shm", default) == default
    cuda0 = torch.device("cuda", 0)
    for backend, held in (("ipc", 128 * mib), ("nccl", default)):
        transport, _ = make_transport(backend, [], None, default, cuda0)
        assert transport.bucket_bytes == held, backend     # type: ignore[attr-defined]


def test_gpu_transport_holds_parts_until_a_bucket_is_full() -> None:
    """The buffering of `_GpuTransport` (the send itself needs CUDA: recorded here)."""
    import torch

    t = _recording_transport(1000)
    for i in range(5):
        t.send_bucket({f"w{i}": torch.zeros(100)})                            # 400 bytes each
    assert t.buckets == [["w0", "w1", "w2"]] and list(t.pending) == ["w3", "w4"]
    t.flush()                                                                  # what finish() does first
    assert t.buckets == [["w0", "w1", "w2"], ["w3", "w4"]] and t.pending == {}
    assert t.sent_bytes == 5 * 400          # the timeout of the update's /finish_weight_update
    t.connected_at = []                     # no servers to connect to
    t.begin(2)
    assert t.sent_bytes == 0 and t.sent == []


def _megatron_dp_groups(world: int, tp: int, pp: int, cp: int) -> list[list[int]]:
    """megatron-core's own data-parallel groups (its RankGenerator, pure: no process group), in the
    order `initialize_model_parallel` numbers the dense grid by default."""
    from megatron_rl.megatron import cpu_compat

    cpu_compat.apply()
    from megatron.core.parallel_state import RankGenerator

    return RankGenerator(tp=tp, ep=1, dp=world // (tp * pp * cp), pp=pp, cp=cp, order="tp-cp-ep-dp-pp").get_ranks("dp")


def _check_replicas(world: int, tp: int, pp: int, cp: int) -> list[list[int]]:
    replicas = data_parallel_replicas(world, tp, pp, cp)
    assert len(replicas) == world // (tp * pp * cp)
    assert sorted(r for rep in replicas for r in rep) == list(range(world))     # a partition of the world
    assert all(len(rep) == tp * pp * cp for rep in replicas)
    # Replica d is exactly the ranks at position d of megatron's data-parallel groups.
    for group in _megatron_dp_groups(world, tp, pp, cp):
        assert [next(d for d, rep in enumerate(replicas) if r in rep) for r in group] == list(range(len(replicas)))
    return replicas


@pytest.mark.parametrize("recipe", PRODUCTION, ids=IDS)
def test_route_replicas_of_each_production_layout(recipe: Path) -> None:
    """Which ranks receive a row's R3 routes (`megatron/route_delivery.py`): the replica of the DP
    rank that computes it, as megatron-core numbers its ranks; with CP too (not used yet)."""
    p = load_recipe(recipe).parallelism
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    replicas = _check_replicas(p.world_size, tp, pp, p.context_parallel_size)
    assert len(replicas) == p.data_parallel_size
    assert replicas[0][:tp] == list(range(tp))           # global rank 0 (which holds the routes) in replica 0
    if p.context_parallel_size == 1:
        _check_replicas(p.world_size, tp, pp // 2 or 1, 2)


def test_route_replicas_by_hand() -> None:
    # 8 ranks, TP 2 × PP 2: DP 2; ranks 0-3 are PP stage 0 (TP pairs 0-1, 2-3), 4-7 stage 1.
    assert _check_replicas(8, 2, 2, 1) == [[0, 1, 4, 5], [2, 3, 6, 7]]
    # The 80B layout: 64 ranks, TP 2 × PP 2 → DP 16, replica d = TP pair 2d of each stage.
    assert data_parallel_replicas(64, 2, 2)[5] == [10, 11, 42, 43]
    assert _check_replicas(8, 1, 1, 2) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    with pytest.raises(ValueError, match="does not split"):
        data_parallel_replicas(6, 4, 1)
