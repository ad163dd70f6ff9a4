"""An append-only JSONL output that a killed run resumes: every row is one `write` of a whole line,
flushed and fsynced before the next is made, so a crash loses at most the row being written.

On open, the rows already there are read back (`done`: their ids); a last line without its newline
is the one a crash cut, and is cut off (`torn` says so) so that the run writes it again whole. A
complete line that is not a JSON object with a str `id` is an error at its file and line: the file
is not this command's output, and appending to it would mix two things. A resumed run skips the ids
in `done`, so no row is written twice.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import IO, Any

from .schema import DataError


class ResumableJsonl:
    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.done: set[str] = set()
        self.torn = 0
        """Bytes cut off the end on open (a row a crash left half written)."""
        if self.path.exists():
            self._read_back()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._handle: IO[str] = open(self.path, "a", encoding="utf-8")

    def _read_back(self) -> None:
        data = self.path.read_bytes()
        end = data.rfind(b"\n") + 1
        if end < len(data):
            self.torn = len(data) - end
            with open(self.path, "r+b") as handle:
                handle.truncate(end)
        for lineno, raw in enumerate(data[:end].splitlines(), start=1):
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise DataError(f"not a row of this output ({exc}); use another --out", self.path, lineno) from None
            if not isinstance(obj, dict) or not isinstance(obj.get("id"), str):
                raise DataError("not a row of this output (no str 'id'); use another --out", self.path, lineno)
            if obj["id"] in self.done:
                raise DataError(f"id {obj['id']!r} appears twice", self.path, lineno)
            self.done.add(obj["id"])

    def append(self, row: dict[str, Any]) -> None:
        """One row, on disk before this returns."""
        if row["id"] in self.done:
            raise ValueError(f"row {row['id']!r} is already in {self.path}")
        self._handle.write(json.dumps(row, ensure_ascii=False) + "\n")
        self._handle.flush()
        os.fsync(self._handle.fileno())
        self.done.add(row["id"])

    def close(self) -> None:
        self._handle.close()

    def __enter__(self) -> ResumableJsonl:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
