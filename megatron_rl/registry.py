"""`Registry`: the one name → implementation table of the project.

Every pluggable piece a recipe names (objectives, loss aggregation modes, KL estimators, mismatch
corrections, advantage estimators, rewards, model architectures, built-in tasks) is looked up by
name through a `Registry`, so a recipe selects behaviour without if/elif chains and an unknown name
fails loudly with the list of valid choices. Standard library only: the torch-free layers use it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """A named table; `kind` names it in error messages, `error` is what an unknown name raises."""

    def __init__(self, kind: str, items: Mapping[str, T] | None = None, *,
                 error: type[ValueError] = ValueError) -> None:
        self.kind = kind
        self.error = error
        self._items: dict[str, T] = {}
        for name, item in (items or {}).items():
            self.add(name, item)

    def add(self, name: str, item: T) -> T:
        """Register `item` under `name`; registering the same object twice is a no-op."""
        if name in self._items and self._items[name] is not item:
            # Silent replacement would make the behaviour depend on import order.
            raise ValueError(f"{self.kind} {name!r} is already registered")
        self._items[name] = item
        return item

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator form of `add`."""

        def decorator(item: T) -> T:
            return self.add(name, item)

        return decorator

    def get(self, name: str) -> T:
        try:
            return self._items[name]
        except KeyError:
            allowed = ", ".join(self.names()) or "(none registered)"
            raise self.error(f"unknown {self.kind} {name!r}; allowed: {allowed}") from None

    def names(self) -> list[str]:
        return sorted(self._items)

    def items(self) -> Iterator[tuple[str, T]]:
        """(name, item) pairs in name order."""
        return iter(sorted(self._items.items()))

    def __contains__(self, name: object) -> bool:
        return name in self._items
