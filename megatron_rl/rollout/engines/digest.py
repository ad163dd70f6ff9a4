"""Checksums of weight tensors, the same on the trainer's and the servers' side, and the servers'
record of what one update delivered (no vLLM imports here: the trainer imports this too).

A failed verification gate (`sync/verify.py`) re-sends the weights once with both sides
checksumming (`sync/diagnose.py`): the trainer each tensor it hands its transport, every vLLM
worker each tensor it hands `model.load_weights` (`digested`, `loads_recorded`, armed by
`WorkerExtension.mrl_digest_arm`). Nothing is computed unless armed, so a correct sync costs nothing.

The checksum is exact integer arithmetic on the bytes, H = Σ bᵢ·wᵢ mod P with a weight wᵢ that
depends on the byte's position, so it is the same on any device and in any reduction order (the
trainer's GPU, a CPU worker), and it changes when bytes move (a row swap, a wrong shard order),
which a norm or a plain sum cannot see. The float64 sum of squares of the values is kept beside
it: equal sums with different checksums say the values moved rather than changed.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple, cast

import torch

P = 2**31 - 1
"""The checksum's modulus (a prime: every weight below it is invertible, so a single changed
byte always changes the checksum)."""
A = 16_777_213
"""Position weight wᵢ = (A·i mod P) + 1: A < 2²⁴ keeps A·i exact in int64 for i < 2³⁸ bytes."""
CHUNK_BYTES = 1 << 23
"""Bytes per reduction: a chunk's Σ bᵢ·wᵢ < 2⁸·2³¹·2²³ = 2⁶² stays exact in int64, and its
int64 temporaries (~4 × 64 MiB) fit beside a trainer's weights on its GPU."""


class Digest(NamedTuple):
    dtype: str
    shape: list[int]
    checksum: int
    sumsq: float
    """Σ x² in float64 (NaN for a non-finite tensor); equal up to summation order on both sides."""


def tensor_digest(t: torch.Tensor, chunk_bytes: int = CHUNK_BYTES, device: torch.device | None = None) -> Digest:
    """The digest of `t`'s bytes and values, computed on `device` (default: `t`'s own; a CPU tensor
    is then copied there one chunk at a time); one host sync at the end."""
    flat = t.detach().contiguous().reshape(-1)
    on = flat.device if device is None else device
    step = max(1, chunk_bytes // max(1, flat.element_size()))
    total = torch.zeros((), dtype=torch.int64, device=on)
    sumsq = torch.zeros((), dtype=torch.float64, device=on)
    for start in range(0, flat.numel(), step):
        part = flat[start:start + step].to(on)
        b = part.view(torch.uint8).to(torch.int64)
        first = start * flat.element_size()
        w = torch.arange(first, first + b.numel(), dtype=torch.int64, device=b.device).mul_(A).remainder_(P).add_(1)
        total = (total + b.mul_(w).sum().remainder(P)).remainder(P)
        sumsq += part.double().square().sum()
    return Digest(str(t.dtype).removeprefix("torch."), list(t.shape), int(total), float(sumsq))


RECEIVED: dict[str, Any] = {"armed": False, "digests": {}}
"""This worker process's record: whether the next update's tensors are checksummed, and their
digests by the name they were loaded under."""


def arm() -> None:
    """Checksum every tensor loaded from now on (until `take`)."""
    RECEIVED.update(armed=True, digests={})


def take() -> dict[str, Digest]:
    """What was recorded since `arm`; disarms."""
    digests = RECEIVED["digests"]
    RECEIVED.update(armed=False, digests={})
    return dict(digests)


def digested(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """`weights` as they are, each recorded on its way to `load_weights`, before the load can
    change or release it (vLLM's packed NCCL consumer reuses its buffers)."""
    # On a GPU worker the `shm` engine hands over host views: hashing them on the host ran at
    # ~10 MB/s per thread (vLLM leaves torch one thread), hours for a 235B update; its GPU is fast.
    # A tensor already on a GPU is hashed where it is.
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    for name, tensor in weights:
        RECEIVED["digests"][name] = tensor_digest(tensor, device=None if tensor.is_cuda else device)
        yield name, tensor


@contextmanager
def loads_recorded(model: torch.nn.Module) -> Iterator[None]:
    """While armed, every `model.load_weights(weights)` records `weights` (vLLM's own nccl and ipc
    engines call `self.model.load_weights` themselves, so the record sits on the model)."""
    if not RECEIVED["armed"]:
        yield
        return
    own = model.__dict__.get("load_weights")      # restored as it was (None: the class's method)
    load = cast(Any, model).load_weights      # vLLM models define it; nn.Module does not
    model.__dict__["load_weights"] = lambda weights: load(digested(weights))
    try:
        yield
    finally:
        if own is None:
            del model.__dict__["load_weights"]
        else:
            model.__dict__["load_weights"] = own
