"""MedMCQA reader (Pal et al., 2022): one JSON object per line with `question`, `opa`–`opd`,
`cop` (correct option) and optionally `id`, `exp` (explanation), `subject_name`, `topic_name`,
`choice_type`.

`cop` is 1–4 in the original release (1 → "a" … 4 → "d"). The Hugging Face copy
(`openlifescienceai/medmcqa`, the one article 000 loaded) stores it 0–3. `detect_cop_base` tells
them apart by the values a file holds: a 0 only occurs in the 0-based copy and a 4 only in the
1-based one; a file with neither (or both) is refused with the values it holds, never guessed
(article 000's reward read the 0-based copy as 1-based: every gold letter shifted). A `cop`
outside the chosen range is a malformed line, never silently shifted.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from megatron_rl.data.schema import DataError, Location, ReadStats, optional, read_jsonl, require

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


def detect_cop_base(path: str | os.PathLike[str], on_malformed: str = "error") -> tuple[int, str]:
    """(0 or 1, why) from the `cop` values of every line; `DataError` when they cannot tell."""
    seen: set[int] = set()

    def collect(obj: dict[str, Any], loc: Location) -> None:
        seen.add(require(obj, "cop", int, loc))

    for _ in read_jsonl(path, collect, on_malformed=on_malformed):
        pass
    if 0 in seen and 4 in seen:
        raise DataError(f"key 'cop' takes both 0 and 4 (values {sorted(seen)}): neither MedMCQA's 1-4 nor the "
                        "Hugging Face copy's 0-3", path)
    if 0 in seen:
        return 0, f"cop values {sorted(seen)}: 0-based (the Hugging Face copy), 0 -> a"
    if 4 in seen:
        return 1, f"cop values {sorted(seen)}: 1-based (the original release), 1 -> a"
    raise DataError(f"key 'cop' takes only {sorted(seen)}: without a 0 or a 4 the file cannot tell the "
                    "Hugging Face copy (0-3) from the original release (1-4); pass --cop-base 0 or 1", path)


def read_medmcqa(path: str | os.PathLike[str], *, cop_base: int = 1, on_malformed: str = "error",
                 stats: ReadStats | None = None, limit: int | None = None) -> list[MedMCQAQuestion]:
    """The questions of a file (the first `limit` kept, in file order: `train[:limit]`)."""
    if cop_base not in (0, 1):
        raise ValueError(f"cop_base must be 0 or 1, got {cop_base}")
    out: list[MedMCQAQuestion] = []
    for question in read_jsonl(path, _parser(cop_base), on_malformed=on_malformed, stats=stats):
        if limit is not None and len(out) >= limit:
            break
        out.append(question)
    return out
