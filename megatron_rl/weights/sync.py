"""Weight sync: Megatron shards → full HF-named tensors (the weight map) → buckets → a transport.

Collective over all trainer ranks (TP/EP/PP gathers); only global rank 0 talks to the server.
One layer is gathered at a time, so peak memory is one layer plus one bucket.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from .adapters import WeightAdapter
from .sharding import gather_hf_layers


class Transport(Protocol):
    def begin(self, version: int) -> None: ...

    def send_bucket(self, tensors: dict[str, torch.Tensor]) -> None: ...

    def finish(self, names: list[str]) -> dict[str, Any]: ...

    def abort(self) -> None: ...


class FanoutTransport:
    """The same update to several servers (disaggregated rollout nodes), one after the other."""

    def __init__(self, transports: list[Transport]) -> None:
        self.transports = transports

    def begin(self, version: int) -> None:
        for t in self.transports:
            t.begin(version)

    def send_bucket(self, tensors: dict[str, torch.Tensor]) -> None:
        for t in self.transports:
            t.send_bucket(tensors)

    def finish(self, names: list[str]) -> dict[str, Any]:
        results = [t.finish(names) for t in self.transports]
        return {**results[0], "servers": len(results)}

    def abort(self) -> None:
        for t in self.transports:
            t.abort()


@dataclass
class SyncReport:
    version: int
    tensors: int
    bytes: int
    buckets: int
    seconds: float
    server: dict[str, Any]


def sync_weights(model: torch.nn.Module, adapter: WeightAdapter, transport: Transport | None, version: int,
                 bucket_bytes: int, dtype: torch.dtype) -> SyncReport | None:
    """Send every weight to the server (rank 0 returns the report; other ranks return None)."""
    rank0 = dist.get_rank() == 0
    start = time.perf_counter()
    if rank0:
        assert transport is not None, "rank 0 needs a transport"
        transport.begin(version)
    bucket: dict[str, torch.Tensor] = {}
    size = total = buckets = 0
    names: list[str] = []
    try:
        for layer in gather_hf_layers(model, adapter):
            for hf_name, hf_tensor in layer:
                bucket[hf_name] = hf_tensor.to(dtype)
                size += hf_tensor.numel() * bucket[hf_name].element_size()
                names.append(hf_name)
            if rank0 and size >= bucket_bytes:
                transport.send_bucket(bucket)
                total, buckets, bucket, size = total + size, buckets + 1, {}, 0
        if not rank0:
            return None
        if bucket:
            transport.send_bucket(bucket)
            total, buckets = total + size, buckets + 1
        server = transport.finish(names)
    except BaseException:
        if rank0:
            transport.abort()
        raise
    return SyncReport(version, len(names), total, buckets, time.perf_counter() - start, server)
