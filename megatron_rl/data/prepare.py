"""Write RL prompt / SFT JSONL files from the raw sources (`megatron-rl data prepare ...`).

Each source's preparation lives with its task (`megatron_rl/tasks/<name>/`: `igakuqa/prepare.py`,
`medmcqa/data.py`, `medxpertqa/data.py`); `megatron-rl data prepare <source>` calls it. Here: the
result every preparation returns and writes (`PrepareResult`: files, counts, exclusions, read
statistics, one `<name>_prepare.json` summary), and the task-free CHORD preparation
(`prepare_chord_sft`: chord_sft.jsonl, expert rows for `data.sft_path`, from the CHORD expert-text
format of `data/chord_sft.py`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_rl.data.chord_sft import held_out_questions, read_expert_texts, sft_rows
from megatron_rl.data.schema import ReadStats, write_jsonl


@dataclass
class PrepareResult:
    files: dict[str, str] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    excluded: dict[str, int] = field(default_factory=dict)
    read_stats: list[dict[str, Any]] = field(default_factory=list)
    years: dict[str, list[int]] = field(default_factory=dict)
    notes: dict[str, Any] = field(default_factory=dict)
    """Source-specific decisions worth a line (e.g. MedMCQA's `cop` base and how it was found)."""

    @property
    def skipped_lines(self) -> int:
        return sum(s["skipped"] for s in self.read_stats)

    def to_dict(self) -> dict[str, Any]:
        return {"files": self.files, "counts": self.counts, "excluded": self.excluded,
                "years": self.years, "notes": self.notes,
                "skipped_lines": self.skipped_lines, "read_stats": self.read_stats}

    def write(self, out: str | os.PathLike[str], name: str, records: list[Any]) -> None:
        """`<out>/<name>.jsonl`, counted and listed under `name`."""
        path = Path(out) / f"{name}.jsonl"
        self.counts[name] = write_jsonl(path, records)
        self.files[name] = str(path)

    def write_summary(self, path: Path) -> None:
        """This result as JSON (the `<name>_prepare.json` next to the data files)."""
        path.write_text(json.dumps(self.to_dict(), ensure_ascii=False, indent=2) + "\n",
                        encoding="utf-8")
        self.files["summary"] = str(path)


def prepare_chord_sft(src: str | os.PathLike[str], out: str | os.PathLike[str], *, parts: int | None = None,
                      system_prompt: str = "", exclude: Iterable[str | os.PathLike[str]] = (),
                      limit: int | None = None, on_malformed: str = "error") -> PrepareResult:
    """Expert texts (the CHORD expert-text format, `data/chord_sft.py`) → chord_sft.jsonl for
    `data.sft_path`."""
    stats = ReadStats(str(src))
    texts = read_expert_texts(src, on_malformed=on_malformed, stats=stats)
    excluded_files = [str(p) for p in exclude]
    rows, left_out = sft_rows(texts, parts=parts, system_prompt=system_prompt,
                              exclude=held_out_questions(excluded_files) if excluded_files else None, limit=limit)
    result = PrepareResult(excluded=left_out, read_stats=[stats.to_dict()])
    result.notes = {"parts": parts, "system_prompt": system_prompt, "excluded_prompt_files": excluded_files,
                    "limit": limit}
    result.write(out, "chord_sft", rows)
    result.write_summary(Path(out) / "chord_sft_prepare.json")
    return result
