"""torchrun worker: weight syncs of a real Megatron actor (TP 2 × PP 2 over two "nodes") through a
sender per node (`sync/nodes.py`), into one recording server per node.

Run as two agents, `torchrun --nnodes 2 --nproc-per-node N --node-rank {0,1} … node_sender_worker.py
HF_DIR OUT_JSON` (tests/mp/launch.py `torchrun_nodes`): N = 2 on CPU (TP 2 × PP 2, node 1's sender
is rank 2, its LOCAL_RANK 0), N = 1 on GPUs (PP 2, a GPU per "node", the broadcast over NCCL from
the ranks' CUDA devices). Pipeline stage 1 lives on node 1, so rank 0 gathers half the layers
across the "nodes" while the node senders' broadcasts interleave with the gather. Rank 0 writes what each server loaded,
the reference (rank 0's own gather of the same weights), who wrote which files, a restart, a
sender that fails mid-sync, and what is left in /dev/shm.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

torch.set_num_threads(1)

from megatron_rl.megatron import cpu_compat  # noqa: E402

cpu_compat.apply()   # explicit: before anything imports megatron-core

from megatron_rl.config.schema import ParallelismConfig, TrainerConfig  # noqa: E402
from megatron_rl.megatron.actor import Actor, Training, init_parallel  # noqa: E402
from megatron_rl.megatron.devices import compute_device  # noqa: E402
from megatron_rl.model_config import read_hf_config  # noqa: E402
from megatron_rl.models import build_model, weight_map  # noqa: E402
from megatron_rl.rollout.shm import SHM, SYNC_PREFIX  # noqa: E402
from megatron_rl.sync import sync_weights  # noqa: E402
from megatron_rl.sync.diagnose import diagnose_sync  # noqa: E402
from megatron_rl.sync.nodes import NodeReceiver, NodeShmTransport, open_sender_group  # noqa: E402
from megatron_rl.topology import shm_senders  # noqa: E402
from megatron_rl.weights.loading import load_hf_into_model  # noqa: E402
from megatron_rl.weights.sharding import gather_hf_layers  # noqa: E402
from tests.helpers.recording_server import Server  # noqa: E402
from tests.mp.common import finish  # noqa: E402

LAYOUTS = {2: ParallelismConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, sequence_parallel=True),
           1: ParallelismConfig(pipeline_model_parallel_size=2)}
"""By ranks per node."""
BUCKET = 64 << 10
"""`rollout.sync_bucket_mb` in bytes, small: the 128 KiB embedding goes alone, the rest in buckets."""


def reference(model: torch.nn.Module, adapter: Any, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Rank 0's own gather of the weights as they are now, in the sync dtype (collective)."""
    return {name: t.to(dtype).cpu() for layer in gather_hf_layers(model, adapter) for name, t in layer}


def mapped_by(pid: int, path: str) -> bool:
    return path in Path(f"/proc/{pid}/maps").read_text()


def check_servers(servers: list[Server], want: dict[str, torch.Tensor], pids: list[int],
                  sender_ranks: list[int]) -> dict[str, Any]:
    """Per server: loaded == rank 0's weights, bit for bit, from files its node's sender wrote."""
    out: dict[str, Any] = {"identical": [], "writer_pid": [], "mapped_by_writer": [], "mapped_by_rank0": []}
    for server, rank in zip(servers, sender_ranks):
        same = sorted(server.loaded) == sorted(want) and all(
            server.loaded[n].dtype == t.dtype and torch.equal(server.loaded[n], t) for n, t in want.items())
        out["identical"].append(same)
        name = Path(server.segments[0]).parent.name                   # megatron-rl-sync-<pid>-…
        out["writer_pid"].append(int(name.removeprefix(SYNC_PREFIX).split("-")[0]) == pids[rank])
        out["mapped_by_writer"].append(all(mapped_by(pids[rank], p) for p in server.segments))
        out["mapped_by_rank0"].append(any(mapped_by(os.getpid(), p) for p in server.segments))
    out["files_equal"] = [Path(a).read_bytes() == Path(b).read_bytes()
                          for a, b in zip(servers[0].segments, servers[1].segments)]
    return out


def failing_write(tensors: dict[str, torch.Tensor]) -> None:
    raise OSError(28, "No space left on device (simulated)")


def diagnosis(model: torch.nn.Module, adapter: Any, transport: Any, servers: list[Server]) -> dict[str, Any]:
    """A failed verification's diagnosis re-sends through every rank's own transport (the node
    senders included: without theirs, rank 0 waited for them until the collective timeout)."""
    rank = dist.get_rank()
    found = diagnose_sync(lambda t: sync_weights(model, adapter, t, 5, torch.float32), transport,
                          servers if rank == 0 else [])
    done: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(done, found.message())
    return {"same_on_every_rank": len(set(done)) == 1, "versions": [s.version for s in servers], "message": done[0]}


def main(hf_dir: str, out: str) -> None:
    per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    layout = LAYOUTS[per_node]
    init_parallel(layout, seed=1234)
    rank, world = dist.get_rank(), dist.get_world_size()
    nodes = world // per_node
    device = compute_device()
    senders = shm_senders(True, nodes, per_node, nodes)
    group = open_sender_group(senders)
    assert group is not None
    hf = read_hf_config(hf_dir)
    adapter = weight_map(hf)
    actor = Actor(build_model(hf, layout, torch.float32), 2, Training(TrainerConfig(), layout, total_updates=1))
    load_hf_into_model(actor.model, hf_dir, adapter)
    servers = [Server(f"node{k}") for k in range(nodes)]
    sender_ranks = [s.rank for s in senders]
    transport: Any = None
    if rank == 0:
        transport = NodeShmTransport(servers, senders, group, segment_bytes=BUCKET, device=device)
    elif rank in sender_ranks:
        transport = NodeReceiver(group, BUCKET, device)
    pids: list[Any] = [None] * world
    dist.all_gather_object(pids, os.getpid())
    result: dict[str, Any] = {"senders": sender_ranks, "device": str(device), "syncs": {}}

    def sync(version: int, dtype: torch.dtype) -> dict[str, Any]:
        with torch.no_grad():
            for p in actor.model.parameters():        # new weights every version (same on TP peers)
                p.add_(0.01 * version)
        start = time.perf_counter()
        try:
            report, error = sync_weights(actor.model, adapter, transport, version, dtype), None
        except RuntimeError as exc:          # raised where it failed; the others go on to the gather
            report, error = None, str(exc)
        seconds = time.perf_counter() - start
        want = reference(actor.model, adapter, dtype)
        if rank != 0 or report is None:
            return {"error": error}
        return {"seconds": seconds, "server": report.server, "tensors": report.tensors, "error": error,
                "versions": [s.version for s in servers], **check_servers(servers, want, pids, sender_ranks)}

    result["syncs"]["1"] = sync(1, torch.float32)
    result["syncs"]["2"] = sync(2, torch.bfloat16)              # in place again, another dtype
    if rank == 0:                                              # node 1's server restarted: its own copy
        servers[1].loaded, servers[1].version = {}, 0
        again = transport.links[1].resend_latest()
        result["resend"] = {"version": again["version"], "segments_node1": servers[1].segments}
    # Node 1's sender cannot write (its /dev/shm full): both senders raise, nobody waits.
    if rank == sender_ranks[1]:
        transport.writer.send_bucket = failing_write
    result["failed_sync"] = sync(3, torch.float32)["error"]
    if rank == sender_ranks[1]:
        del transport.writer.send_bucket
    errors: list[Any] = [None] * world
    dist.all_gather_object(errors, result["failed_sync"])
    result["failed_on"] = [r for r, e in enumerate(errors) if e]
    if rank == 0:
        result["failed_message"] = errors[0]
        try:
            transport.links[1].resend_latest()
            result["resend_after_failure"] = "no error"
        except RuntimeError as exc:
            result["resend_after_failure"] = str(exc)
    result["syncs"]["4"] = sync(4, torch.float32)                # and the next sync goes through
    result["diagnosis"] = diagnosis(actor.model, adapter, transport, servers)
    dist.barrier()                                               # rank 0 has read every node's copy
    if transport is not None:
        for link in getattr(transport, "links", []):
            link.close()
        transport.close()
    dist.barrier()
    result["left_in_shm"] = sorted(p.name for pid in {pids[r] for r in sender_ranks}
                                   for p in SHM.glob(f"{SYNC_PREFIX}{pid}-*"))
    result["pids"] = [pids[r] for r in sender_ranks]
    finish(result, out)


if __name__ == "__main__":
    main(*sys.argv[1:])
