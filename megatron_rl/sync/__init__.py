"""Weight sync, the trainer's side: Megatron shards → full HF-named tensors (the weight map) → a
transport → every rollout server, through vLLM's weight-transfer routes (`routes.py`).

Collective over all trainer ranks (TP/EP/PP gathers); only global rank 0 talks to the servers.
One part of a layer is gathered at a time and handed to the transport at once. One file per
backend (`rollout.weight_transfer`):

- `shm` (`shm.py`): segment files written once, read by every server's `mrl_shm` engine; CPU and GPU.
  Colocated over several nodes (`nodes.py`), each node's first rank writes its node's copy, from
  rank 0's broadcast: those ranks hold a transport too, and take every part in step. For servers
  on rollout nodes, `network.py` streams each version to a receiver per rollout node, into that
  node's /dev/shm (`rollout-server --weight-copy`; servers without one read the shared run dir).
- `nccl`, `ipc` (`gpu.py`): vLLM's own GPU engines; `nccl`'s delta rounds in vLLM's `sparse_nccl`
  format, compared by the owners of the weights (`owners.py`).

`lora.py` sends only what LoRA adapters change; `verify.py` checks what the servers then compute,
and `diagnose.py` says which tensors arrived altered when that check fails.
The servers' side of each backend is in `rollout/engines/`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Literal, Protocol

import torch
import torch.distributed as dist

from ..megatron.devices import from_rank0
from ..rollout.supervisor import ServerLink
from ..topology import transport_bucket_bytes
from ..weights.map import WeightAdapter
from .delta import Mode
from .gpu import IpcTransport, NcclTransport
from .owners import OwnerCopy
from .routes import EngineServer
from .shm import SharedSegmentTransport

Backend = Literal["shm", "nccl", "ipc"]


class Transport(Protocol):
    """One update at a time: begin → send_bucket* → finish (or abort), on global rank 0 (and on
    the other node senders of `nodes.py`, which get every part too, empty, and return {}).

    What `send_bucket` gets may alias parameters (a part that needs no gather) or be reused by the
    caller afterwards. The `shm` transport copies it into its segments before returning, so each
    gathered part is freed at once and its memory reused (retaining a whole bucket of fresh tensors
    cost more in page faults than the copies themselves). The GPU transports instead hold the
    references until `bucket_bytes` are pending and send them then, in one round per bucket. That is
    safe because nothing writes those tensors before the bucket goes: `finish()`, which sends what
    is still held, runs inside `sync_weights` (no optimizer step in between), itself inside LoRA's
    `merged_deltas` (the merge is undone only after it), and each gathered part is a fresh tensor.
    """

    def begin(self, version: int) -> None: ...

    def send_bucket(self, tensors: dict[str, torch.Tensor]) -> None: ...

    def finish(self, names: list[str]) -> dict[str, Any]: ...

    def abort(self) -> None: ...


@dataclass
class SyncReport:
    version: int
    tensors: int
    bytes: int
    parts: int
    """Hand-overs to the transport: parts of layers (`sharding.GATHER_CHUNK_BYTES`)."""
    seconds: float
    server: dict[str, Any]
    sent: dict[str, Any] | None = None
    """What went to the servers (`delta.DeltaStats.report`: bytes, changed_frac, dense), where the
    transport says (shm); else every byte was sent."""


def sync_weights(model: torch.nn.Module, adapter: WeightAdapter, transport: Transport | None, version: int,
                 dtype: torch.dtype, only: set[str] | None = None) -> SyncReport | None:
    """Send every weight (or the global names in `only`) to the server (rank 0 returns the report;
    other ranks return None)."""
    # megatron-core: imported here, so that the transports stay importable before the entry point's
    # cpu_compat.apply() (the servers' test helpers and benches use them without a model).
    from ..weights.sharding import gather_hf_layers

    rank0 = dist.get_rank() == 0
    start = time.perf_counter()
    assert transport is not None or not rank0, "rank 0 needs a transport"
    if getattr(transport, "owners", None) is not None:
        return _sync_by_owners(model, adapter, transport, version, dtype, only)
    sender = transport      # rank 0's, or another node sender's (`nodes.NodeReceiver`); else None
    if sender is not None:
        sender.begin(version)
    total = sends = 0
    names: list[str] = []
    try:
        for layer in gather_hf_layers(model, adapter, only):
            if sender is None:
                continue
            tensors = {name: tensor.to(dtype) for name, tensor in layer}
            sender.send_bucket(tensors)
            names += tensors
            total += sum(t.nbytes for t in tensors.values())
            sends += 1
        if sender is None:
            return None
        server = sender.finish(names)
    except BaseException:
        if sender is not None:
            sender.abort()
        raise
    if not rank0:
        return None
    stats = getattr(sender, "stats", None)
    sent = stats.report() if stats is not None else None
    return SyncReport(version, len(names), total, sends, time.perf_counter() - start, server, sent)


class OwnerSender:
    """A trainer rank other than 0 in a run whose syncs may be deltas compared by the owners
    (`owners.py`): its own part's host copy, nothing else (rank 0's transport sends)."""

    def __init__(self, whole_past_break_even: bool = True) -> None:
        self.owners = OwnerCopy(whole_past_break_even=whole_past_break_even)

    # A `Transport` by shape; `sync_weights` takes the owners' path before any of these.
    def begin(self, version: int) -> None:
        raise AssertionError("rank 0's transport sends")

    def send_bucket(self, tensors: dict[str, torch.Tensor]) -> None:
        raise AssertionError("rank 0's transport sends")

    def finish(self, names: list[str]) -> dict[str, Any]:
        raise AssertionError("rank 0's transport sends")

    def abort(self) -> None:
        raise AssertionError("rank 0's transport sends")


def _sync_by_owners(model: torch.nn.Module, adapter: WeightAdapter, transport: Any, version: int,
                    dtype: torch.dtype, only: set[str] | None) -> SyncReport | None:
    """`sync_weights` where each owner compares its part with its own host copy (`owners.py`):
    rank 0 decides whether the round is a delta and tells every rank; then the gather carries the
    patches (or, dense, every tensor whole, each owner keeping a copy of what it sent)."""
    from ..weights.sharding import gather_hf_layers

    rank0 = dist.get_rank() == 0
    start = time.perf_counter()
    owners: OwnerCopy = transport.owners
    decision: tuple[bool | None, bool] = (False, False)
    error: BaseException | None = None
    if rank0:
        try:
            decision = _begin_on_rank0(transport, version, only)
        except BaseException as exc:          # every rank is told first (below), not left in the gather
            decision, error = (None, False), exc
    delta, keep = from_rank0(decision)
    if error is not None:
        raise error
    if delta is None:
        raise RuntimeError("weight sync: trainer rank 0 could not begin the round (its log says why)")
    owners.begin()
    on_owner = partial(owners.patches, dtype=dtype) if delta else partial(owners.keep, dtype=dtype, hold=keep)
    names: list[str] = []
    total = sends = 0
    try:
        for layer in gather_hf_layers(model, adapter, only, on_owner=on_owner):
            if not rank0:
                continue
            part = dict(layer)
            if delta:
                transport.send_patches(part)
            else:
                transport.send_bucket(part)
                names += part
            total += sum(t.nbytes for t in part.values())
            sends += 1
        counts = torch.tensor([owners.changed, owners.elements, len(owners.nan)], dtype=torch.int64,
                              device=_device(model))
        dist.all_reduce(counts)                       # the changed fraction of the whole model
        if counts[2]:                                 # every rank stops here, rank 0 closing the round
            mine = f"; this rank's: {', '.join(owners.nan)}" if owners.nan else ""
            raise RuntimeError(f"delta sync: {int(counts[2])} tensor(s) hold NaN (the training diverged){mine}: "
                               "stopping instead of sending them")
        server = transport.finish(None if delta else names) if rank0 else None
    except BaseException:
        if rank0:
            transport.abort()
        raise
    if not rank0:
        return None
    assert server is not None
    stats = transport.stats
    stats.changed, stats.elements = int(counts[0]), int(counts[1])
    tensors = len(names) if not delta else server.get("tensors", 0)
    return SyncReport(version, tensors, total, sends, time.perf_counter() - start, server, stats.report())


def _begin_on_rank0(transport: Any, version: int, only: set[str] | None) -> tuple[bool, bool]:
    """Rank 0 begins a round of the owners' path before any rank enters the gather (a failure there
    — the servers refused, a connect failed — is then told to every rank by the caller, rather than
    rank 0 stopping alone while the others wait in the gather's collectives). Returns (delta, keep:
    the owners keep host copies for later deltas)."""
    delta = transport.wants_delta(only)
    transport.begin(version, delta=delta, only=only)
    # A server that cannot take patches in place (`NcclTransport._ask_in_place`, asked at the
    # connect in this begin) gets whole rounds only: the owners' host copies would serve nothing.
    return delta, delta or not getattr(transport, "in_place_refusal", "")


def _device(model: torch.nn.Module) -> torch.device:
    """Where the model's collectives run (NCCL: its GPU; gloo: the CPU)."""
    return next(model.parameters()).device


def make_transport(backend: Backend, servers: Sequence[EngineServer], sync_root: Path | None,
                   segment_bytes: int, device: torch.device | None = None, *, delta: Mode = "off",
                   dense_every: int = 20) -> tuple[Transport, list[ServerLink]]:
    """The sender rank 0 hands to `sync_weights`, and per server the object its supervisor re-sends
    weights through (`latest`, `resend_latest`, `supervise`, `close`). `segment_bytes` is
    `rollout.sync_bucket_mb` (the GPU backends' bucket, which `ipc` caps). The GPU backends send
    from `device`, by default this rank's current CUDA device (where the gather puts the weights).
    `delta`, `dense_every`: `rollout.sync_delta`, `rollout.sync_dense_every` (shm and nccl; ipc
    sends every version whole)."""
    if device is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    if backend == "shm":
        shared = SharedSegmentTransport(servers, sync_root, segment_bytes=segment_bytes, delta=delta,
                                        dense_every=dense_every)
        return shared, list(shared.links)
    if delta == "on" and backend == "ipc":
        raise ValueError("rollout.sync_delta: 'on' is not supported by weight_transfer 'ipc', which sends every "
                         "version whole (use 'auto': whole there, or 'shm' / 'nccl')")
    if device is None or device.type != "cuda":
        raise ValueError(f"rollout.weight_transfer: {backend!r} sends from a CUDA device; this trainer has "
                         f"{device}. Use 'shm' without GPUs")
    bucket = transport_bucket_bytes(backend, segment_bytes)       # ipc: capped (topology.py says why)
    gpu: NcclTransport | IpcTransport = \
        NcclTransport(servers, device, bucket_bytes=bucket, delta=delta, dense_every=dense_every) \
        if backend == "nccl" else IpcTransport(servers, device, bucket_bytes=bucket)
    return gpu, list(gpu.links)
