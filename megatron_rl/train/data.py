"""Seeded, resumable prompt order over epochs: the state is (epoch, position) and nothing else."""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class DataOrder:
    size: int
    seed: int
    shuffle: bool = True
    epoch: int = 0
    position: int = 0

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(self.size))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def next_indices(self, count: int) -> list[int]:
        """The next `count` prompt indices, continuing into the next epoch when one runs out."""
        out: list[int] = []
        while len(out) < count:
            perm = self._permutation(self.epoch)
            take = min(count - len(out), self.size - self.position)
            out += perm[self.position:self.position + take]
            self.position += take
            if self.position == self.size:
                self.epoch, self.position = self.epoch + 1, 0
        return out

    def state(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position}

    def load(self, state: dict[str, Any]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
