"""GPU weight transports through vLLM's own engines: `nccl` (broadcast) and `ipc` (CUDA IPC).

Both are driven by the same routes as the `shm` backend (`routes.EngineLink`), from global
rank 0, which holds each part of a layer in full on its GPU after the gather (`sync_weights`).
Every tensor is sent from `self.device`, the device given at construction (rank 0's own).

- `nccl`: ONE NCCL group for all servers: the trainer is rank 0, the workers of server k follow
  at `rank_offset` = 1 + the world sizes of servers 0..k-1 (`/get_world_size`), so every server
  receives one broadcast of each part: one send for any number of servers. `/update_weights`
  blocks until the broadcast completes, so it is posted on a thread per server, then the trainer
  broadcasts (packed into vLLM's buffers, the same geometry as the workers' consumer).
- `ipc`: colocated servers on rank 0's node. vLLM's workers rebuild each tensor from a CUDA IPC
  handle on their own GPU (keyed by its UUID), so rank 0 copies each tensor once to every GPU a
  worker uses (peer copies) and ships the handles, pickled: the server must run with
  VLLM_ALLOW_INSECURE_SERIALIZATION=1 (`RolloutServer.environment`). Under DP > 1 /collective_rpc
  answers for engine 0's workers only, so the other engines' GPUs come from the DP layout
  (`topology.ipc_devices`). One node only (lint: `weight-transfer`).

With DP > 1 /collective_rpc answers with engine 0's workers only, so what every worker loaded is
checked in the workers themselves (`mrl_check_loaded`, `routes.EngineLink.finish`; audit-2 #13), as
is the commit; vLLM's /update_weights and /finish_weight_update reach every engine.

Neither keeps a copy of the weights, so a restarted server cannot be brought back to them here:
`resend_latest` raises (the run stops; resuming from the checkpoint syncs again).
"""

from __future__ import annotations

import base64
import math
import pickle
import socket
import threading
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any
from urllib.parse import urlsplit

import httpx
import torch

from ..ports import free_port
from ..rollout.nccl_sender import PACKED_BUFFER_BYTES, PACKED_BUFFERS, broadcast, broadcast_patches, open_group
from ..topology import ipc_devices
from .delta import DeltaPolicy, DeltaStats, Mode
from .owners import OwnerCopy, patch_names
from .routes import EngineLink, EngineServer, on_every_server, one_result, round_deadline_s


def _meta(tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    return {"names": list(tensors), "dtype_names": [str(t.dtype).removeprefix("torch.") for t in tensors.values()],
            "shapes": [list(t.shape) for t in tensors.values()]}


def world_size(server: EngineServer) -> int:
    """Workers of a server across its data-parallel replicas (its ranks in the NCCL group)."""
    resp = httpx.get(server.base_url + "/get_world_size", params={"include_dp": "true"}, timeout=60,
                     headers={"Authorization": f"Bearer {server.token}"})
    resp.raise_for_status()
    return int(resp.json()["world_size"])


SparsePatch = tuple[str, torch.Tensor, torch.Tensor, tuple[int, ...]]
"""(HF name, int32 flat indices, values, full shape): vLLM 0.32's `SparseWeightPatch`
(weight_transfer/sparse_nccl_engine.py), which its trainer engine broadcasts as indices then values."""


def sparse_patches(part: dict[str, torch.Tensor], shapes: dict[str, tuple[int, ...]]) -> list[SparsePatch]:
    """A delta round's patches of a part as rank 0 collected them from their owners
    (`owners.patch_names`: indices and values, or a whole tensor) in vLLM's `sparse_nccl` format,
    on the device they came on. `shapes`: every tensor's full shape, from the last whole round.
    That format has no whole-tensor patch, so a whole one goes as every index (3 × its bf16 bytes:
    a `delta.whole_only` tensor, the short convolution); indices are int32 only (its
    `_validate_patch`), so a tensor of 2³¹ elements or more is refused, naming it."""
    out: list[SparsePatch] = []
    for name, (indices, values) in patch_names(part).items():
        if name not in shapes:
            raise RuntimeError(f"delta sync: a patch of {name}, which the last whole sync did not send")
        if math.prod(shapes[name]) >= 2**31:
            raise ValueError(f"{name}: {math.prod(shapes[name])} elements; sparse_nccl's indices are int32")
        if indices is None:
            indices = torch.arange(values.numel(), dtype=torch.int32, device=values.device)
        out.append((name, indices.to(torch.int32).reshape(-1), values.reshape(-1), shapes[name]))
    return out


def sparse_update_request(patches: Sequence[SparsePatch]) -> dict[str, Any]:
    """The /update_weights body of one sparse round (vLLM's `SparseNCCLWeightTransferUpdateInfo`,
    the same fields its trainer engine's `_broadcast_chunk` builds)."""
    return {"names": [p[0] for p in patches],
            "dtype_names": [str(p[2].dtype).removeprefix("torch.") for p in patches],
            "shapes": [list(p[3]) for p in patches],
            "num_updates_list": [int(p[1].numel()) for p in patches]}


LOOPBACK = ("127.0.0.1", "localhost", "::1")


def master_address(server_hosts: Sequence[str]) -> str:
    """The address the servers' workers dial for rank 0's rendezvous store: loopback when every
    server is on this host, else this host's address on the route to the first remote server
    (the kernel's choice of source; a UDP connect sends nothing). Not gethostbyname(gethostname()):
    hosts that map their name to 127.0.1.1 would send the remote workers to their own loopback."""
    remote = [h for h in server_hosts if h not in LOOPBACK]
    if not remote:
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((remote[0], 9))
        return str(s.getsockname()[0])


SETTLE_S = 0.5
"""How long the first request of an update (and of a connect) may take to be refused before rank 0
enters NCCL: vLLM validates a request before its workers join the collective, and a broadcast that
no worker joins never returns (`PyNcclCommunicator` has no timeout)."""


def _on_threads(calls: Sequence[Callable[[], Any]], main: Callable[[], Any], settle_s: float = 0.0) -> None:
    """Run `calls` on threads while `main` runs here; re-raise the first error of any. An error that
    comes within `settle_s` (or before `main` starts) is raised without running `main`: `main` is a
    collective the failed call's workers will never join."""
    errors: list[BaseException] = []
    failed = threading.Event()

    def wrap(fn: Callable[[], Any]) -> None:
        try:
            fn()
        except BaseException as exc:     # noqa: BLE001 - re-raised below
            errors.append(exc)
            failed.set()

    threads = [threading.Thread(target=wrap, args=(c,), daemon=True) for c in calls]
    for t in threads:
        t.start()
    if failed.wait(settle_s) or errors:
        raise errors[0]           # the other requests end by their own timeouts (daemon threads)
    try:
        main()
    finally:
        for t in threads:
            t.join()
    if errors:
        raise errors[0]


class GpuLink(EngineLink):
    """A server on a GPU transport: nothing to re-send after a restart."""

    latest = None

    def resend_latest(self) -> dict[str, Any] | None:
        raise RuntimeError(f"{getattr(self.server, 'base_url', 'the server')} restarted; the GPU weight transports "
                           "keep no copy of the weights to bring it back with. Resume the run from its checkpoint "
                           "(or use rollout.weight_transfer: shm)")

    def close(self) -> None:
        pass


class _GpuTransport:
    def __init__(self, servers: Sequence[EngineServer], device: torch.device, *, bucket_bytes: int) -> None:
        if device.type != "cuda" or device.index is None:
            raise ValueError(f"a GPU weight transport needs an explicit CUDA device, got {device}")
        self.device = device
        self.links = [GpuLink(s) for s in servers]
        self.version = 0
        self.sent: list[str] = []
        self.bucket_bytes = bucket_bytes
        """Parts are held (on the GPU) until this many bytes are pending, then sent as one bucket
        (rollout.sync_bucket_mb): each bucket is one /update_weights per server, one engine round
        and one device synchronise, instead of one per ~32 MiB gather part (~5,000 round trips per
        80B sync). Holding the references is safe: see `sync.Transport`."""
        self.pending: dict[str, torch.Tensor] = {}
        self.sent_bytes = 0
        """Bytes of this update sent so far (the timeout of its /finish_weight_update)."""
        self.connected_at: list[int] | None = None
        """Each server's restart count when the engines were initialised."""

    def begin(self, version: int) -> None:
        if self.connected_at != [link.server.restarts for link in self.links]:
            self._connect()
            self.connected_at = [link.server.restarts for link in self.links]
        self.version, self.sent, self.pending, self.sent_bytes = version, [], {}, 0
        started: list[GpuLink] = []
        try:
            for link in self.links:
                link.start()
                started.append(link)
        except BaseException:
            # Close the updates already opened (vLLM refuses the next start while one is open: an
            # external server would refuse every later run), each server resumed either way.
            self._finish_quietly(started)
            raise

    def send_bucket(self, tensors: dict[str, torch.Tensor]) -> None:
        self.pending.update(tensors)
        if sum(t.nbytes for t in self.pending.values()) >= self.bucket_bytes:
            self.flush()

    def flush(self) -> None:
        if self.pending:
            tensors, self.pending = self.pending, {}
            self._send(tensors)
            self.sent_bytes += sum(t.nbytes for t in tensors.values())

    def _send(self, tensors: dict[str, torch.Tensor]) -> None:
        raise NotImplementedError

    def finish(self, names: list[str]) -> dict[str, Any]:
        self.flush()
        if sorted(self.sent) != sorted(names):
            raise RuntimeError(f"weight update incomplete: {len(self.sent)} tensors sent, {len(names)} expected")
        return self._close_round()

    def _close_round(self) -> dict[str, Any]:
        """Every server finishes the update and checks that each worker received all `self.sent`
        (loaded them, in a whole round: `rollout/engines/gpu.py` says what a sparse one counts)."""
        def close(link: GpuLink) -> dict[str, Any]:
            # version None: finished, not yet committed (vLLM's GPU engines carry no version)
            link.finish(self.version, self.sent_bytes, expect={"version": None, "tensors": len(self.sent)})
            return one_result(link.server.rpc("mrl_commit_version", str(self.version)))

        # Every server finalises its reloaded layers at once (audit 3 finding 7).
        results = on_every_server([link.server for link in self.links], [partial(close, link) for link in self.links],
                                  "the weight sync's finish", round_deadline_s(self.sent_bytes))
        return {**results[0], "servers": len(results)}

    def abort(self) -> None:
        """Close the servers' updates so they serve again (with a mix of weights: the run is failing)."""
        self.pending = {}
        self._finish_quietly(self.links)

    def _finish_quietly(self, links: Sequence[GpuLink]) -> None:
        """Close these servers' open updates and resume them, whatever each answers."""
        for link in links:
            try:
                link.finish(self.version)
            except Exception:            # noqa: BLE001 - the original error matters more
                pass

    def _connect(self) -> None:
        raise NotImplementedError


class NcclTransport(_GpuTransport):
    """vLLM's `nccl` engine: one broadcast from rank 0's GPU reaches every worker of every server.

    With `delta` (`rollout.sync_delta`), a round may be a delta (`wants_delta`, rank 0's decision,
    which `sync_weights` tells every rank): each owner of a part compares it with its own host copy
    (`owners.py`), the gather brings only the patches to rank 0, and `send_patches` broadcasts them
    in vLLM's `sparse_nccl` format, which every server's `mrl_nccl` engine applies in place through
    vLLM's patch loader (`rollout/engines/gpu.py`). A whole round goes as without delta."""

    def __init__(self, servers: Sequence[EngineServer], device: torch.device, *, bucket_bytes: int,
                 packed: bool = True, master_address: str | None = None, delta: Mode = "off",
                 dense_every: int = 20) -> None:
        super().__init__(servers, device, bucket_bytes=bucket_bytes)
        self.packed = packed
        self.master_address = master_address
        self.comm: Any = None
        self.policy = DeltaPolicy(delta, dense_every)
        self.owners: OwnerCopy | None = OwnerCopy(whole_past_break_even=False) if delta != "off" else None
        """Rank 0's own part of the comparison (every owner holds one: `owners.py`); a tensor
        past the break-even goes as its changed elements, fewer bytes than every index."""
        self.stats = DeltaStats()
        self.delta = False
        self.shapes: dict[str, tuple[int, ...]] = {}
        """Every tensor of the last whole round that landed, by HF name: what the servers hold."""
        self.held_for: tuple[list[int], frozenset[str] | None] | None = None
        """The servers' restart counts and the names sent (None: every tensor) when the last round
        landed; None: the servers may hold a mix (a failed round, a new group)."""
        self.next_only: frozenset[str] | None = None
        self.patches: list[SparsePatch] = []
        self.patch_bytes = 0
        self.round_shapes: dict[str, tuple[int, ...]] = {}
        """The shapes of what this whole round sent so far."""
        self.in_place_refusal = ""
        """Why some server cannot take patches in place ('' none), as they said at the connect."""

    def wants_delta(self, only: set[str] | None = None) -> bool:
        """Whether the next round can be a delta: the policy says so, and every server holds the
        last round that landed (none restarted since), which sent the same tensors as this one."""
        now = ([link.server.restarts for link in self.links], frozenset(only) if only is not None else None)
        return self.owners is not None and not self.in_place_refusal and self.held_for == now and \
            self.policy.wants_delta(True)

    def begin(self, version: int, delta: bool = False, only: set[str] | None = None) -> None:
        super().begin(version)
        self.delta, self.stats = delta, DeltaStats(dense=not delta)
        self.next_only = frozenset(only) if only is not None else None
        self.patches, self.patch_bytes, self.round_shapes = [], 0, {}

    def send_bucket(self, tensors: dict[str, torch.Tensor]) -> None:
        assert not self.delta, "a delta round takes patches (send_patches)"
        super().send_bucket(tensors)
        self.stats.bytes += sum(t.nbytes for t in tensors.values())

    def send_patches(self, part: dict[str, torch.Tensor]) -> None:
        """A delta round's patches of a part (`owners.patch_names`), broadcast once a bucket's worth
        is pending (`bucket_bytes`, as whole tensors are)."""
        assert self.delta, "begin(delta=True) first"
        for patch in sparse_patches(part, self.shapes):
            self.patches.append(patch)
            self.patch_bytes += patch[1].nbytes + patch[2].nbytes
        if self.patch_bytes >= self.bucket_bytes:
            self._flush_patches()

    def _flush_patches(self) -> None:
        if not self.patches:
            return
        local = [(n, i.to(self.device).contiguous(), v.to(self.device).contiguous(), shape)
                 for n, i, v, shape in self.patches]
        nbytes, self.patches, self.patch_bytes = self.patch_bytes, [], 0
        body = sparse_update_request(local)
        _on_threads([partial(link.update, body, nbytes) for link in self.links],
                    partial(broadcast_patches, self.comm, [(i, v) for _, i, v, _ in local], self.device),
                    SETTLE_S if self.sent_bytes == 0 else 0.0)
        self.sent += body["names"]
        self.sent_bytes += nbytes
        self.stats.bytes += nbytes

    def finish(self, names: list[str] | None) -> dict[str, Any]:
        """`names`: every tensor of a whole round (a delta round's are its patches')."""
        try:
            if self.delta:
                self._flush_patches()
                result = self._close_round()
            else:
                assert names is not None, "a whole round names its tensors"
                result = super().finish(names)
        except BaseException:
            self.held_for, self.policy.dense_next = None, True       # a server may hold part of it
            raise
        if not self.delta:
            self.shapes = self.round_shapes
        self.policy.done(dense=not self.delta)
        self.held_for = ([link.server.restarts for link in self.links], self.next_only)
        return result

    def abort(self) -> None:
        """As `_GpuTransport.abort`; the servers (and the owners' copies) may hold part of the
        round: the next one is whole."""
        self.patches, self.patch_bytes = [], 0
        self.held_for, self.policy.dense_next = None, True
        super().abort()

    def _connect(self) -> None:
        self.held_for = None          # a new group: its servers' weights are not known here
        if self.comm is not None:
            for link in self.links:
                link.server.post("/shutdown_weight_transfer_engine")
            comm, self.comm = self.comm, None
            comm.destroy()            # vLLM's PyNcclCommunicator has no __del__: dropped, it would leak
        self._ask_in_place()          # before any engine is tied to this trainer: a refusal leaves none
        sizes = [world_size(link.server) for link in self.links]
        address = self.master_address or master_address([urlsplit(link.server.base_url).hostname or ""
                                                          for link in self.links])
        port = free_port("0.0.0.0")
        common = {"master_address": address, "master_port": port, "world_size": 1 + sum(sizes), "packed": self.packed,
                  "packed_buffer_size_bytes": PACKED_BUFFER_BYTES, "packed_num_buffers": PACKED_BUFFERS}
        offsets = [1 + sum(sizes[:k]) for k in range(len(sizes))]
        calls = [partial(link.init_engine, {**common, "rank_offset": off}) for link, off in zip(self.links, offsets)]
        result: list[Any] = []

        _on_threads(calls, lambda: result.append(open_group(address, port, 1 + sum(sizes), self.device)), SETTLE_S)
        self.comm = result[0]

    def _ask_in_place(self) -> None:
        """Ask every server, before any delta round, whether its workers can take patches in place
        (`WorkerExtension.mrl_in_place_refusal`): a refusal raised inside a round would leave a
        TP > 1 server's workers' replies out of step (vLLM's executor stops reading at the first
        failed one, `multiproc_executor.py`). `rollout.sync_delta: on` then stops the run; `auto`
        sends every version whole, saying why once."""
        if self.owners is None:
            return
        said = sorted({f"{link.server.base_url}: {why}" for link in self.links
                       for why in link.server.rpc("mrl_in_place_refusal") if why})
        refusal = "; ".join(said)
        if refusal and self.policy.mode == "on":
            raise RuntimeError(f"rollout.sync_delta 'on': a server cannot take sparse_nccl patches in place "
                               f"({refusal}); start it with --moe-backend triton or use sync_delta 'auto' (whole "
                               "syncs there)")
        if refusal and refusal != self.in_place_refusal:
            print(f"[weight sync] rollout.sync_delta auto: every version goes whole, the servers cannot take "
                  f"patches in place ({refusal})", flush=True)
        self.in_place_refusal = refusal

    def _send(self, tensors: dict[str, torch.Tensor]) -> None:
        local = {n: t.to(self.device).contiguous() for n, t in tensors.items()}
        meta = _meta(local)
        nbytes = sum(t.nbytes for t in local.values())
        # The first bucket of an update waits for a refusal (a later one repeats an accepted request).
        _on_threads([partial(link.update, meta, nbytes) for link in self.links],
                    partial(broadcast, self.comm, local, self.device, self.packed),
                    SETTLE_S if self.sent_bytes == 0 else 0.0)
        self.sent += meta["names"]
        self.round_shapes.update({n: tuple(t.shape) for n, t in local.items()})


class IpcTransport(_GpuTransport):
    """vLLM's `ipc` engine: workers map rank 0's tensors (copied to their GPUs) by CUDA IPC handle."""

    def __init__(self, servers: Sequence[EngineServer], device: torch.device, *, bucket_bytes: int) -> None:
        super().__init__(servers, device, bucket_bytes=bucket_bytes)
        self.targets: dict[str, torch.device] = {}
        """GPU UUID → this process's device, for every GPU a worker uses."""

    def _connect(self) -> None:
        here = {str(torch.cuda.get_device_properties(i).uuid): torch.device("cuda", i)
                for i in range(torch.cuda.device_count())}
        wanted: set[str] = set()
        for link in self.links:
            reported = [str(u) for u in link.server.rpc("mrl_device_uuid")]     # engine 0's workers only
            missing = set(reported) - set(here)
            if missing:
                raise RuntimeError(f"rollout.weight_transfer 'ipc': the servers' GPUs {sorted(missing)} are not "
                                   "visible to trainer rank 0; ipc needs the servers colocated on its node (else use "
                                   "nccl)")
            try:
                wanted.update(ipc_devices(list(here), world_size(link.server), reported))
            except ValueError as exc:
                raise RuntimeError(f"rollout.weight_transfer 'ipc', {link.server.base_url}: {exc}") from exc
        self.targets = {u: here[u] for u in sorted(wanted)}
        for link in self.links:
            link.init_engine({"packed": False})

    def _send(self, tensors: dict[str, torch.Tensor]) -> None:
        from torch.multiprocessing.reductions import reduce_tensor

        meta = _meta(tensors)
        copies: list[torch.Tensor] = []          # alive until every server has loaded them
        handles: list[dict[str, Any]] = []
        for t in tensors.values():
            per_gpu = {}
            for uuid, dev in self.targets.items():
                c = t.to(dev).contiguous()
                copies.append(c)
                per_gpu[uuid] = reduce_tensor(c)[1]
            handles.append(per_gpu)
        for dev in set(self.targets.values()):
            torch.cuda.synchronize(dev)          # the copies are complete before a worker reads them
        payload = {**meta, "ipc_handles_pickled": base64.b64encode(pickle.dumps(handles)).decode()}
        nbytes = sum(t.nbytes for t in tensors.values())
        for link in self.links:
            link.update(payload, nbytes)
        self.sent += meta["names"]
        del copies
