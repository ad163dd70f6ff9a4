"""One rank's weight sync through a `NetworkCopyTransport` with owner-compared deltas, as
`sync/__init__._sync_by_owners` drives it on a world of one (the transport tests have tensors, not
a model): rank 0 decides, its owner copy keeps or compares each part, the transport sends."""

from __future__ import annotations

from typing import Any

import torch

from megatron_rl.sync.network import NetworkCopyTransport


def owner_sync(transport: NetworkCopyTransport, version: int, state: dict[str, torch.Tensor],
               dtype: torch.dtype, only: set[str] | None = None, per_part: int = 2) -> dict[str, Any]:
    owners = transport.owners
    assert owners is not None, "a transport with delta on"
    delta = transport.wants_delta(only)
    transport.begin(version, delta=delta, only=only)
    owners.begin()
    names = list(state)
    try:
        for start in range(0, len(names), per_part):
            part = {n: state[n] for n in names[start:start + per_part]}
            if delta:
                transport.send_patches(owners.patches(part, dtype))
            else:
                transport.send_bucket(owners.keep(part, dtype))
        transport.stats.changed, transport.stats.elements = owners.changed, owners.elements
        return transport.finish(None if delta else names)
    except BaseException:
        transport.abort()
        raise
