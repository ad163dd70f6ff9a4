"""MedMCQA reader (Pal et al., 2022): one JSON object per line with `question`, `opa`–`opd`,
`cop` (correct option) and optionally `id`, `exp` (explanation), `subject_name`, `topic_name`,
`choice_type`.

`cop` is 1–4 in the original release (1 → "a" … 4 → "d"). The Hugging Face copy stores it 0–3;
read that with `cop_base=0`. A `cop` outside the range is a malformed line, never silently shifted.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from megatron_rl.data.schema import Location, ReadStats, optional, read_jsonl, require

OPTION_KEYS: tuple[str, ...] = ("opa", "opb", "opc", "opd")
LETTERS: tuple[str, ...] = ("a", "b", "c", "d")


@dataclass(frozen=True)
class MedMCQAQuestion:
    id: str
    question: str
    options: tuple[str, str, str, str]
    answer: str
    explanation: str = ""
    subject: str = ""
    topic: str = ""


def _optional_text(obj: dict[str, Any], key: str, loc: Location) -> str:
    # The released files use null for a missing explanation/topic.
    value = optional(obj, key, (str, type(None)), loc, None)
    return value or ""


def _parser(cop_base: int) -> Callable[[dict[str, Any], Location], MedMCQAQuestion]:
    def parse(obj: dict[str, Any], loc: Location) -> MedMCQAQuestion:
        question = require(obj, "question", str, loc)
        options = tuple(require(obj, key, str, loc) for key in OPTION_KEYS)
        cop = require(obj, "cop", int, loc)
        index = cop - cop_base
        if not 0 <= index < len(LETTERS):
            raise loc.error(f"key 'cop' must be in {cop_base}..{cop_base + 3}, got {cop}")
        raw_id = optional(obj, "id", (str, int), loc, None)
        return MedMCQAQuestion(
            id=str(raw_id) if raw_id is not None else f"line{loc.line}",
            question=question, options=options, answer=LETTERS[index],
            explanation=_optional_text(obj, "exp", loc),
            subject=_optional_text(obj, "subject_name", loc),
            topic=_optional_text(obj, "topic_name", loc),
        )

    return parse


def read_medmcqa(path: str | os.PathLike[str], *, cop_base: int = 1, on_malformed: str = "error",
                 stats: ReadStats | None = None) -> list[MedMCQAQuestion]:
    if cop_base not in (0, 1):
        raise ValueError(f"cop_base must be 0 or 1, got {cop_base}")
    return list(read_jsonl(path, _parser(cop_base), on_malformed=on_malformed, stats=stats))
