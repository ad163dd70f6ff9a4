"""Where a run's processes sit on GPUs, as pure functions of the recipe (CPU-tested over every
production recipe; `config/rules.py` and the GPU weight transports use them).

Node numbering follows the sbatch script: trainer nodes 0 … P−1 (torchrun places a node's ranks
contiguously, LOCAL_RANK = GPU index), then the rollout nodes of a disaggregated layout. A server
takes the first TP × PP × DP GPUs its node shows it (no CUDA_VISIBLE_DEVICES of ours), data-parallel
engine k of them the devices k·W … k·W + W − 1 with W = TP × PP (vLLM 0.32.0 on CUDA: the worker's
local rank is offset by dp_local_rank × TP × PCP × PP, vllm/v1/worker/gpu_worker.py:441-459).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, TypeVar

from .config.schema import RecipeConfig

T = TypeVar("T")

IPC_BUCKET_CAP_BYTES = 128 << 20
"""The most the `ipc` transport holds per bucket, whatever `rollout.sync_bucket_mb` says. Each ipc
bucket is copied to every GPU the servers use, by rank 0's process, whose caching allocator keeps
those blocks for the rest of the run (no `empty_cache`): one bucket per GPU of rank 0's node, next
to that GPU's own trainer rank and an awake vLLM. 128 MiB is ~4x the rounds of the 512 MiB default
(~470 /update_weights for a 60 GB sync instead of ~120), for a quarter of that memory."""


@dataclass(frozen=True)
class GroupMember:
    rank: int
    """Rank in the weight-transfer NCCL group."""
    node: int
    gpu: int
    """Local GPU index on `node`."""
    role: str
    """'trainer rank 0', or 'server <k> engine <e> worker <w>'."""


def engine_devices(visible: Sequence[T], workers_per_engine: int, engines: int) -> list[list[T]]:
    """Per data-parallel engine of one server, the devices (of those the server sees, in order)
    its workers use."""
    if workers_per_engine < 1 or engines < 1 or workers_per_engine * engines > len(visible):
        raise ValueError(f"{engines} engine(s) × {workers_per_engine} worker(s) do not fit the "
                         f"{len(visible)} visible GPU(s)")
    return [list(visible[k * workers_per_engine:(k + 1) * workers_per_engine]) for k in range(engines)]


def server_nodes(cfg: RecipeConfig) -> list[int]:
    """The node of each rollout server, in the order rank 0 drives them (`train/fleet.py`: its
    own node first; the sbatch script's rollout nodes)."""
    trainer_nodes = cfg.parallelism.nodes
    if cfg.rollout.placement == "colocated":
        return list(range(trainer_nodes))
    return list(range(trainer_nodes, trainer_nodes + cfg.rollout.nodes))


def nccl_weight_group(cfg: RecipeConfig) -> list[GroupMember]:
    """The members of `rollout.weight_transfer: nccl`'s one group: trainer rank 0 (node 0, GPU 0),
    then every worker of every server at rank_offset 1 + the sizes of the servers before it, worker
    rank dp · W + rank within its engine (vllm/distributed/weight_transfer/nccl_common.py)."""
    r = cfg.rollout
    per_engine = r.tensor_parallel_size                    # vLLM servers run PP 1
    members = [GroupMember(0, 0, 0, "trainer rank 0")]
    for k, node in enumerate(server_nodes(cfg)):
        gpus = engine_devices(list(range(per_engine * r.data_parallel_size)), per_engine, r.data_parallel_size)
        for e, engine in enumerate(gpus):
            for w, gpu in enumerate(engine):
                members.append(GroupMember(len(members), node, gpu, f"server {k} engine {e} worker {w}"))
    return members


def duplicate_gpus(members: Sequence[GroupMember]) -> list[list[GroupMember]]:
    """Groups of members on one GPU (NCCL refuses such a communicator: "Duplicate GPU detected")."""
    seen = Counter((m.node, m.gpu) for m in members)
    return [[m for m in members if (m.node, m.gpu) == place] for place, n in seen.items() if n > 1]


def transport_bucket_bytes(backend: str, requested: int) -> int:
    """Bytes a GPU transport holds before it sends (`requested`: `rollout.sync_bucket_mb` in bytes;
    `ipc` is capped at IPC_BUCKET_CAP_BYTES). The `shm` segments are not buckets: their size is
    `requested` as given (so is the bucket a `shm` sender per node is broadcast in)."""
    return min(requested, IPC_BUCKET_CAP_BYTES) if backend == "ipc" else requested


def ipc_devices(visible: Sequence[T], server_world_size: int, reported: Sequence[T]) -> list[T]:
    """Every GPU a colocated server's workers use, for the CUDA IPC handles: `reported` is what
    /collective_rpc returns, which under DP > 1 is engine 0's workers only (vLLM 0.32.0,
    `DPLBAsyncMPClient.call_utility_async`, vllm/v1/engine/core_client.py: "Only the result from the
    first engine is returned"); the other engines' GPUs follow from the DP layout."""
    per_engine = len(reported)
    if per_engine == 0 or server_world_size % per_engine:
        raise ValueError(f"a server of {server_world_size} workers reported {per_engine} GPU(s)")
    engines = engine_devices(visible, per_engine, server_world_size // per_engine)
    if sorted(map(str, reported)) != sorted(map(str, engines[0])):
        raise ValueError(f"the server's first engine runs on {list(reported)}, but the GPUs this process sees "
                         f"put it on {engines[0]}: the server and trainer rank 0 see different GPUs "
                         "(CUDA_VISIBLE_DEVICES)")
    return [d for engine in engines for d in engine]


def data_parallel_replicas(world_size: int, tp: int, pp: int, cp: int = 1) -> list[list[int]]:
    """Per data-parallel rank d, the global ranks of its replica (every TP, CP and PP rank whose
    data-parallel rank is d), ascending. megatron-core 0.19 numbers its dense grid in the order
    tp-cp-ep-dp-pp, EP belonging to the expert grid only (`parallel_state.initialize_model_parallel`'s
    default `order`, RankGenerator with ep 1): rank = t + TP·(c + CP·(d + DP·p)).

    These are the ranks that need a row's R3 routes when DP rank d computes it: the router of every
    TP / CP / PP rank of the replica routes the replica's tokens (`megatron/route_delivery.py`)."""
    model = tp * pp * cp
    if min(tp, pp, cp) < 1 or world_size < 1 or world_size % model:
        raise ValueError(f"world size {world_size} does not split into TP {tp} × CP {cp} × PP {pp}")
    dp = world_size // model
    return [sorted(t + tp * (c + cp * (d + dp * p)) for t in range(tp) for c in range(cp) for p in range(pp))
            for d in range(dp)]


@dataclass(frozen=True)
class ShmSender:
    """One writer of `rollout.weight_transfer: shm` segments (`sync/shm.py`, `sync/nodes.py`)."""

    rank: int
    """Global trainer rank that writes (its node's LOCAL_RANK 0)."""
    node: int
    servers: tuple[int, ...]
    """The servers (indices in the order rank 0 drives them) that read what it writes."""
    shared: bool
    """Into the shared run directory (readers on other nodes), else its node's /dev/shm."""


def shm_senders(colocated: bool, trainer_nodes: int, ranks_per_node: int, servers: int) -> list[ShmSender]:
    """Who writes the `shm` segments. Colocated over several nodes, every node's first rank writes
    into its own node's /dev/shm for its node's server (rank 0 broadcasts the weights to them):
    a server never reads across nodes. Otherwise rank 0 alone, into /dev/shm for the lone server of
    its node, or into the shared run directory for servers on rollout nodes."""
    if trainer_nodes < 1 or ranks_per_node < 1 or servers < 0:
        raise ValueError(f"{trainer_nodes} node(s) × {ranks_per_node} rank(s), {servers} server(s)")
    if colocated and trainer_nodes > 1:
        if servers != trainer_nodes:
            raise ValueError(f"colocated: one server per node, but {servers} server(s) on {trainer_nodes} nodes")
        return [ShmSender(n * ranks_per_node, n, (n,), False) for n in range(trainer_nodes)]
    lone = colocated and servers == 1
    return [ShmSender(0, 0, tuple(range(servers)), not lone)]


def recipe_shm_senders(cfg: RecipeConfig) -> list[ShmSender]:
    """`shm_senders` of the job the sbatch script starts for `cfg` (--nproc-per-node = gpus_per_node)."""
    p = cfg.parallelism
    return shm_senders(cfg.rollout.placement == "colocated", p.nodes, p.gpus_per_node, len(server_nodes(cfg)))


@dataclass(frozen=True)
class NodeSyncBytes:
    """What one weight sync moves on one node (bytes)."""

    node: int
    shm_written: int
    """Into the node's /dev/shm (RAM)."""
    fs_written: int
    """Into the shared file system."""
    fs_fetched: int
    """From the shared file system (what the node's page cache does not already hold)."""
    received: int
    """From rank 0's broadcast to the node senders, over the interconnect."""
    worker_reads: int
    """By the node's server workers, out of that node's RAM (/dev/shm or page cache)."""


def sync_traffic(senders: Sequence[ShmSender], server_nodes_: Sequence[int], update_bytes: int,
                 engines_per_server: int) -> list[NodeSyncBytes]:
    """Per node hosting a sender or a server, the bytes one `shm` sync of `update_bytes` moves.
    Every data-parallel engine of a server loads the whole update (its TP workers read their shards
    of each tensor), so a server reads `engines_per_server` × the update out of its node's RAM. A
    shared directory is written once from rank 0's node, whose own server reads the written pages
    from its page cache; every other node fetches the update once (its workers share its cache)."""
    writer_of = {k: s for s in senders for k in s.servers}
    if sorted(writer_of) != list(range(len(server_nodes_))):
        raise ValueError(f"senders {senders} do not cover the {len(server_nodes_)} server(s) exactly once")
    nodes = sorted({s.node for s in senders} | set(server_nodes_))
    out = []
    for node in nodes:
        mine = [s for s in senders if s.node == node]
        reads = [writer_of[k] for k, n in enumerate(server_nodes_) if n == node]
        fetched = update_bytes if any(w.shared and w.node != node for w in reads) else 0
        out.append(NodeSyncBytes(
            node,
            shm_written=update_bytes * sum(not s.shared for s in mine),
            fs_written=update_bytes * sum(s.shared for s in mine),
            fs_fetched=fetched,
            received=update_bytes if mine and len(senders) > 1 and mine[0].rank != 0 else 0,
            worker_reads=update_bytes * engines_per_server * len(reads)))
    return out


NODE_COPY_RECEIVERS = True
"""Whether a disaggregated job runs a weight-copy receiver (`sync/network.py`) beside each rollout
node's server: the sbatch script starts every `rollout-server` of a `shm` recipe with
`--weight-copy`, and trainer rank 0, finding the receivers beside the servers it attaches, sends
every version over the network into their nodes' /dev/shm. Servers started without it (by hand)
are fed through the shared run directory, the fallback."""

WeightCopyKind = Literal["node_shm", "nodes_shm", "network", "shared_run_dir", "none"]


@dataclass(frozen=True)
class WeightCopy:
    """Where the copy of the weights a (restarted) server loads from lives, and how it gets there."""

    kind: WeightCopyKind
    line: str
    """What `recipe validate` and `recipe show` say."""


def weight_copy_path(cfg: RecipeConfig, receivers: bool = NODE_COPY_RECEIVERS) -> WeightCopy:
    """The path a recipe's weight syncs take (`receivers`: whether the rollout nodes run a weight-copy
    receiver, `NODE_COPY_RECEIVERS` for the job the sbatch script starts)."""
    r = cfg.rollout
    if r.weight_transfer != "shm":
        return WeightCopy("none", f"weight sync: {r.weight_transfer} from trainer rank 0's GPU straight into the "
                                  "servers' workers; no copy is kept (a restarted server stops the run)")
    senders = recipe_shm_senders(cfg)
    if r.placement == "colocated":
        if len(senders) > 1:
            return WeightCopy("nodes_shm", f"weight sync: each of the {len(senders)} nodes' first rank writes its "
                                           "node's copy into its /dev/shm, from rank 0's broadcast")
        return WeightCopy("node_shm", "weight sync: trainer rank 0 writes the copy into its node's /dev/shm")
    if receivers:
        return WeightCopy("network", f"weight sync: over the network (NCCL on GPU, gloo on CPU) into each of the "
                                     f"{r.nodes} rollout nodes' /dev/shm, where a restarted server reloads from")
    return WeightCopy("shared_run_dir", f"weight sync: through the shared run dir (<run>/rollout/sync), which each of "
                                        f"the {r.nodes} rollout nodes reads: the fallback (the rollout nodes run no "
                                        "weight-copy receiver, sync/network.py)")
