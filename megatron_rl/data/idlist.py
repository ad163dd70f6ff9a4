"""Question id lists for `--include` / `--exclude` (e.g. article 001's 1,122 of IgakuQA 2023–2025's
1,200 questions): which questions an evaluation counts.

A list is a text file with one id per line (`112A1`, `sp-0001`); blank lines and `#` comments are
ignored, surrounding spaces dropped. An id that is not a question of the gold data is an error at its
file and line (a typo would otherwise change N silently), and so is an id listed twice.
`IdFilter.apply` keeps the included ids (all, without --include), then drops the excluded ones, and
says in one line how many questions remain (`describe`), which the eval commands print.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

from .schema import DataError


def read_id_list(path: str | os.PathLike[str]) -> dict[str, int]:
    """id → line number of a list file."""
    ids: dict[str, int] = {}
    with open(path, encoding="utf-8") as handle:
        for lineno, raw in enumerate(handle, start=1):
            text = raw.split("#", 1)[0].strip()
            if not text:
                continue
            if text in ids:
                raise DataError(f"id {text!r} listed twice (first at line {ids[text]})", path, lineno)
            ids[text] = lineno
    return ids


@dataclass
class IdFilter:
    include: str | None = None
    exclude: str | None = None
    counts: dict[str, int] = field(default_factory=dict)
    dropped: set[str] = field(default_factory=set)
    """The ids `apply` left out (their predictions are not errors)."""

    @property
    def active(self) -> bool:
        return self.include is not None or self.exclude is not None

    def _checked(self, path: str, known: Collection[str]) -> set[str]:
        ids = read_id_list(path)
        for pid, lineno in ids.items():
            if pid not in known:
                raise DataError(f"id {pid!r} is not a question of the gold data", path, lineno)
        return set(ids)

    def apply(self, ids: Iterable[str]) -> list[str]:
        """The ids kept, in their order; `counts` records before / after."""
        order = list(ids)
        known = set(order)
        kept = order
        if self.include is not None:
            wanted = self._checked(self.include, known)
            kept = [pid for pid in kept if pid in wanted]
            self.counts["include_ids"] = len(wanted)
        if self.exclude is not None:
            unwanted = self._checked(self.exclude, known)
            kept = [pid for pid in kept if pid not in unwanted]
            self.counts["exclude_ids"] = len(unwanted)
        self.counts.update(gold=len(order), kept=len(kept))
        self.dropped = known - set(kept)
        return kept

    def describe(self) -> str:
        """"questions: 1200 in the gold data, 1122 counted (--exclude x.txt: 78 ids)"."""
        parts = [f"--include {self.include}: {self.counts['include_ids']} ids"] if self.include else []
        if self.exclude:
            parts.append(f"--exclude {self.exclude}: {self.counts['exclude_ids']} ids")
        lists = f" ({'; '.join(parts)})" if parts else ""
        return f"questions: {self.counts['gold']} in the gold data, {self.counts['kept']} counted{lists}"

    def to_dict(self) -> dict[str, object]:
        return {"include": self.include, "exclude": self.exclude, **self.counts}
