"""Who sends which tensor to global rank 0, and in which part: the plan of the weight gather
(`sharding.gather_to_rank0`) as pure functions, checked on CPU for every production layout.

Rank 0 learns every rank's (name, shape, dtype) through an object collective, cuts them into parts
of about `chunk_bytes`, and broadcasts that plan. Then, part by part, each rank sends the tensors it
owns in that part, and rank 0 receives them into buffers of exactly their shape: the bytes moved are
the tensors' own bytes, no padding. A gather collective (`dist.gather`) would pad every rank's
contribution to the largest one; a part usually holds one rank's tensors, so that would move up to
a world size more bytes.

The transfers of one part are one batch of point-to-point ops (`dist.batch_isend_irecv`). Which
NCCL communicator carries a point-to-point op is torch's choice (`ProcessGroupNCCL::pointToPoint`):
a batch always uses the group's own communicator; a lone `send`/`recv` does too when the group has
a bound device (`init_process_group(device_id=...)`, as `megatron/devices.init_distributed` does on
GPU), but in lazy-init mode it creates a 2-rank communicator per pair: 63 on rank 0 of an 8 × 8
world, each with its own buffers on GPU 0 beside a colocated vLLM. Batches stay off that path
whatever the init, and rank 0 posts a part's receives from all its senders at once.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

Owned = tuple[str, tuple[int, ...], Any]
"""(global name, shape, dtype) of one tensor a rank owns; dtype has `itemsize` (a torch.dtype)."""
Spec = tuple[int, str, tuple[int, ...], Any]
"""(source rank, global name, shape, dtype) of one tensor on its way to rank 0."""

T = TypeVar("T")


def runs(items: Sequence[T], nbytes: Callable[[T], int], limit: int) -> list[list[T]]:
    """Consecutive runs of at most `limit` bytes (a bigger item alone)."""
    out: list[list[T]] = []
    size = limit
    for item in items:
        n = nbytes(item)
        if size + n > limit or not out:
            out.append([])
            size = 0
        out[-1].append(item)
        size += n
    return out


def spec_nbytes(spec: Spec) -> int:
    return math.prod(spec[2]) * spec[3].itemsize


def owner_conflict(specs: Sequence[Sequence[Owned]]) -> str | None:
    """The first tensor two ranks both claim (`LocalParam.owns` must pick one), as a message."""
    seen: dict[str, int] = {}
    for src, got in enumerate(specs):
        for name, _, _ in got:
            if name in seen:
                return f"{name} is owned by ranks {seen[name]} and {src}; `LocalParam.owns` must pick one"
            seen[name] = src
    return None


def plan_parts(specs: Sequence[Sequence[Owned]], chunk_bytes: int) -> list[list[Spec]] | str:
    """Rank 0's plan from every rank's owned tensors (`specs[rank]`, in that rank's order): parts
    of at most `chunk_bytes` (a bigger tensor alone), ranks in order. A message instead when two
    ranks claim one tensor."""
    conflict = owner_conflict(specs)
    if conflict is not None:
        return conflict
    return runs([(src, *owned) for src, got in enumerate(specs) for owned in got], spec_nbytes, chunk_bytes)


def sends(part: Sequence[Spec], rank: int) -> list[Spec]:
    """What `rank` (not 0) sends to rank 0 in this part, in plan order: the order rank 0 posts its
    receives from `rank` in, which is how a batch matches several ops between one pair."""
    if rank == 0:
        return []
    return [s for s in part if s[0] == rank]


def receives(part: Sequence[Spec]) -> list[Spec]:
    """What rank 0 receives in this part, in plan order (its own tensors stay where they are)."""
    return [s for s in part if s[0] != 0]


def rank0_peers(plan: Sequence[Sequence[Spec]]) -> list[int]:
    """The ranks rank 0 receives from over a whole plan: as many 2-rank NCCL communicators as
    unbatched lazy-init `send`/`recv` would create on rank 0; batched ones create none."""
    return sorted({s[0] for part in plan for s in receives(part)})
