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
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..ports import free_port
from ..rollout.engines import MOE_LOAD
from ..rollout.engines.loaded import views
from ..rollout.shm import SYNC_PREFIX
from .delta import DeltaPolicy, DeltaStats, Mode, PatchEntry, apply_rows
from .nodes import NodeCopy, copy_problem
from .owners import OwnerCopy, patch_names
from .routes import EngineServer
from .shm import ALIGN, PatchFiles, SegmentWriter, ShmLink, _shm_root, load_everywhere

BUCKET, FINISH, ABORT, PATCH = 1, 2, 3, 4
CLOSE = "close"
DELTA = "delta"
"""A round key's second word: a delta round (`NetworkCopyTransport`)."""
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
        self.address_file: Path | None = None
        """Where rank 0 published the address (`open_copy_group`), removed at `close`."""
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
            from ..rollout.nccl_sender import nccl_unusable, open_member

            # A member whose NCCL would be disabled never reaches ncclCommInitRank, where the others
            # would then wait without a deadline: every member says first, over gloo (which has one).
            unusable = [(k, why) for k, why in enumerate(self.all_gather_json(nccl_unusable())) if why]
            if unusable:
                raise RuntimeError("the copy group's NCCL cannot form: " + "; ".join(
                    f"{'trainer rank 0' if k == 0 else f'the receiver of rollout node {k - 1}'}: {why}"
                    for k, why in unusable))
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
                    self.close()        # not left in place disabled: a later broadcast would be a no-op
                    raise RuntimeError(f"NCCL broadcast of {t.nbytes} bytes not done after {self.address.timeout_s:.0f}"
                                       " s (a member died or hung): communicator aborted")
                time.sleep(0.001)

    def close(self) -> None:
        """Ends this member's NCCL communicator (a local ncclCommAbort); gloo and the store go with
        the objects."""
        if self.nccl is not None:
            self.nccl.destroy()
            self.nccl = None

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
        self.patches: PatchFiles | None = None
        self.round = 0
        self.failed = False
        """This node's copy of the current round is not whole (its report said why)."""

    def serve(self) -> None:
        """Receive versions until the trainer closes the group; raises when the trainer is gone
        (its store stops answering, or a collective fails or passes its deadline)."""
        try:
            while True:
                said = self._wait(f"round-{self.round + 1}")
                if said == CLOSE:
                    return
                self.round += 1
                version, _, kind = said.partition(" ")
                if self.receive(int(version), kind == DELTA):
                    self.settle()
        finally:
            try:
                if self.patches is not None:
                    self.patches.close()
                self.writer.close()
            finally:
                self.group.close()

    def _wait(self, key: str) -> str:
        """The store's value of `key`, once rank 0 has set it (a step, or the servers' load, may
        take longer than any collective's deadline); raises once rank 0's store is gone."""
        while not self.group.store.check([key]):
            time.sleep(POLL_S)
        return str(self.group.store.get(key).decode())

    def receive(self, version: int, delta: bool) -> bool:
        """One version: buckets (a delta round: its patch files) up to FINISH, then this node's
        report to rank 0. False if rank 0 aborted the round (nothing of it is kept)."""
        if delta:
            if self.writer.latest is None or self.writer.dir is None:
                raise RuntimeError(f"a delta round for version {version}, but this node holds no version")
            self.patches = self.patches or PatchFiles(self.writer.dir, self.writer.segment_bytes)
            self.patches.begin()
        else:
            self.writer.begin(version)
        error: str | None = None
        names: list[str] = []
        buffer: torch.Tensor | None = None
        while True:
            op, meta, nbytes = self.group.header()
            if op == ABORT:
                if not delta:
                    self.writer.abort()
                return False
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
                    names += self._write(op, json.loads(bytes(entries.numpy())), data)
                except Exception as exc:  # noqa: BLE001 -- reported to rank 0 below, raised there
                    error = f"{type(exc).__name__}: {exc}"
        report = self._report(delta, names, error)
        self.failed = report["error"] is not None
        self.group.all_gather_json(report)
        return True

    def _write(self, op: int, meta: Any, data: torch.Tensor) -> list[str]:
        if op == PATCH:                     # [file, size]: a patch file of rank 0's, as it is there
            assert self.patches is not None, "patches come in delta rounds"
            self.patches.put(int(meta[0]), int(meta[1]), data.cpu())
            return []
        tensors = dict(views(meta, [data]))
        self.writer.send_bucket(tensors)
        return list(tensors)

    def _report(self, delta: bool, names: list[str], error: str | None) -> dict[str, Any]:
        """This node's copy of the round (a dense one sealed; a delta one: its segments, still the
        previous version, and its patch files), or why not."""
        report: dict[str, Any] = {"rank": self.group.rank, "pid": os.getpid(), "error": error, "delta": delta}
        if error is not None:
            return report
        try:
            if delta:
                assert self.writer.latest is not None and self.patches is not None
                self.patches.trim()
                base = json.loads(self.writer.latest[1])
                report.update(segments=base["segments"], tensors=base["tensors"],
                              patch_segments=self.patches.manifest(), dir=str(self.writer.dir))
            else:
                manifest, _ = self.writer.seal(names)
                report.update(manifest=manifest, dir=str(self.writer.dir))
        except Exception as exc:      # noqa: BLE001 -- as above
            report["error"] = f"{type(exc).__name__}: {exc}"
        return report

    def settle(self) -> None:
        """After every server's load: a delta round's patches into this node's segments, which then
        hold the new version (rank 0 says which, `apply-<round>`); rank 0 gathers that it did."""
        spec = json.loads(self._wait(f"apply-{self.round}"))
        error = None
        if self.failed:         # this node's copy of the round is not whole: the next one is dense
            self.writer.latest, self.writer.overwritten = None, True
        elif spec.get("patches"):
            try:
                assert self.writer.latest is not None and self.patches is not None
                apply_rows([f.bytes for f in self.writer.files], json.loads(self.writer.latest[1])["tensors"],
                           spec["patches"], [f.bytes for f in self.patches.files])
                self.writer.latest = (int(spec["version"]), self.writer.latest[1], self.writer.latest[2])
            except Exception as exc:  # noqa: BLE001 -- reported to rank 0, raised there
                error = f"{type(exc).__name__}: {exc}"
                self.writer.latest, self.writer.overwritten = None, True
        self.group.all_gather_json({"rank": self.group.rank, "error": error})


class NetworkCopyTransport:
    """Trainer rank 0: streams every version to the rollout nodes' receivers and drives every
    server. `servers[k]` reads the copy of receiver k + 1 (its node's).

    With `delta` (`rollout.sync_delta`), a round may be a delta (`wants_delta`, rank 0's decision,
    which `sync_weights` tells every rank): each owner of a part compares it with its own host copy
    (`owners.py`) and rank 0 collects only the patches (`send_patches`) into patch files of its own
    (`patches`, in its /dev/shm); at the end it streams those files to every receiver, every server
    loads its node's segments (the previous version) with them, and then every receiver writes the
    patches into its copy. A dense round streams every tensor as it comes, as without delta."""

    def __init__(self, servers: Sequence[EngineServer], group: CopyGroup, *, segment_bytes: int,
                 moe_load: str = MOE_LOAD, delta: Mode = "off", dense_every: int = 20) -> None:
        if group.rank != 0 or group.world != len(servers) + 1:
            raise ValueError(f"rank 0 of a group of 1 + {len(servers)} receivers, one per server; got rank "
                             f"{group.rank} of {group.world}")
        self.group, self.capacity = group, segment_bytes
        self.copies = [NodeCopy(k) for k in range(len(servers))]
        self.links = [ShmLink(copy, s, {"moe_load": moe_load}) for copy, s in zip(self.copies, servers)]
        self.policy = DeltaPolicy(delta, dense_every)
        self.owners: OwnerCopy | None = OwnerCopy() if delta != "off" else None
        """Rank 0's own part of the comparison (every owner holds one: `owners.py`)."""
        self.patches: PatchFiles | None = None
        self.rows: list[list[Any]] = []
        self.only: frozenset[str] | None = None
        """The names of the last round that landed (LoRA's touched tensors; None: every tensor)."""
        self.next_only: frozenset[str] | None = None
        self.stats = DeltaStats()
        self.round = self.version = 0
        self.buckets = 0
        self.entries: list[list[Any]] = []
        self.used = 0
        self._buffer: torch.Tensor | None = None
        self.streaming = self.delta = False

    def wants_delta(self, only: set[str] | None = None) -> bool:
        """Whether the next round can be a delta: the policy says so, every node's copy holds the
        last version that landed, and the round sends the same tensors as that one."""
        held = {c.latest[0] if c.latest is not None else None for c in self.copies}
        same = (frozenset(only) if only is not None else None) == self.only
        return self.owners is not None and same and len(held) == 1 and None not in held and \
            self.policy.wants_delta(True)

    def begin(self, version: int, delta: bool = False, only: set[str] | None = None) -> None:
        self.delta, self.stats = delta, DeltaStats(dense=not delta)
        self.next_only = frozenset(only) if only is not None else None
        if delta:
            if self.patches is None:
                self.patches = PatchFiles(Path(tempfile.mkdtemp(prefix=f"{SYNC_PREFIX}{os.getpid()}-patches-",
                                                                dir=_shm_root())), self.capacity)
            self.patches.begin()
            self.rows = []
        self.round += 1
        self.group.store.set(f"round-{self.round}", f"{version} {DELTA}" if self.delta else str(version))
        self.version, self.entries, self.used, self.buckets, self.streaming = version, [], 0, 0, True
        if not self.delta:                # the receivers rewrite theirs in place as the stream arrives
            for copy in self.copies:
                copy.overwritten = copy.latest is not None or copy.overwritten
                copy.latest = None

    def send_bucket(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copies the tensors now (into the bucket buffer; one larger than a bucket goes alone)."""
        assert not self.delta, "a delta round takes patches (send_patches)"
        self._stream(tensors)
        self.stats.bytes += sum(t.nbytes for t in tensors.values())

    def send_patches(self, part: dict[str, torch.Tensor]) -> None:
        """A delta round's patches of a part (`owners.patch_names`), into rank 0's patch files."""
        assert self.delta and self.patches is not None, "begin(delta=True) first"
        where = {t[0]: t for t in self._base()}
        for name, (indices, values) in patch_names(part).items():
            if name not in where:
                raise RuntimeError(f"delta sync: a patch of {name}, which the rollout nodes' copies do not hold")
            _, dtype, shape = where[name][:3]
            values_at = self.patches.write(values.contiguous().view(torch.uint8).cpu())
            if indices is None:
                self.rows.append(PatchEntry(name, dtype, shape, None, values.numel(), (0, 0), values_at).row())
            else:
                indices_at = self.patches.write(indices.contiguous().view(torch.uint8).cpu())
                self.rows.append(PatchEntry(name, dtype, shape, str(indices.dtype).removeprefix("torch."),
                                            indices.numel(), indices_at, values_at).row())
            self.stats.bytes += values.nbytes + (indices.nbytes if indices is not None else 0)

    def _base(self) -> list[list[Any]]:
        """The tensors of the nodes' copies (the last dense round's layout, the same on every node)."""
        latest = self.copies[0].latest
        assert latest is not None, "a delta round needs every node's copy"
        return list(json.loads(latest[1])["tensors"])

    def _stream(self, tensors: dict[str, torch.Tensor]) -> None:
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

    def _send(self, entries: Any, data: torch.Tensor, op: int = BUCKET) -> None:
        meta = torch.frombuffer(bytearray(json.dumps(entries).encode()), dtype=torch.uint8)
        self._collective(self.group.header, op, len(meta), len(data))
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

    def finish(self, names: list[str] | None) -> dict[str, Any]:
        """`names`: every tensor of a dense round (a delta round's are its nodes' copies')."""
        if self.delta:
            assert self.patches is not None
            for k, (size, data) in enumerate(self.patches.used()):
                self._send([k, size], data.to(self.group.device), PATCH)
            names = [t[0] for t in self._base()]
        assert names is not None, "a dense round names its tensors"
        self._flush()
        self._collective(self.group.header, FINISH)
        self.streaming = False
        self._buffer = None         # a bucket on rank 0's GPU only while it streams, not across the step
        reports = self._collective(self.group.all_gather_json, {"rank": 0})[1:]
        landed = False
        try:
            manifests = self._manifests(reports, names)
            results = load_everywhere(self.links, self.version, manifests)
            landed = True
        finally:
            self._settle(landed)
        return {**results[0], "servers": len(results), "receivers": len(reports), "buckets": self.buckets}

    def _manifests(self, reports: list[dict[str, Any]], names: list[str]) -> list[str]:
        """Each server's manifest (its node's files), once every node's copy is whole."""
        problems = [copy_problem(f"rollout node {k} (receiver pid {r.get('pid')})",
                                 r if not r.get("delta") else {**r, "manifest": json.dumps(r)}, names)
                    for k, r in enumerate(reports)]
        if any(problems):
            raise RuntimeError("weight sync: " + "; ".join(p for p in problems if p))
        if not self.delta:
            for copy, r in zip(self.copies, reports):
                copy.latest, copy.overwritten = (self.version, r["manifest"], Path(r["dir"])), False
            return [r["manifest"] for r in reports]
        return [json.dumps({"segments": r["segments"], "tensors": r["tensors"],
                            "patch_segments": r["patch_segments"], "patches": self.rows}) for r in reports]

    def _settle(self, landed: bool) -> None:
        """After the loads: the receivers take a delta round's patches (every receiver is told, also
        after a failure, so that the group stays in step); a round that failed somewhere makes the
        next one dense (a server, or an owner's copy, may hold part of it)."""
        spec = {"version": self.version, "patches": self.rows if self.delta else []}
        self.group.store.set(f"apply-{self.round}", json.dumps(spec))
        self.policy.done(dense=not self.delta)
        self.policy.dense_next = not landed
        if landed:
            self.only = self.next_only
        acks = self._collective(self.group.all_gather_json, {"rank": 0})[1:]
        failed = [f"rollout node {k}: {a['error']}" for k, a in enumerate(acks) if a["error"]]
        for copy, ack in zip(self.copies, acks):
            if self.delta and copy.latest is not None:
                copy.latest = None if ack["error"] else (self.version, copy.latest[1], copy.latest[2])
                copy.overwritten = copy.overwritten or bool(ack["error"])
        if failed:
            raise RuntimeError("weight sync: the patches could not be applied on " + "; ".join(failed))

    def abort(self) -> None:
        """The receivers drop the version (after a failed gather on rank 0's side); nothing if the
        stream itself failed (its group is broken). The owners' copies may be ahead: dense next."""
        self.policy.dense_next = True
        self._buffer = None
        if self.streaming:
            self.streaming = False
            try:
                self.group.header(ABORT)
            except RuntimeError:
                pass          # the error that led here is the one raised

    def close(self) -> None:
        """The receivers return (their copies go with them)."""
        try:
            if self.patches is not None:
                self.patches.close()
                shutil.rmtree(self.patches.dir, ignore_errors=True)
            if self.group.address_file is not None:
                self.group.address_file.unlink(missing_ok=True)
            self.group.store.set(f"round-{self.round + 1}", CLOSE)
        finally:
            self.group.close()


def serve_node_copy(address: CopyGroupAddress, rank: int, segment_bytes: int, shm: Path | None = None,
                    device: torch.device | None = None) -> None:
    """A rollout node's receiver, start to end: join the group (at most `address.timeout_s`), keep
    this node's copy of every version until the trainer closes the group or is gone."""
    NodeCopyReceiver(CopyGroup(address, rank, device), segment_bytes, shm).serve()


# ----------------------------------------------------------------------------- in a run
ADDRESS_FILE = "weight_copy.json"
"""Rank 0's group address, `$MEGATRON_RL_ROLLOUT_SERVERS/weight_copy.json` (a few hundred bytes of
the shared run dir; the weights never go there)."""
RECEIVER_FILE = "weight_copy_receiver.json"
"""Beside a server's `server.json`: a receiver runs on that node (`rollout-server --weight-copy`)."""


def announce_receiver(server_dir: Path) -> None:
    """Before the server publishes itself: rank 0, seeing its server.json, sees this too."""
    files = server_dir / "rollout"
    files.mkdir(parents=True, exist_ok=True)
    (files / RECEIVER_FILE).write_text(json.dumps({"pid": os.getpid(), "hostname": socket.gethostname()}) + "\n")


def receivers_beside(server_dirs: Sequence[Path]) -> bool:
    """Whether every published server has a receiver beside it (none: the shared run dir, the
    fallback); some but not all is an error naming those without."""
    have = [(Path(d) / "rollout" / RECEIVER_FILE).is_file() for d in server_dirs]
    if all(have) or not any(have):
        return bool(have) and all(have)
    without = [Path(d).name for d, h in zip(server_dirs, have) if not h]
    raise ValueError(f"rollout nodes {without} run no weight-copy receiver while the others do: start every "
                     "rollout server with --weight-copy, or none")


def nccl_hosts_problem(trainer_host: str, receiver_hosts: Sequence[str]) -> str | None:
    """Why an NCCL copy group of rank 0 on `trainer_host` and a receiver on each of
    `receiver_hosts` (each on its node's GPU 0) cannot form, or None: two members on one host share
    its GPU 0, which NCCL refuses at init ("Duplicate GPU detected")."""
    seen: dict[str, int] = {}
    for k, h in enumerate(receiver_hosts):
        if h == trainer_host:
            return f"the receiver of rollout node {k} runs on the trainer's host {h!r} (a rollout node is its own host)"
        if h in seen:
            return f"rollout nodes {seen[h]} and {k} both run on host {h!r} (one receiver per node)"
        seen[h] = k
    return None


def open_copy_group(root: Path, server_dirs: Sequence[Path], host: str, timeout_s: float,
                    device: torch.device) -> CopyGroup:
    """Trainer rank 0: publish the group's address under `root` (`$MEGATRON_RL_ROLLOUT_SERVERS`),
    receiver k + 1 for the server of `server_dirs[k]`, and wait (at most `timeout_s`) for all of
    them to join. `device`: where rank 0's data is (CUDA: over NCCL, from each receiver's GPU 0)."""
    if device.type == "cuda":
        hosts = [json.loads((Path(d) / "rollout" / RECEIVER_FILE).read_text())["hostname"] for d in server_dirs]
        problem = nccl_hosts_problem(socket.gethostname(), hosts)
        if problem:
            raise ValueError(f"the rollout nodes' weight copy over NCCL: {problem}")
    address = CopyGroupAddress(host, free_port(host), 1 + len(server_dirs), timeout_s,
                               free_port(host) if device.type == "cuda" else None)
    spec = {"id": f"{socket.gethostname()}-{os.getpid()}-{time.time_ns()}", "host": host, "port": address.port,
            "world": address.world, "timeout_s": timeout_s, "nccl_port": address.nccl_port,
            "ranks": {Path(d).name: k + 1 for k, d in enumerate(server_dirs)}}
    tmp = root / f".{ADDRESS_FILE}.{os.getpid()}"
    tmp.write_text(json.dumps(spec) + "\n")
    tmp.replace(root / ADDRESS_FILE)
    group = CopyGroup(address, 0, device)
    group.address_file = root / ADDRESS_FILE
    return group


def receive_for(root: Path, name: str, segment_bytes: int, alive: Callable[[], bool],
                shm: Path | None = None) -> None:
    """A rollout node's receiver for the life of its server (`alive`): joins each trainer's group
    published under `root` that names `name` (this node's server dir) and keeps this node's copy
    of its versions; a trainer that ends or dies (a resumed run opens a new group) is logged, and
    the next one is waited for."""
    seen: str | None = None
    while alive():
        spec = _address(root / ADDRESS_FILE)
        if spec is None or spec["id"] == seen or name not in spec["ranks"]:
            time.sleep(POLL_S)
            continue
        if not _listening(spec["host"], int(spec["port"])):       # not yet, or an earlier trainer's, gone
            time.sleep(POLL_S)
            continue
        seen = spec["id"]
        device = torch.device("cuda", 0) if spec.get("nccl_port") else None
        address = CopyGroupAddress(spec["host"], int(spec["port"]), int(spec["world"]), float(spec["timeout_s"]),
                                   spec.get("nccl_port"))
        try:
            serve_node_copy(address, int(spec["ranks"][name]), segment_bytes, shm, device)
            print(f"[weight copy] the trainer closed its group {seen}", flush=True)
        except Exception as exc:      # noqa: BLE001 -- the trainer died or failed; wait for the next one
            print(f"[weight copy] the trainer's group {seen} ended: {type(exc).__name__}: {exc}", flush=True)


def _address(path: Path) -> dict[str, Any] | None:
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError):
        return None


def _listening(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2.0):
            return True
    except OSError:
        return False
