"""Errors of recipe loading: each problem names its source (file:line or CLI override) and key."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    where: str
    """'recipes/x.yaml:12', 'override #2 (trainer.lr=...)' or '' when unknown."""
    key: str
    """Dotted key path, e.g. 'algorithm.clip_eps_high'."""
    message: str

    def __str__(self) -> str:
        prefix = f"{self.where}: " if self.where else ""
        return f"{prefix}{self.key}: {self.message}" if self.key else f"{prefix}{self.message}"


class ConfigError(ValueError):
    """One or more problems in a recipe; `str()` lists each on its own line."""

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = problems
        super().__init__("\n".join(str(p) for p in problems))
