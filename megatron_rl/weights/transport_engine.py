"""Weight sync driven through vLLM's weight-transfer engine routes, for every backend.

The trainer side of one sync is the same whatever carries the bytes: per server, /pause (waiting
for requests in flight) → /init_weight_transfer_engine (once per server process) →
/start_weight_update → /update_weights (one or more) → /finish_weight_update (with the version)
→ /reset_prefix_cache (KV blocks of the old weights) → /resume, and the workers' own report of
what they loaded (`mrl_loaded`: all workers must agree). Backends (`rollout.weight_transfer`):

- `shm`: vLLM engine `mrl_shm` (`rollout/weight_engine.py`). Rank 0 writes the tensors ONCE into
  segment files (`FileTransport`: /dev/shm, rewritten in place; or a fresh directory per version
  on the file system the rollout nodes share) and every server loads the same manifest. Runs on
  CPU and GPU; the only backend a restarted server can be brought back with (the bytes stay).
- `nccl`, `ipc`: vLLM's own GPU engines (`transport_gpu.py`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

import torch

from .transport_file import ControlEndpoint, FileTransport, _direct, one_result

if TYPE_CHECKING:
    from .sync import Transport  # imports megatron-core (cpu_compat first); only its protocol is needed

Backend = Literal["shm", "nccl", "ipc"]
MOE_LOAD = "in_place"
"""How CPU workers load fused-MoE experts (`rollout/weight_engine.py`, `ShmInitInfo.moe_load`; GPU
workers always reload layer-wise). In place: steady sync of the 491 MB bench MoE 0.48 s vs 0.53 s
layer-wise, server load 0.30 s vs 0.34 s (bench/sync_bench.py --moe-load, one shared 2-core VM)."""


class EngineServer(ControlEndpoint, Protocol):
    """A rollout server as the weight-transfer driver sees it (`RolloutServer`)."""

    restarts: int
    token: str

    @property
    def base_url(self) -> str: ...


class EngineLink:
    """The weight-transfer routes of one server; `supervise` wraps each whole round (a server that
    dies under it is restarted and the round redone from /pause)."""

    def __init__(self, server: EngineServer, init_info: dict[str, Any] | None = None) -> None:
        self.server = server
        self.init_info = init_info or {}
        self.supervise: Callable[..., Any] = _direct
        self._ready_for: int | None = None
        """`server.restarts` when the engine was initialised: a restarted server needs it again."""

    def init_engine(self, init_info: dict[str, Any] | None = None) -> None:
        self.server.post("/init_weight_transfer_engine", {"init_info": self.init_info if init_info is None
                                                          else init_info})
        self._ready_for = self.server.restarts

    def start(self) -> None:
        """Pause and open an update; the caller sends, then calls `finish` (or `resume`)."""
        self.server.post("/pause", params={"mode": "wait"})
        try:
            if self._ready_for != self.server.restarts:
                self.init_engine()
            self.server.post("/start_weight_update")
        except BaseException:
            self.server.post("/resume")
            raise

    def update(self, update_info: dict[str, Any]) -> None:
        self.server.post("/update_weights", {"update_info": update_info})

    def finish(self, version: int) -> dict[str, Any]:
        """Close the update, drop the KV cache of the old weights, resume; what the workers loaded."""
        try:
            self.server.post("/finish_weight_update", {"weight_version": str(version)})
            loaded = one_result(self.server.rpc("mrl_loaded"))
            self.server.post("/reset_prefix_cache")
        finally:
            self.server.post("/resume")
        return loaded

    def round(self, version: int, updates: Sequence[dict[str, Any]]) -> dict[str, Any]:
        self.start()
        try:
            for update in updates:
                self.update(update)
        except BaseException:
            self.server.post("/resume")
            raise
        return self.finish(version)


class ShmLink(EngineLink):
    """One server reading the shared segments; what its supervisor re-sends after a restart."""

    def __init__(self, shared: SharedSegmentTransport, server: EngineServer, init_info: dict[str, Any]) -> None:
        super().__init__(server, init_info)
        self.shared = shared

    @property
    def latest(self) -> tuple[int, str, Path] | None:
        return self.shared.latest

    def load(self, version: int, manifest: str) -> dict[str, Any]:
        spec = json.loads(manifest)
        result = self.round(version, [{"version": version, "segments": spec["segments"], "tensors": spec["tensors"]}])
        if result.get("version") != version or result.get("tensors") != len(spec["tensors"]):
            raise RuntimeError(f"{getattr(self.server, 'base_url', 'server')}: loaded {result}, sent version "
                               f"{version} with {len(spec['tensors'])} tensors")
        return result

    def resend_latest(self) -> dict[str, Any] | None:
        """The latest complete update again (a restarted server); None if there was none."""
        if self.shared.latest is None:
            if self.shared.overwritten:
                raise RuntimeError("the latest weights were partly overwritten by an update that did not "
                                   "finish; a full sync is needed")
            return None
        version, manifest, _ = self.shared.latest
        return self.load(version, manifest)

    def close(self) -> None:
        self.shared.close()


class SharedSegmentTransport(FileTransport):
    """Write once, read by all: one copy of each version, the same manifest to every server."""

    def __init__(self, servers: Sequence[EngineServer], root: Path | None = None,
                 segment_bytes: int = 512 << 20, moe_load: str = MOE_LOAD) -> None:
        super().__init__(servers[0], root, segment_bytes)
        self.links = [ShmLink(self, s, {"moe_load": moe_load}) for s in servers]

    def _deliver(self, version: int, manifest: str) -> dict[str, Any]:
        results = [link.supervise("the weight sync", link.load, version, manifest) for link in self.links]
        return {**results[0], "servers": len(results)}

    def resend_latest(self) -> dict[str, Any] | None:
        results = [link.resend_latest() for link in self.links]
        return results[0]


def make_transport(backend: Backend, servers: Sequence[EngineServer], sync_root: Path | None,
                   segment_bytes: int, device: torch.device | None = None) -> tuple[Transport, list[Any]]:
    """The sender rank 0 hands to `sync_weights`, and per server the object its supervisor re-sends
    weights through (`latest`, `resend_latest`, `supervise`, `close`). The GPU backends send from
    `device`, by default this rank's current CUDA device (where the gather puts the weights)."""
    if device is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    if backend == "shm":
        shared = SharedSegmentTransport(servers, sync_root, segment_bytes)
        return shared, list(shared.links)
    from .transport_gpu import IpcTransport, NcclTransport

    if device is None or device.type != "cuda":
        raise ValueError(f"rollout.weight_transfer: {backend!r} sends from a CUDA device; this trainer has "
                         f"{device}. Use 'shm' without GPUs")
    gpu = NcclTransport(servers, device, bucket_bytes=segment_bytes) if backend == "nccl" else \
        IpcTransport(servers, device, segment_bytes)
    return gpu, list(gpu.links)
