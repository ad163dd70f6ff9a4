"""The weight map's building blocks: HF tensor names ↔ full (unsharded) Megatron-core tensor names.

A map (`WeightAdapter`, built by each model folder's `weights.py` and found through the model
registry, `megatron_rl.models.weight_map`) lists `Entry`s: one Megatron tensor made from one or
more HF tensors (`merge`) and split back (`split`). Names here are *global and unsharded*: layer numbers count over
all pipeline stages and expert numbers over all expert-parallel ranks; `sharding.py` maps them to
one rank's local parameters. The same entries serve checkpoint conversion and weight sync, so a
mapping bug cannot hide in one path only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

Tensor = torch.Tensor
Merge = Callable[[list[Tensor]], Tensor]
Split = Callable[[Tensor], list[Tensor]]


def _one(ts: list[Tensor]) -> Tensor:
    return ts[0]


def _unone(t: Tensor) -> list[Tensor]:
    return [t]


def cat_rows(ts: list[Tensor]) -> Tensor:
    """gate/up → Megatron's fused linear_fc1 = [gate; up]."""
    return torch.cat(ts, dim=0)


def split_rows(parts: int) -> Split:
    return lambda t: list(torch.chunk(t, parts, dim=0))


@dataclass(frozen=True)
class Entry:
    mcore: str
    hf: tuple[str, ...]
    layer: int | None = None
    """Global layer index, or None for embeddings/final norm/output (streamed first/last)."""
    merge: Merge = _one
    split: Split = _unone


def interleave_groups(ts: list[Tensor], groups: int) -> Tensor:
    """Row blocks [a; b; ...] → [a_0, b_0, ..., a_1, b_1, ...]: each tensor cut into `groups` equal row
    blocks, block g of every tensor placed together (dim 0; trailing dims untouched)."""
    tail = ts[0].shape[1:]
    return torch.cat([t.reshape(groups, -1, *tail) for t in ts], dim=1).reshape(-1, *tail)


def split_groups(t: Tensor, groups: int, rows: list[int]) -> list[Tensor]:
    """Inverse of `interleave_groups`: `rows[i]` rows of tensor i per group."""
    tail = t.shape[1:]
    parts = torch.split(t.reshape(groups, sum(rows), *tail), rows, dim=1)
    return [p.reshape(-1, *tail) for p in parts]


def qkv_merge(num_heads: int, num_groups: int, head_dim: int) -> tuple[Merge, Split]:
    """q/k/v → Megatron's linear_qkv, grouped by query group: [q_g (heads/group), k_g, v_g] per group.

    The grouping is what lets Megatron split the fused tensor over TP with a contiguous slice.
    """
    per_group = num_heads // num_groups

    def merge(ts: list[Tensor]) -> Tensor:
        return interleave_groups(ts, num_groups)

    def split(t: Tensor) -> list[Tensor]:
        return split_groups(t, num_groups, [per_group * head_dim, head_dim, head_dim])

    return merge, split


@dataclass
class WeightAdapter:
    """Entries for one concrete HF config of an architecture."""

    hf_config: dict[str, Any]
    entries: list[Entry] = field(default_factory=list)
    ignored_hf_prefixes: tuple[str, ...] = ()
    """HF tensors the Megatron model has no place for, dropped on import (listed in the log and in
    the converted checkpoint) and absent on export, e.g. Qwen3-Next's `mtp.*`."""

    def __post_init__(self) -> None:
        self._by_mcore = {e.mcore: e for e in self.entries}
        self._by_hf = {name: e for e in self.entries for name in e.hf}

    def entry_for_mcore(self, name: str) -> Entry:
        try:
            return self._by_mcore[name]
        except KeyError:
            raise KeyError(f"no weight-map entry for Megatron tensor {name!r}") from None

    def entry_for_hf(self, name: str) -> Entry | None:
        return self._by_hf.get(name)

    def is_ignored_hf(self, name: str) -> bool:
        return name.startswith(self.ignored_hf_prefixes) if self.ignored_hf_prefixes else False

    def hf_names(self) -> list[str]:
        return [n for e in self.entries for n in e.hf]

    def to_mcore(self, entry: Entry, hf_tensors: dict[str, Tensor]) -> Tensor:
        return entry.merge([hf_tensors[n] for n in entry.hf])

    def to_hf(self, entry: Entry, tensor: Tensor) -> Iterator[tuple[str, Tensor]]:
        parts = entry.split(tensor)
        if len(parts) != len(entry.hf):
            raise ValueError(f"{entry.mcore}: split into {len(parts)} tensors, expected {len(entry.hf)}")
        yield from zip(entry.hf, parts)

    def layers(self) -> list[int | None]:
        """Stream order: global tensors first, then one layer at a time."""
        seen: list[int | None] = []
        for e in self.entries:
            if e.layer not in seen:
                seen.append(e.layer)
        return seen
