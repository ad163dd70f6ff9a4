"""The objectives' table: every RL objective registers here by name; the recipe's
`algorithm.name` (and CHORD's `chord.rl_objective`) picks one.

Importing any module of `megatron_rl.objectives` runs the package's `__init__` first, which imports
every built-in objective, so the table is complete whichever module a caller imports.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from megatron_rl.registry import Registry

if TYPE_CHECKING:
    from megatron_rl.config.schema import AlgorithmConfig
    from megatron_rl.objectives.aggregation import GlobalDenominators
    from megatron_rl.objectives.types import LossInputs, LossOutput


class Objective(Protocol):
    """Signature shared by every registered objective.

    ``step`` (optimizer step) and ``sft_denoms`` are only read by objectives that
    need them (CHORD); the others accept and ignore them so callers can treat all
    objectives alike.
    """

    def __call__(
        self,
        inputs: LossInputs,
        cfg: AlgorithmConfig,
        denoms: GlobalDenominators,
        *,
        step: int = 0,
        sft_denoms: GlobalDenominators | None = None,
    ) -> LossOutput: ...


OBJECTIVES: Registry[Objective] = Registry("objective")


def register_objective(name: str) -> Callable[[Objective], Objective]:
    return OBJECTIVES.register(name)


def get_objective(name: str) -> Objective:
    return OBJECTIVES.get(name)


def available_objectives() -> list[str]:
    return OBJECTIVES.names()
