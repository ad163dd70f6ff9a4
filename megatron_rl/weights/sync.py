"""Weight sync: Megatron shards → full HF-named tensors (the weight map) → a transport.

Collective over all trainer ranks (TP/EP/PP gathers); only global rank 0 talks to the server.
One part of a layer is gathered at a time and handed to the transport at once, which copies what
it needs before returning (packing into its buckets or segments is its own business). So the
gathered tensors are freed part by part and their memory is reused: retaining a whole bucket of
fresh tensors cost more in page faults than the copies themselves.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from .map import WeightAdapter
from .sharding import gather_hf_layers


class Transport(Protocol):
    def begin(self, version: int) -> None: ...

    def send_bucket(self, tensors: dict[str, torch.Tensor]) -> None:
        """Take the tensors (copied before returning: they may alias parameters or be reused)."""

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


def sync_weights(model: torch.nn.Module, adapter: WeightAdapter, transport: Transport | None, version: int,
                 dtype: torch.dtype, only: set[str] | None = None) -> SyncReport | None:
    """Send every weight (or the global names in `only`) to the server (rank 0 returns the report;
    other ranks return None)."""
    rank0 = dist.get_rank() == 0
    start = time.perf_counter()
    if rank0:
        assert transport is not None, "rank 0 needs a transport"
        transport.begin(version)
    sender = transport if rank0 else None   # only rank 0 talks to the server
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
    return SyncReport(version, len(names), total, sends, time.perf_counter() - start, server)
