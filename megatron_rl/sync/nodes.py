"""The `shm` backend over several colocated nodes: one sender per node, each into its node's /dev/shm.

Colocated over N nodes there is a server on every node, and a server reads segment files only from
its own node's RAM. Each node's first rank (`topology.shm_senders`) keeps a `SegmentWriter` in its
/dev/shm; global rank 0 is node 0's sender and broadcasts what it gathers to the others over a
process group of the senders (NCCL from the ranks' CUDA devices on GPU, gloo on CPU), bucket by
bucket: at most `rollout.sync_bucket_mb` (or one larger tensor) is in flight. Before this, rank 0
wrote every update once into the shared run directory and all N servers read it from there: for
Qwen3-Next-80B on 8 nodes, 160 GB written to the file system and fetched by 7 other nodes every
step (`topology.sync_traffic`).

Rank 0 still drives every server's weight-transfer round (`routes.py`), each with its node's
manifest and all at once (`shm.load_everywhere`), and keeps, per node, the latest complete update
that node holds: a restarted server is brought back from its own node's segments
(`ShmLink.resend_latest`).

The stream, on the group (source: global rank 0). Every sender hands every part of the gather to
its transport in step (`sync_weights`; the other senders' parts are empty), so each part is one
collective on every sender, which keeps the broadcasts in the same order as the gather's own
collectives on every rank:

- per part (and once more in `finish`): a CPU int64 header [meta bytes, buckets] (gloo);
- when buckets complete: their JSON manifest entries as a CPU uint8 tensor (gloo), then per bucket
  its bytes on the data device (NCCL on GPU: the other ranks of a node must not wait on the GPU
  that its server uses, which is why the headers stay on gloo);
- in `finish`: every sender's manifest (or error) gathered on rank 0 (`gather_object`, gloo).

A sender that fails to write (its /dev/shm full) keeps receiving, so that no rank is left waiting
in a collective, and reports the error in the final gather, where every sender raises it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..megatron.devices import DEFAULT_COLLECTIVE_TIMEOUT_MIN
from ..rollout.engines import MOE_LOAD
from ..rollout.engines.loaded import views
from ..topology import ShmSender
from .routes import EngineServer
from .shm import ALIGN, SegmentWriter, ShmLink, load_everywhere

Entry = list[Any]
"""[name, dtype, shape, 0, offset]: one tensor of a bucket (the manifest's format, segment 0)."""


def open_sender_group(senders: Sequence[ShmSender],
                      timeout_min: float = DEFAULT_COLLECTIVE_TIMEOUT_MIN) -> dist.ProcessGroup | None:
    """Collective over the world (every rank calls it: `dist.new_group`): the node senders' group,
    with the world's backends (gloo for CPU tensors and objects, NCCL for CUDA tensors); None
    with a single sender. `timeout_min`: the run's `trainer.collective_timeout_min`, as megatron's
    groups get it (without one, `new_group` takes torch's 30-minute default, not the world's)."""
    if len(senders) < 2:
        return None
    ranks = [s.rank for s in senders]
    if ranks[0] != 0 or len(set(ranks)) != len(ranks):
        raise ValueError(f"node senders {ranks}: global rank 0 first, each rank once")
    return dist.new_group(ranks, timeout=timedelta(minutes=timeout_min))


@dataclass
class NodeCopy:
    """What rank 0 knows of another node's segments: its latest complete update, while intact."""

    node: int
    latest: tuple[int, str, Path] | None = None
    overwritten: bool = False

    def close(self) -> None:
        """Nothing here: that node's own sender removes its files."""


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _entry(name: str, t: torch.Tensor, offset: int) -> Entry:
    return [name, str(t.dtype).removeprefix("torch."), list(t.shape), 0, offset]


class _NodeSender:
    """What every node sender does: keep its node's segments, and take part in rank 0's stream."""

    def __init__(self, group: dist.ProcessGroup, segment_bytes: int, device: torch.device) -> None:
        self.group, self.device, self.capacity = group, device, segment_bytes
        self.writer = SegmentWriter(None, segment_bytes)        # this node's /dev/shm, rewritten in place
        self.error: str | None = None
        self.written: list[str] = []
        self._buffer: torch.Tensor | None = None

    def buffer(self, nbytes: int) -> torch.Tensor:
        """`nbytes` of the reused bucket buffer (one larger tensor gets a fresh one)."""
        if nbytes > self.capacity:
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        if self._buffer is None:
            self._buffer = torch.empty(self.capacity, dtype=torch.uint8, device=self.device)
        return self._buffer[:nbytes]

    def _write(self, tensors: dict[str, torch.Tensor]) -> None:
        """Into this node's segments; after a failure nothing more, but the stream goes on."""
        if self.error is not None:
            return
        try:
            self.writer.send_bucket(tensors)
            self.written += tensors
        except Exception as exc:          # noqa: BLE001 -- reported in finish's gather, raised there
            self.error = f"{type(exc).__name__}: {exc}"

    def _begin(self, version: int) -> None:
        self.error, self.written = None, []
        self.writer.begin(version)

    def _header(self, meta: int = 0, data: int = 0) -> tuple[int, int]:
        h = torch.tensor([meta, data], dtype=torch.int64)
        dist.broadcast(h, src=0, group=self.group)
        return int(h[0]), int(h[1])

    def _report(self, names: list[str]) -> dict[str, Any]:
        """This sender's sealed update, or why not (what the final gather carries)."""
        report: dict[str, Any] = {"rank": dist.get_rank(), "pid": os.getpid(), "error": self.error}
        if self.error is None:
            try:
                manifest, _ = self.writer.seal(names)
                report.update(manifest=manifest, dir=str(self.writer.dir))
            except Exception as exc:      # noqa: BLE001 -- as above
                report["error"] = f"{type(exc).__name__}: {exc}"
        return report

    def _release(self) -> None:
        """After an update: a GPU bucket goes back to the allocator, which the colocated server's
        wake-up can then have (`fleet.release_cached_gpu_memory`); a CPU one stays (faulting its
        pages in again every sync costs more than the copies)."""
        if self.device.type == "cuda":
            self._buffer = None

    def abort(self) -> None:
        self.writer.abort()
        self._release()

    def close(self) -> None:
        self.writer.close()
        self._buffer = None


class NodeReceiver(_NodeSender):
    """A node's sender other than rank 0: writes what rank 0 broadcasts (its own parts are empty)."""

    def begin(self, version: int) -> None:
        self._begin(version)

    def send_bucket(self, tensors: dict[str, torch.Tensor]) -> None:
        assert not tensors, "only global rank 0 gathers the weights"
        self._receive()

    def _receive(self) -> None:
        """Rank 0's buckets of this part, up to its end marker (a header without metadata)."""
        while True:
            meta, nbytes = self._header()
            if not meta:
                return
            names = torch.empty(meta, dtype=torch.uint8)
            dist.broadcast(names, src=0, group=self.group)
            data = self.buffer(nbytes)
            dist.broadcast(data, src=0, group=self.group)
            self._write(dict(views(json.loads(bytes(names.numpy())), [data])))

    def finish(self, names: list[str]) -> dict[str, Any]:
        self._receive()
        self._release()
        report = self._report(self.written)
        dist.gather_object(report, None, dst=0, group=self.group)
        if report["error"]:
            raise RuntimeError(f"weight sync: the node sender (rank {report['rank']}) failed: {report['error']}")
        return {}


class NodeShmTransport(_NodeSender):
    """Global rank 0: node 0's sender, the source of the broadcast, and the driver of every server.

    `servers[k]` reads what `senders` names as its writer; `senders[0]` is rank 0 itself."""

    def __init__(self, servers: Sequence[EngineServer], senders: Sequence[ShmSender], group: dist.ProcessGroup, *,
                 segment_bytes: int, device: torch.device, moe_load: str = MOE_LOAD) -> None:
        super().__init__(group, segment_bytes, device)
        if senders[0].rank != 0 or dist.get_rank() != 0:
            raise ValueError("global rank 0 drives the servers and is the first node sender")
        self.senders = list(senders)
        self.copies = {s.node: NodeCopy(s.node) for s in self.senders[1:]}
        node_of = {k: s.node for s in self.senders for k in s.servers}
        if sorted(node_of) != list(range(len(servers))):
            raise ValueError(f"senders {list(senders)} do not cover the {len(servers)} server(s) exactly once")
        self.links = [ShmLink(self.writer if node_of[k] == self.senders[0].node else self.copies[node_of[k]],
                              server, {"moe_load": moe_load}) for k, server in enumerate(servers)]
        self.entries: list[Entry] = []
        self.used = 0
        self.version = 0
        self.buckets = self.alone = 0
        """Broadcasts of this update, and of those the tensors larger than a bucket that went alone."""

    def begin(self, version: int) -> None:
        self._begin(version)
        self.entries, self.used, self.version = [], 0, version
        self.buckets = self.alone = 0
        for copy in self.copies.values():     # the other nodes rewrite theirs in place as the stream arrives
            copy.overwritten = copy.latest is not None or copy.overwritten
            copy.latest = None

    def send_bucket(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copies the tensors now (into this node's segments and the bucket buffer)."""
        self._write(tensors)
        for name, t in tensors.items():
            if _aligned(self.used) + t.nbytes > self.capacity:
                self._flush()
            if t.nbytes > self.capacity:      # alone, from its own bytes (on the data device: the
                # group picks NCCL or gloo by the tensor's device, and the receivers expect the former)
                self._send([_entry(name, t, 0)], t.contiguous().reshape(-1).view(torch.uint8).to(self.device))
                self.alone += 1
                continue
            offset = _aligned(self.used)
            self.buffer(self.capacity)[offset:offset + t.nbytes].view(t.dtype).view(t.shape).copy_(t)
            self.entries.append(_entry(name, t, offset))
            self.used = offset + t.nbytes
        self._header()                                           # this part's end

    def _flush(self) -> None:
        if self.entries:
            self._send(self.entries, self.buffer(self.used))
        self.entries, self.used = [], 0

    def _send(self, entries: list[Entry], data: torch.Tensor) -> None:
        names = torch.frombuffer(bytearray(json.dumps(entries).encode()), dtype=torch.uint8)
        self._header(len(names), len(data))
        self.buckets += 1
        dist.broadcast(names, src=0, group=self.group)
        # Returns once the current stream is ordered after the broadcast (NCCL): the next copy into
        # the reused buffer cannot overtake it.
        dist.broadcast(data, src=0, group=self.group)

    def finish(self, names: list[str]) -> dict[str, Any]:
        self._flush()
        self._header()
        self._release()
        reports: list[Any] = [None] * len(self.senders)
        dist.gather_object(self._report(names), reports, dst=0, group=self.group)
        problems = [copy_problem(f"node {s.node} (rank {s.rank})", r, names) for s, r in zip(self.senders, reports)]
        if any(problems):
            raise RuntimeError("weight sync: " + "; ".join(p for p in problems if p))
        for s, r in zip(self.senders[1:], reports[1:]):
            copy = self.copies[s.node]
            copy.latest, copy.overwritten = (self.version, r["manifest"], Path(r["dir"])), False
        manifests = []
        for link in self.links:
            assert link.latest is not None, "every node's copy is complete (checked above)"
            manifests.append(link.latest[1])
        results = load_everywhere(self.links, self.version, manifests)
        return {**results[0], "servers": len(results), "senders": len(self.senders), "buckets": self.buckets,
                "alone": self.alone}


def copy_problem(where: str, report: dict[str, Any], names: list[str]) -> str | None:
    """What is wrong with a node's copy of a version (`where` names the node), from its writer's
    report {error, manifest}: its error, or tensors missing against the `names` sent; None if whole."""
    if report["error"]:
        return f"{where}: {report['error']}"
    got = sorted(t[0] for t in json.loads(report["manifest"])["tensors"])
    if got != sorted(names):
        return f"{where} wrote {len(got)} tensors, {len(names)} were sent"
    return None
