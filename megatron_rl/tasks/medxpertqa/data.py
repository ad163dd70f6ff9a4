"""MedXpertQA (Zuo et al., 2025; "MedexpertQA" in article 000, which reports its accuracy): an
evaluation-only task (no `TASK`: nothing trains on it). Its reader and `prepare_medxpertqa`
(`megatron-rl data prepare medxpertqa`: medxpertqa_<split>.jsonl, options a–j).

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
"Answer Choices:" line and lists the options in the project's format (a–j, `tasks/mcq/prompts.py`), so
it asks for the `[ans]` answer like every other task; `eval mcq` scores the predictions.
Questions with images (the MM subset) need a vision model: left out and counted.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...data.prepare import PrepareResult
from ...data.schema import DataError, Location, PromptRecord, ReadStats, optional, read_jsonl, require
from ..mcq.prompts import build_messages

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


def medxpertqa_prompt(question: MedXpertQAQuestion) -> PromptRecord:
    return PromptRecord(
        id=question.id, source="medxpertqa",
        messages=build_messages(question.stem, question.options, language="en"),
        answer=[question.answer], choices=list(question.options),
        metadata={"medical_task": question.medical_task, "body_system": question.body_system,
                  "question_type": question.question_type},
    )


def prepare_medxpertqa(src: str | os.PathLike[str], out: str | os.PathLike[str], *, split: str = "test",
                       limit: int | None = None, on_malformed: str = "error") -> PrepareResult:
    """MedXpertQA (Text; MM rows with images are left out) → medxpertqa_<split>.jsonl prompts for
    `eval generate` and `eval mcq`."""
    stats = ReadStats(str(src))
    questions = read_medxpertqa(src, on_malformed=on_malformed, stats=stats)
    excluded: Counter[str] = Counter()
    prompts: list[PromptRecord] = []
    seen: set[str] = set()
    for question in questions:
        if question.id in seen:
            raise DataError(f"duplicate id {question.id!r}", src)
        seen.add(question.id)
        if question.images:
            excluded["needs_image"] += 1
        elif limit is None or len(prompts) < limit:
            prompts.append(medxpertqa_prompt(question))
    result = PrepareResult(excluded=dict(excluded), read_stats=[stats.to_dict()])
    result.notes = {"limit": limit, "options": sorted({len(p.choices) for p in prompts})}
    result.write(out, f"medxpertqa_{split}", prompts)
    result.write_summary(Path(out) / f"medxpertqa_{split}_prepare.json")
    return result
