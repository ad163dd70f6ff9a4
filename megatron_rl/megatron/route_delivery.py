"""R3 routes to the ranks that compute their rows, and to no other (gpu-readiness-audit-2 #15).

Global rank 0 holds every sample's routes (`route_rows.hold_on_rank0`); the groups the other ranks
receive carry only their shapes. Before a forward, the actor knows which rows every data-parallel
rank computes (its micro-batch plan is the same on every rank); `deliver` then sends each replica
(`topology.data_parallel_replicas`: its TP, CP and PP ranks, whose routers all route the replica's
tokens) the routes of its rows that it does not hold yet, and each rank drops those of rows it no
longer computes. So a rank holds the compact routes of one forward's share of the rows, plus the
one dense micro-batch being fed; never the step's dense batch.

One message per (sample, receiving rank), on the CPU over the world group: gloo, also under
`cpu:gloo,cuda:nccl` (torch's c10d `send`/`recv` ops dispatch on the tensor's device; the CPU ones
call the group's CPU backend). Both sides know every sample's shape, so nothing is pickled and the
receiver allocates exactly. What each rank holds is decided identically on both sides (its last delivery's
rows; rank 0 tracks it per receiving rank), so a repeated forward over the same rows (π_old, the
diagnostic forward, the reference) sends nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist

from ..route_rows import RouteRows, RouteStore
from ..topology import data_parallel_replicas
from . import cpu_compat

cpu_compat.require_applied()

from megatron.core import parallel_state as ps  # noqa: E402


def replicas_now() -> list[list[int]]:
    """This job's data-parallel replicas, from megatron-core's group sizes."""
    return data_parallel_replicas(dist.get_world_size(), ps.get_tensor_model_parallel_world_size(),
                                  ps.get_pipeline_model_parallel_world_size(), ps.get_context_parallel_world_size())


def deliver(routes: RouteRows, rows_per_dp: Sequence[Sequence[int]]) -> int:
    """Every rank of data-parallel replica d ends up holding the routes of rows `rows_per_dp[d]`
    (indices into `routes`) and no others; global rank 0 keeps all. Collective over the world,
    every rank with the same arguments. Returns the bytes this rank received."""
    store = routes.store
    if store.everywhere or not dist.is_initialized() or dist.get_world_size() == 1:
        return 0
    replicas = replicas_now()
    if len(rows_per_dp) != len(replicas):
        raise ValueError(f"rows for {len(rows_per_dp)} data-parallel ranks, the job has {len(replicas)}")
    need = [routes.samples(rows) for rows in rows_per_dp]
    rank = dist.get_rank()
    if rank == 0:
        _send(store, replicas, need)
        return 0
    mine = ps.get_data_parallel_rank()
    if rank not in replicas[mine]:
        raise RuntimeError(f"rank {rank} has megatron-core data-parallel rank {mine}, but the replicas of "
                           f"topology.data_parallel_replicas put it elsewhere: {replicas}")
    return _receive(store, need[mine])


def _as_bytes(array: np.ndarray) -> torch.Tensor:
    """A flat uint8 view of a C-contiguous array (no copy: the message is the array's memory)."""
    return torch.from_numpy(array.reshape(-1).view(np.uint8))


def _send(store: RouteStore, replicas: list[list[int]], need: list[list[int]]) -> None:
    pending, payloads = [], []
    for d, members in enumerate(replicas):
        for dst in members:
            if dst == 0:
                continue
            new = [i for i in need[d] if i not in store.sent.get(dst, frozenset())]
            store.sent[dst] = frozenset(need[d])
            for i in new:
                if i not in store.arrays:
                    raise RuntimeError(f"rank 0 does not hold the routes of sample {i}")
                payloads.append(_as_bytes(store.arrays[i]))       # alive until every send completed
                pending.append(dist.isend(payloads[-1], dst=dst))
    for work in pending:
        if work is not None:       # None only for a rank outside the group, never here
            work.wait()


def _receive(store: RouteStore, need: list[int]) -> int:
    # Drop first: a rank holds at most one forward's rows, not the last one's and the next one's.
    store.arrays = {i: store.arrays[i] for i in need if i in store.arrays}
    received = 0
    for i in need:
        if i in store.arrays:
            continue
        array = store.empty(i)
        dist.recv(_as_bytes(array), src=0)
        store.arrays[i] = array
        received += array.nbytes
    return received
