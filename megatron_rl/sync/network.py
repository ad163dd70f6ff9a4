"""The `shm` backend for servers on rollout nodes, without the shared file system: each rollout
node's copy of the weights arrives over the network into that node's /dev/shm.

On every rollout node a receiver (`NodeCopyReceiver`, a process that outlives the node's server)
keeps a `SegmentWriter` in its node's /dev/shm, rewritten in place by every version. Trainer rank 0
(`NetworkCopyTransport`) streams each version to all receivers at once over a group of its own:
rank 0 and the receivers, on a TCPStore rank 0 hosts (not the trainer's world, which the servers'
nodes are no part of). Then it drives every server's weight-transfer round with its node's
manifest (`shm.load_everywhere`), as for colocated nodes (`nodes.py`): the server maps files of its
own node's RAM. A restarted server is brought back from its node's copy (`ShmLink.resend_latest`):
the receiver, not the server, holds it. Before this, rank 0 wrote every version into the shared run
directory and every rollout node fetched it from there (`topology.sync_traffic`); that stays as the
fallback (`topology.weight_copy_path`).

The stream: rank 0 announces a round on the store (`round-<k>` = the version), so that a receiver
waits between versions on a store key, polling, and not in a collective with a deadline (a step
may take longer than any collective timeout); a store that stops answering is a dead trainer. Then,
on the group: per bucket a CPU int64 header [BUCKET, meta bytes, data bytes] (gloo), the bucket's
JSON manifest entries (uint8, gloo) and its bytes (gloo on CPU; on GPU over an NCCL communicator
from the receiver's CUDA device, vLLM's `PyNcclCommunicator`); at the end [FINISH] and every
receiver's report (its sealed manifest, or why not) all-gathered. Every collective has the group's
deadline; a receiver that died closes its sockets, which fails rank 0's next collective at once.

A receiver that fails to write (its /dev/shm full) keeps receiving and reports the error at the
end, where rank 0 raises it naming the node.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..rollout.engines import MOE_LOAD
from ..rollout.engines.loaded import views
from .nodes import NodeCopy, copy_problem
from .routes import EngineServer
from .shm import ALIGN, SegmentWriter, ShmLink, load_everywhere

BUCKET, FINISH, ABORT = 1, 2, 3
CLOSE = "close"
"""What the round key says when the trainer is done (the receiver returns)."""
POLL_S = 0.2


@dataclass(frozen=True)
class CopyGroupAddress:
    """Where rank 0 hosts the group's store; `world` = 1 + the receivers. `nccl_port`: the data
    communicator's (GPU), else None (the data goes over gloo)."""

    host: str
    port: int
    world: int
    timeout_s: float = 600.0
    nccl_port: int | None = None


class CopyGroup:
    """One end of the group (rank 0: the trainer; rank k ≥ 1: rollout node k − 1's receiver).
    Joining waits for every member, at most `timeout_s`."""

    def __init__(self, address: CopyGroupAddress, rank: int, device: torch.device | None = None) -> None:
        self.rank, self.world, self.address = rank, address.world, address
        self.device = device or torch.device("cpu")
        timeout = timedelta(seconds=address.timeout_s)
        self.store = dist.TCPStore(address.host, address.port, address.world, is_master=rank == 0, timeout=timeout)
        # Its collectives are the C++ backend's (torch's stubs do not list them).
        prefixed = dist.PrefixStore("mrl-node-copy", self.store)
        self.pg: Any = dist.ProcessGroupGloo(prefixed, rank, address.world, timeout)
        self.nccl: Any = None
        if self.device.type == "cuda":
            if address.nccl_port is None:
                raise ValueError("a CUDA copy group needs CopyGroupAddress.nccl_port (NCCL takes CUDA tensors only)")
            from ..rollout.nccl_sender import open_member

            self.nccl = open_member(address.host, address.nccl_port, rank, address.world, self.device)

    def broadcast(self, t: torch.Tensor) -> None:
        """From rank 0: CPU tensors over gloo, CUDA ones over NCCL (on the current stream, then synced)."""
        if t.device.type == "cuda":
            self._nccl_broadcast(t)
            return
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        self.pg.broadcast([t], opts).wait()

    def _nccl_broadcast(self, t: torch.Tensor) -> None:
        """NCCL has no deadline of its own: a member that died mid-broadcast leaves the kernel
        waiting forever. So wait on an event, and past `timeout_s` abort the communicator
        (`PyNcclCommunicator.destroy`: ncclCommAbort, which ends the kernel) and raise."""
        assert self.nccl is not None, "CUDA tensors need the NCCL communicator"
        with torch.cuda.device(t.device):
            stream = torch.cuda.current_stream(t.device)
            self.nccl.broadcast(t, src=0, stream=stream)
            done = torch.cuda.Event()
            done.record(stream)
            deadline = time.monotonic() + self.address.timeout_s
            while not done.query():
                if time.monotonic() > deadline:
                    self.nccl.destroy()
                    raise RuntimeError(f"NCCL broadcast of {t.nbytes} bytes not done after {self.address.timeout_s:.0f}"
                                       " s (a member died or hung): communicator aborted")
                time.sleep(0.001)

    def header(self, op: int = 0, meta: int = 0, nbytes: int = 0) -> tuple[int, int, int]:
        h = torch.tensor([op, meta, nbytes], dtype=torch.int64)
        self.broadcast(h)
        return int(h[0]), int(h[1]), int(h[2])

    def all_gather_json(self, obj: Any) -> list[Any]:
        """Every member's `obj` (JSON), in rank order."""
        data = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world)]
        self.pg.allgather([sizes], [torch.tensor([len(data)], dtype=torch.int64)]).wait()
        most = max(int(s) for s in sizes)
        out = [torch.empty(most, dtype=torch.uint8) for _ in range(self.world)]
        padded = torch.zeros(most, dtype=torch.uint8)
        padded[:len(data)] = data
        self.pg.allgather([out], [padded]).wait()
        return [json.loads(bytes(o[:int(s)].numpy())) for o, s in zip(out, sizes)]


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class NodeCopyReceiver:
    """A rollout node's end: every version rank 0 streams, into this node's /dev/shm (`shm`: that
    directory; by default /dev/shm itself)."""

    def __init__(self, group: CopyGroup, segment_bytes: int, shm: Path | None = None) -> None:
        self.group = group
        self.writer = SegmentWriter(None, segment_bytes, shm=shm)
        self.round = 0

    def serve(self) -> None:
        """Receive versions until the trainer closes the group; raises when the trainer is gone
        (its store stops answering, or a collective fails or passes its deadline)."""
        try:
            while True:
                key = f"round-{self.round + 1}"
                while not self.group.store.check([key]):       # raises once rank 0's store is gone
                    time.sleep(POLL_S)
                said = self.group.store.get(key).decode()
                if said == CLOSE:
                    return
                self.round += 1
                self.receive(int(said))
        finally:
            self.writer.close()

    def receive(self, version: int) -> None:
        """One version: buckets up to FINISH (or ABORT), then this node's report to rank 0."""
        self.writer.begin(version)
        error: str | None = None
        names: list[str] = []
        buffer: torch.Tensor | None = None
        while True:
            op, meta, nbytes = self.group.header()
            if op == ABORT:
                self.writer.abort()
                return
            if op == FINISH:
                break
            entries = torch.empty(meta, dtype=torch.uint8)
            self.group.broadcast(entries)
            if buffer is None or buffer.numel() < nbytes:
                buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.group.device)
            data = buffer[:nbytes]
            self.group.broadcast(data)
            if error is None:
                try:
                    tensors = dict(views(json.loads(bytes(entries.numpy())), [data]))
                    self.writer.send_bucket(tensors)
                    names += tensors
                except Exception as exc:  # noqa: BLE001 -- reported to rank 0 below, raised there
                    error = f"{type(exc).__name__}: {exc}"
        report: dict[str, Any] = {"rank": self.group.rank, "pid": os.getpid(), "error": error}
        if error is None:
            try:
                manifest, _ = self.writer.seal(names)
                report.update(manifest=manifest, dir=str(self.writer.dir))
            except Exception as exc:      # noqa: BLE001 -- as above
                report["error"] = f"{type(exc).__name__}: {exc}"
        self.group.all_gather_json(report)


class NetworkCopyTransport:
    """Trainer rank 0: streams every version to the rollout nodes' receivers and drives every
    server. `servers[k]` reads the copy of receiver k + 1 (its node's)."""

    def __init__(self, servers: Sequence[EngineServer], group: CopyGroup, *, segment_bytes: int,
                 moe_load: str = MOE_LOAD) -> None:
        if group.rank != 0 or group.world != len(servers) + 1:
            raise ValueError(f"rank 0 of a group of 1 + {len(servers)} receivers, one per server; got rank "
                             f"{group.rank} of {group.world}")
        self.group, self.capacity = group, segment_bytes
        self.copies = [NodeCopy(k) for k in range(len(servers))]
        self.links = [ShmLink(copy, s, {"moe_load": moe_load}) for copy, s in zip(self.copies, servers)]
        self.round = self.version = 0
        self.buckets = 0
        self.entries: list[list[Any]] = []
        self.used = 0
        self._buffer: torch.Tensor | None = None
        self.streaming = False

    def begin(self, version: int) -> None:
        self.round += 1
        self.group.store.set(f"round-{self.round}", str(version))
        self.version, self.entries, self.used, self.buckets, self.streaming = version, [], 0, 0, True
        for copy in self.copies:          # the receivers rewrite theirs in place as the stream arrives
            copy.overwritten = copy.latest is not None or copy.overwritten
            copy.latest = None

    def send_bucket(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copies the tensors now (into the bucket buffer; one larger than a bucket goes alone)."""
        for name, t in tensors.items():
            if _aligned(self.used) + t.nbytes > self.capacity:
                self._flush()
            entry = [name, str(t.dtype).removeprefix("torch."), list(t.shape), 0]
            if t.nbytes > self.capacity:
                self._send([[*entry, 0]], t.detach().contiguous().reshape(-1).view(torch.uint8).to(self.group.device))
                continue
            offset = _aligned(self.used)
            self._bucket()[offset:offset + t.nbytes].view(t.dtype).view(t.shape).copy_(t)
            self.entries.append([*entry, offset])
            self.used = offset + t.nbytes

    def _bucket(self) -> torch.Tensor:
        if self._buffer is None:
            self._buffer = torch.empty(self.capacity, dtype=torch.uint8, device=self.group.device)
        return self._buffer

    def _flush(self) -> None:
        if self.entries:
            self._send(self.entries, self._bucket()[:self.used])
        self.entries, self.used = [], 0

    def _send(self, entries: list[list[Any]], data: torch.Tensor) -> None:
        meta = torch.frombuffer(bytearray(json.dumps(entries).encode()), dtype=torch.uint8)
        self._collective(self.group.header, BUCKET, len(meta), len(data))
        self._collective(self.group.broadcast, meta)
        self._collective(self.group.broadcast, data)
        self.buckets += 1

    def _collective(self, fn: Any, *args: Any) -> Any:
        """`fn(*args)` on the group; a failure (a receiver died, or passed the deadline) names the nodes."""
        try:
            return fn(*args)
        except RuntimeError as exc:
            self.streaming = False
            raise RuntimeError(f"weight sync to the rollout nodes' receivers ({len(self.copies)}) failed at version "
                               f"{self.version}: {exc} (a receiver died or hung; its server keeps its last "
                               "loaded weights)") from exc

    def finish(self, names: list[str]) -> dict[str, Any]:
        self._flush()
        self._collective(self.group.header, FINISH)
        self.streaming = False
        reports = self._collective(self.group.all_gather_json, {"rank": 0})[1:]
        problems = [copy_problem(f"rollout node {k} (receiver pid {r.get('pid')})", r, names)
                    for k, r in enumerate(reports)]
        if any(problems):
            raise RuntimeError("weight sync: " + "; ".join(p for p in problems if p))
        for copy, r in zip(self.copies, reports):
            copy.latest, copy.overwritten = (self.version, r["manifest"], Path(r["dir"])), False
        results = load_everywhere(self.links, self.version, [r["manifest"] for r in reports])
        return {**results[0], "servers": len(results), "receivers": len(reports), "buckets": self.buckets}

    def abort(self) -> None:
        """The receivers drop the version (after a failed gather on rank 0's side); nothing if the
        stream itself failed (its group is broken)."""
        if self.streaming:
            self.streaming = False
            try:
                self.group.header(ABORT)
            except RuntimeError:
                pass          # the error that led here is the one raised

    def close(self) -> None:
        """The receivers return (their copies go with them)."""
        self.group.store.set(f"round-{self.round + 1}", CLOSE)


def serve_node_copy(address: CopyGroupAddress, rank: int, segment_bytes: int, shm: Path | None = None,
                    device: torch.device | None = None) -> None:
    """A rollout node's receiver, start to end: join the group (at most `address.timeout_s`), keep
    this node's copy of every version until the trainer closes the group or is gone."""
    NodeCopyReceiver(CopyGroup(address, rank, device), segment_bytes, shm).serve()
