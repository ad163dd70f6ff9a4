"""Name → implementation registries.

Every pluggable piece of the loss (objectives, aggregation modes, KL estimators,
mismatch corrections, advantage estimators) is looked up by name through a
:class:`Registry`, so recipe configs select behaviour without if/elif chains and
an unknown name fails loudly with the list of valid choices.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

if TYPE_CHECKING:
    from megatron_rl.config.schema import AlgorithmConfig
    from megatron_rl.objectives.aggregation import GlobalDenominators
    from megatron_rl.objectives.types import LossInputs, LossOutput

T = TypeVar("T")


class Registry(Generic[T]):
    """A named table of callables; ``kind`` names the table in error messages."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def decorator(item: T) -> T:
            if name in self._items:
                # Silent replacement would make the behaviour depend on import order.
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._items[name] = item
            return item

        return decorator

    def get(self, name: str) -> T:
        try:
            return self._items[name]
        except KeyError:
            raise ValueError(
                f"unknown {self.kind} {name!r}; allowed: {', '.join(self.names())}"
            ) from None

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items


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
    # Importing the package registers the built-in objectives; doing it here lets
    # callers import only this module without ending up with an empty table.
    import megatron_rl.objectives  # noqa: F401

    return OBJECTIVES.get(name)


def available_objectives() -> list[str]:
    import megatron_rl.objectives  # noqa: F401

    return OBJECTIVES.names()
