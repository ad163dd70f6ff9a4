"""MedXpertQA reader (Zuo et al., 2025; "MedexpertQA" in article 000, which reports its accuracy).

The published files (`Text/test.jsonl`, `MM/test.jsonl` of `TsinghuaC3I/MedXpertQA`) hold one
object per line:

    {"id": "Text-0",                                  # "Text-…" or "MM-…"
     "question": "<stem>\\nAnswer Choices: (A) … (B) … …",   # the stem with the options appended
     "options": {"A": "…", "B": "…", …},              # 10 options (A–J) in Text, 5 (A–E) in MM
     "label": "C",                                    # the one correct letter
     "medical_task": "Diagnosis", "body_system": "Cardiovascular", "question_type": "Reasoning",
     "images": ["MM-26-a.jpeg"]}                      # MM only

`options` may also come as a list of `{"letter", "content"}` and `label` as a one-letter list (the
benchmark's own evaluation outputs carry them so). The prompt shows the stem without its appended
"Answer Choices:" line and lists the options in the project's format (a–j, `data/prompts.py`), so
it asks for the `[ans]` answer like every other task; `eval mcq` scores the predictions.
Questions with images (the MM subset) need a vision model: left out and counted.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

from .schema import Location, ReadStats, optional, read_jsonl, require

_CHOICES_TAIL = re.compile(r"\s*Answer Choices:\s*\(A\).*\Z", re.DOTALL)
GROUP_KEYS: tuple[str, ...] = ("medical_task", "body_system", "question_type")


@dataclass(frozen=True)
class MedXpertQAQuestion:
    id: str
    stem: str
    options: tuple[str, ...]
    """Option texts in letter order (A, B, …)."""
    answer: str
    """The correct option's letter, lower case."""
    medical_task: str = ""
    body_system: str = ""
    question_type: str = ""
    images: tuple[str, ...] = ()


def _options(obj: dict[str, Any], loc: Location) -> tuple[str, ...]:
    raw = require(obj, "options", (dict, list), loc)
    pairs: list[tuple[str, str]] = []
    if isinstance(raw, dict):
        pairs = [(str(k), v) for k, v in raw.items()]
    else:
        for i, item in enumerate(raw):
            if not isinstance(item, dict) or "letter" not in item or "content" not in item:
                raise loc.error(f"options[{i}] must be {{'letter': …, 'content': …}}")
            pairs.append((str(item["letter"]), item["content"]))
    letters = [k.strip().upper() for k, _ in pairs]
    expected = [chr(ord("A") + i) for i in range(len(pairs))]
    if len(pairs) < 2 or letters != expected:
        raise loc.error(f"key 'options' must be lettered A, B, … in order, got {letters}")
    if not all(isinstance(v, str) and v.strip() for _, v in pairs):
        raise loc.error("every option must be a non-empty str")
    return tuple(v for _, v in pairs)


def _label(obj: dict[str, Any], loc: Location, count: int) -> str:
    raw = require(obj, "label", (str, list), loc)
    if isinstance(raw, list):
        if len(raw) != 1 or not isinstance(raw[0], str):
            raise loc.error(f"key 'label' must be one letter, got {raw}")
        raw = raw[0]
    letter = raw.strip().upper()
    if len(letter) != 1 or not "A" <= letter < chr(ord("A") + count):
        raise loc.error(f"key 'label' must be one of A..{chr(ord('A') + count - 1)}, got {raw!r}")
    return letter.lower()


def _parse(obj: dict[str, Any], loc: Location) -> MedXpertQAQuestion:
    question = require(obj, "question", str, loc)
    options = _options(obj, loc)
    images = optional(obj, "images", list, loc, [])
    return MedXpertQAQuestion(
        id=str(require(obj, "id", (str, int), loc)), stem=_CHOICES_TAIL.sub("", question).strip(),
        options=options, answer=_label(obj, loc, len(options)),
        **{k: optional(obj, k, (str, type(None)), loc, "") or "" for k in GROUP_KEYS},
        images=tuple(str(i) for i in images),
    )


def read_medxpertqa(path: str | os.PathLike[str], *, on_malformed: str = "error",
                    stats: ReadStats | None = None) -> list[MedXpertQAQuestion]:
    return list(read_jsonl(path, _parse, on_malformed=on_malformed, stats=stats))
