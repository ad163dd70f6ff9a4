"""The specialist-exam input format, its reader and `data prepare specialist` (article 001's
`specialist_exam_test_v2`: 3,757 questions in 13 specialties, reported as All and All (text only)).

The exam is not public, so the project defines the format a user converts their copy to: one JSON
object per line,

    {"id": "sp-0001",                       # unique, any string
     "specialty": "循環器",                  # the specialty the per-specialty table groups by
     "question": "…",                        # the stem (it may say "2つ選べ")
     "choices": ["…", "…", "…", "…", "…"],   # lettered a, b, … in this order (2–26 of them);
                                             #   or an object {"a": "…", "b": "…", …} in letter order
     "answer": ["a"],                        # the gold set: letters of `choices` ("a,c" also accepted)
     "has_image": false}                     # the question shows a figure the model does not see

`has_image` is required: the "All (text only)" column is the questions without one, and a default
would put every figure question in it. Every line is checked (`read_specialist`) and a bad one stops
the command with `<file>:<line>: <problem>` (a repeated id names its first line too).

`prepare_specialist` writes `specialist_<split>.jsonl`: one `PromptRecord` per question (source
`specialist`, the project's `[ans]` prompt, `tasks/mcq/prompts.py`), with `specialty` and
`has_image` in its metadata, which `eval specialist` reads back as the gold. Figure questions are
kept (the article's "All" counts them; the model sees their text only).
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...data.prepare import PrepareResult
from ...data.schema import DataError, Location, PromptRecord, ReadStats, normalize_answer_token, read_jsonl, require
from ..mcq.answer import parse_choice_set
from ..mcq.prompts import build_messages, choice_letter

SOURCE = "specialist"
MAX_CHOICES = 26


@dataclass(frozen=True)
class SpecialistQuestion:
    id: str
    specialty: str
    question: str
    choices: tuple[str, ...]
    answer: tuple[str, ...]
    """The gold letters, sorted."""
    has_image: bool


def _choices(obj: dict[str, Any], loc: Location) -> tuple[str, ...]:
    raw = require(obj, "choices", (list, dict), loc)
    if isinstance(raw, dict):
        letters = [normalize_answer_token(str(k)) for k in raw]
        expected = [choice_letter(i) for i in range(min(len(raw), MAX_CHOICES))]
        if letters != expected:
            raise loc.error(f"key 'choices' must be lettered a, b, … in order, got {list(raw)}")
        raw = list(raw.values())
    if not 2 <= len(raw) <= MAX_CHOICES:
        raise loc.error(f"key 'choices' must hold 2 to {MAX_CHOICES} options, got {len(raw)}")
    for i, text in enumerate(raw):
        if not isinstance(text, str) or not text.strip():
            raise loc.error(f"choice {choice_letter(i)} must be a non-empty str")
    return tuple(raw)


def _answer(obj: dict[str, Any], loc: Location, count: int) -> tuple[str, ...]:
    raw = require(obj, "answer", (list, str), loc)
    if isinstance(raw, list) and not all(isinstance(a, str) for a in raw):
        raise loc.error("key 'answer' must be a list of letters")
    parsed = parse_choice_set(",".join(raw) if isinstance(raw, list) else raw)
    last = choice_letter(count - 1)
    if not parsed or not all(len(a) == 1 and "a" <= a <= last for a in parsed):
        raise loc.error(f"key 'answer' must be letters a–{last} of the choices, got {raw!r}")
    return tuple(sorted(parsed))


def _parse(obj: dict[str, Any], loc: Location) -> SpecialistQuestion:
    qid = require(obj, "id", str, loc)
    if not qid.strip():
        raise loc.error("key 'id' must not be empty")
    specialty = require(obj, "specialty", str, loc).strip()
    if not specialty:
        raise loc.error("key 'specialty' must not be empty")
    question = require(obj, "question", str, loc)
    if not question.strip():
        raise loc.error("key 'question' must not be empty")
    choices = _choices(obj, loc)
    unknown = sorted(set(obj) - {"id", "specialty", "question", "choices", "answer", "has_image"})
    if unknown:
        raise loc.error(f"unknown keys {unknown}; allowed: id, specialty, question, choices, answer, has_image")
    return SpecialistQuestion(id=qid, specialty=specialty, question=question, choices=choices,
                              answer=_answer(obj, loc, len(choices)), has_image=require(obj, "has_image", bool, loc))


def read_specialist(path: str | os.PathLike[str], *, on_malformed: str = "error",
                    stats: ReadStats | None = None) -> list[SpecialistQuestion]:
    """Every question of a specialist-exam file; a repeated id is an error (with `on_malformed`
    "skip", the repeat is skipped and counted)."""
    seen: dict[str, int | None] = {}
    stats = stats if stats is not None else ReadStats(str(path))

    def parse(obj: dict[str, Any], loc: Location) -> SpecialistQuestion:
        question = _parse(obj, loc)
        if question.id in seen:
            raise loc.error(f"duplicate id {question.id!r} (first at line {seen[question.id]})")
        seen[question.id] = loc.line
        return question

    return list(read_jsonl(path, parse, on_malformed=on_malformed, stats=stats))


def specialist_prompt(question: SpecialistQuestion, system_prompt: str | None = None) -> PromptRecord:
    return PromptRecord(
        id=question.id, source=SOURCE,
        messages=build_messages(question.question, question.choices, language="ja", system_prompt=system_prompt),
        answer=list(question.answer), choices=list(question.choices),
        metadata={"specialty": question.specialty, "has_image": question.has_image},
    )


def prepare_specialist(src: str | os.PathLike[str], out: str | os.PathLike[str], *, split: str = "test",
                       system_prompt: str | None = None, on_malformed: str = "error") -> PrepareResult:
    """The specialist-exam file → `specialist_<split>.jsonl` prompts for `eval generate` and the gold
    of `eval specialist`."""
    stats = ReadStats(str(src))
    questions = read_specialist(src, on_malformed=on_malformed, stats=stats)
    if not questions:
        raise DataError("no questions", src)
    result = PrepareResult(read_stats=[stats.to_dict()])
    by_specialty = Counter(q.specialty for q in questions)
    result.notes = {"specialties": dict(sorted(by_specialty.items(), key=lambda kv: (-kv[1], kv[0]))),
                    "with_image": sum(q.has_image for q in questions), "system_prompt": system_prompt}
    result.write(out, f"specialist_{split}", [specialist_prompt(q, system_prompt) for q in questions])
    result.write_summary(Path(out) / f"specialist_{split}_prepare.json")
    return result
