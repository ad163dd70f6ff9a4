"""A step's R3 routes as the trainer holds them: per sample, vLLM's compact array
[tokens, num_hidden_layers, topk] (`rollout/routes.py`), expanded to the dense
[rows, width, layers, topk] of one micro-batch only when that micro-batch is fed to the routers.

Where they live. Global rank 0 receives every sample's routes from the servers and keeps them
(`hold_on_rank0`); the groups every rank receives carry only each sample's route shape
(`HeldRoutes`). Before each forward the actor sends every data-parallel replica the routes of the
rows it computes (`megatron/route_delivery.py`); a rank holds those and nothing else. A store built
from arrays on every rank (a single process, the tests' batches) is `everywhere`: nothing travels.

Memory (gpu-readiness-audit-2 #15): today's dense batch held `rows × seq_len × (layers × topk ×
itemsize + 1)` bytes on every rank (`planner/host.py::route_host_bytes` counts both forms).

The expansion is bit-identical to `rollout/routes.py::routes_batch` followed by the micro-batch's
row selection and width cut: ids as recorded (uint8, or int16 for vLLM's uint16), each row's
first min(recorded, seq_len) tokens valid; rows without routes (filler rows, CHORD's expert rows,
samples without any) route themselves.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch


@dataclass(frozen=True)
class HeldRoutes:
    """A sample's routes that stay on global rank 0 (which received them from the servers) until the
    ranks that train the sample ask for them; the other ranks know only their shape and dtype."""

    shape: tuple[int, int, int]
    """[tokens, num_hidden_layers, topk] of the recorded array."""
    dtype: str
    """numpy dtype name: 'uint8' up to 256 experts, 'uint16' above."""
    array: np.ndarray | None = field(default=None, compare=False, repr=False)
    """The routes themselves, on rank 0 only (never pickled into the broadcast)."""


def check_routes(i: int, r: np.ndarray, num_layers: int, topk: int, ids: bool = True) -> None:
    """The checks `routes_batch` made: one shape for every sample and, with `ids`, ids that fit the
    trainer's dtype (a pass over the array: made once, where the array arrives)."""
    if r.ndim != 3 or r.shape[1] != num_layers or r.shape[2] != topk:
        raise ValueError(f"sample {i}: routes of shape {tuple(r.shape)}, expected [tokens, {num_layers}, {topk}]")
    if r.dtype not in (np.uint8, np.uint16):
        raise ValueError(f"sample {i}: routes of dtype {r.dtype}, expected vLLM's uint8 or uint16")
    # torch has few uint16 kernels; int16 holds every id of up to 32768 experts.
    if ids and r.dtype == np.uint16 and r.size and int(r.max()) > torch.iinfo(torch.int16).max:
        raise ValueError(f"sample {i}: expert id {int(r.max())} does not fit {torch.int16}")


def hold_on_rank0(groups: Sequence[Any]) -> list[Any]:
    """Rank 0's RolloutGroups as the other ranks receive them: every sample's routes replaced by
    their `HeldRoutes` shape. Rank 0's own samples get the same marker with the array inside, so
    that every rank builds the same kind of store (`RouteRows.of_samples`). The routes are checked
    here: an error surfaces on rank 0 before the broadcast, as any failed rollout does."""
    arrays = [s.routed_experts for g in groups for s in g.samples if isinstance(s.routed_experts, np.ndarray)]
    layers, topk = (arrays[0].shape[1], arrays[0].shape[2]) if arrays and arrays[0].ndim == 3 else (-1, -1)
    out, i = [], 0
    for g in groups:
        samples = []
        for s in g.samples:
            r = s.routed_experts
            if isinstance(r, np.ndarray):
                check_routes(i, r, layers, topk)
                s.routed_experts = HeldRoutes((int(r.shape[0]), int(layers), int(topk)), r.dtype.name, r)
            if isinstance(s.routed_experts, HeldRoutes):      # also a group held before
                r = replace(s.routed_experts, array=None)
            samples.append(replace(s, routed_experts=r))
            i += 1
        out.append(replace(g, samples=samples))
    return out


class RouteStore:
    """One step's routes per sample (each cut to `seq_len` tokens), as this rank holds them."""

    def __init__(self, lengths: list[int], num_layers: int, topk: int, dtype: np.dtype,
                 arrays: dict[int, np.ndarray], everywhere: bool) -> None:
        self.lengths = lengths
        """Valid tokens per sample: min(recorded, seq_len); 0 for a sample without routes."""
        self.num_layers, self.topk, self.dtype = num_layers, topk, np.dtype(dtype)
        self.arrays = arrays
        """Sample → its routes [length, layers, topk] (C-contiguous), those this rank holds."""
        self.everywhere = everywhere
        """Every rank holds every array: delivery sends nothing."""
        self.sent: dict[int, frozenset[int]] = {}
        """Rank 0: the samples each other rank holds (its last delivery's), by global rank."""

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch.uint8 if self.dtype == np.uint8 else torch.int16

    def nbytes(self, samples: Iterable[int]) -> int:
        per_token = self.num_layers * self.topk * self.dtype.itemsize
        return sum(self.lengths[i] for i in samples) * per_token

    def held_bytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())

    def empty(self, sample: int) -> np.ndarray:
        return np.empty((self.lengths[sample], self.num_layers, self.topk), dtype=self.dtype)


@dataclass(frozen=True)
class RouteRows:
    """The routes of a batch's rows: row i is sample `ids[i]` of `store` (-1: no route)."""

    store: RouteStore
    ids: tuple[int, ...]

    @classmethod
    def of_samples(cls, routes: Sequence[np.ndarray | HeldRoutes | None], seq_len: int) -> RouteRows | None:
        """One row per sample; None when no sample has routes. Arrays (held on every rank) make an
        `everywhere` store; `HeldRoutes` (after `hold_on_rank0`) one that rank 0 delivers."""
        first = next((r for r in routes if r is not None), None)
        if first is None:
            return None
        held = isinstance(first, HeldRoutes)
        shape = first.shape if isinstance(first, HeldRoutes) else tuple(first.shape)
        if len(shape) != 3:
            raise ValueError(f"sample 0: routes of shape {shape}, expected [tokens, layers, topk]")
        num_layers, topk = int(shape[1]), int(shape[2])
        dtype = np.dtype(first.dtype)
        lengths, arrays = [], {}
        for i, r in enumerate(routes):
            if isinstance(r, HeldRoutes) != held and r is not None:
                raise ValueError(f"sample {i}: a step's routes are all held on rank 0 or all local")
            if r is None:
                lengths.append(0)
                continue
            array = r.array if isinstance(r, HeldRoutes) else r
            if array is not None:
                check_routes(i, array, num_layers, topk, ids=not held)      # held ones: in `hold_on_rank0`
                if array.dtype != dtype:
                    raise ValueError(f"sample {i}: routes of dtype {array.dtype}, the step's are {dtype}")
            n = min(int(r.shape[0]), seq_len)
            lengths.append(n)
            if array is not None and n:
                arrays[i] = np.ascontiguousarray(array[:n])
        store = RouteStore(lengths, num_layers, topk, dtype, arrays, everywhere=not held)
        return cls(store, tuple(range(len(routes))))

    def __len__(self) -> int:
        return len(self.ids)

    def select(self, rows: Iterable[int]) -> RouteRows:
        """These rows (indices into this view), in this order."""
        return RouteRows(self.store, tuple(self.ids[i] for i in rows))

    def padded(self, rows: int) -> RouteRows:
        """Grown to `rows` rows with route-less rows (the filler rows of a log-prob pass)."""
        return RouteRows(self.store, self.ids + (-1,) * max(0, rows - len(self.ids)))

    def samples(self, rows: Iterable[int] | None = None) -> list[int]:
        """The distinct samples with routes behind `rows` (all rows when None), ascending."""
        ids = self.ids if rows is None else (self.ids[i] for i in rows)
        return sorted({i for i in ids if i >= 0 and self.store.lengths[i] > 0})

    def dense(self, rows: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This view's routes expanded to [rows, width, layers, topk] and their flags [rows, width]:
        row i < len(self) has its sample's first min(length, width) tokens; every other place is a
        zero, not valid. Raises where a sample's routes were not delivered to this rank."""
        s = self.store
        out = torch.zeros(rows, width, s.num_layers, s.topk, dtype=s.torch_dtype)
        valid = torch.zeros(rows, width, dtype=torch.bool)
        for row, sample in enumerate(self.ids[:rows]):
            n = min(s.lengths[sample], width) if sample >= 0 else 0
            if not n:
                continue
            array = s.arrays.get(sample)
            if array is None:
                raise RuntimeError(f"the routes of sample {sample} were not delivered to this rank")
            ids = array[:n] if s.dtype == np.uint8 else array[:n].astype(np.int16)   # < 32768: checked
            out[row, :n] = torch.from_numpy(ids)
            valid[row, :n] = True
        return out, valid
