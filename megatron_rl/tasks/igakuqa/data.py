"""IgakuQA reader (Japanese National Medical Licensing Examination 2018–2022, Kasai et al. 2023).

Layout (as published in jungokasai/IgakuQA): `data/<year>/<exam>-<block>.jsonl` with
`problem_id, problem_text, choices, answer, points, text_only`, and next to each block file an
optional `<exam>-<block>_metadata.jsonl` with `category` (specialty) and `kinki` (prohibited
choices). Exams 112–116 are the years 2018–2022 (year = exam + 1906; exams 95–99, 2001–2005, have
two-digit numbers, `95-A.jsonl` / `95A1`, read alike, zero-padded or not); blocks are A–F, of which B
and E are the required (必修) blocks — their point totals are exactly the official 必修 totals
(200, or 197 in years with an excluded question).

Answers are normalised (`normalize_answer_token`); the one gold of the form "a or d" (112B30)
becomes answer ["a"] with alternative ["d"]. Questions with `points == "0"` were excluded from
official scoring and score no points; 116A71 is counted correct for any answer
(`ALL_CORRECT_IDS`). Both rules are applied by `megatron_rl.tasks.igakuqa.scoring`; they live here so
the training-data preparation can leave these flawed questions out.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...data.schema import (
    DataError,
    Location,
    ReadStats,
    normalize_answer_token,
    optional,
    read_jsonl,
    require,
    require_str_list,
)

EXAM_YEAR_OFFSET = 1906
REQUIRED_BLOCKS: frozenset[str] = frozenset({"B", "E"})
# The benchmark's own scorer counts this question correct for every answer.
ALL_CORRECT_IDS: frozenset[str] = frozenset({"116A71"})
ALTERNATIVE_SEPARATOR = " or "

_PROBLEM_ID = re.compile(r"(\d{2,3})([A-Z])(\d{1,3})")
_BLOCK_FILE = re.compile(r"(\d{2,3})-([A-Z])\.jsonl")


@dataclass(frozen=True)
class IgakuQAQuestion:
    problem_id: str
    exam: int
    block: str
    number: int
    problem_text: str
    choices: tuple[str, ...]
    answer: tuple[str, ...]
    alternatives: tuple[tuple[str, ...], ...]
    points: int
    text_only: bool
    category: str = ""
    kinki: tuple[str, ...] = ()
    # The gold list exactly as the file writes it: the benchmark's scorer compares these strings.
    answer_as_written: tuple[str, ...] = ()

    @property
    def year(self) -> int:
        return self.exam + EXAM_YEAR_OFFSET

    @property
    def exam_block(self) -> str:
        return f"{self.exam}-{self.block}"

    @property
    def required(self) -> bool:
        return self.block in REQUIRED_BLOCKS

    @property
    def accepted_sets(self) -> tuple[frozenset[str], ...]:
        return (frozenset(self.answer), *(frozenset(alt) for alt in self.alternatives))


@dataclass(frozen=True)
class _Metadata:
    category: str
    kinki: tuple[str, ...]


@dataclass
class IgakuQADataset:
    """All questions read from a directory, in file order, plus per-file read statistics."""

    questions: list[IgakuQAQuestion]
    stats: list[ReadStats] = field(default_factory=list)

    def by_id(self) -> dict[str, IgakuQAQuestion]:
        return {q.problem_id: q for q in self.questions}

    @property
    def years(self) -> list[int]:
        return sorted({q.year for q in self.questions})


def parse_problem_id(problem_id: str) -> tuple[int, str, int] | None:
    """`"112A1"` → `(112, "A", 1)`; None when the id is not of that form."""
    match = _PROBLEM_ID.fullmatch(problem_id)
    if match is None:
        return None
    return int(match.group(1)), match.group(2), int(match.group(3))


def _parse_answer(raw: list[str], choices: list[str],
                  loc: Location) -> tuple[tuple[str, ...], tuple[tuple[str, ...], ...]]:
    tokens = [normalize_answer_token(a) for a in raw]
    if len(tokens) == 1 and ALTERNATIVE_SEPARATOR in tokens[0]:
        options = [t.strip() for t in tokens[0].split(ALTERNATIVE_SEPARATOR)]
        sets: list[tuple[str, ...]] = [(t,) for t in options]
    else:
        sets = [tuple(sorted(set(tokens)))]
    for answer_set in sets:
        for token in answer_set:
            if not token:
                raise loc.error("key 'answer' contains an empty answer")
            if choices and not (len(token) == 1 and 0 <= ord(token) - ord("a") < len(choices)):
                raise loc.error(f"answer {token!r} is not one of the {len(choices)} choice "
                                f"letters")
    return sets[0], tuple(sets[1:])


def _parse_points(obj: Mapping[str, Any], loc: Location) -> int:
    raw = require(obj, "points", (str, int), loc)
    text = str(raw).strip()
    if not text.isdigit():
        raise loc.error(f"key 'points' must be a non-negative integer, got {raw!r}")
    return int(text)


def _question_parser(exam: int, block: str, metadata: Mapping[str, _Metadata],
                     ) -> Callable[[dict[str, Any], Location], IgakuQAQuestion]:
    def parse(obj: dict[str, Any], loc: Location) -> IgakuQAQuestion:
        problem_id = require(obj, "problem_id", str, loc)
        parsed = parse_problem_id(problem_id)
        if parsed is None or parsed[:2] != (exam, block):
            raise loc.error(f"problem_id {problem_id!r} does not belong to exam {exam} "
                            f"block {block}")
        choices = require_str_list(obj, "choices", loc)
        written = require_str_list(obj, "answer", loc, non_empty=True)
        answer, alternatives = _parse_answer(written, choices, loc)
        meta = metadata.get(problem_id, _Metadata("", ()))
        return IgakuQAQuestion(
            problem_id=problem_id, exam=exam, block=block, number=parsed[2],
            problem_text=require(obj, "problem_text", str, loc), choices=tuple(choices),
            answer=answer, alternatives=alternatives, points=_parse_points(obj, loc),
            text_only=require(obj, "text_only", bool, loc),
            category=meta.category, kinki=meta.kinki, answer_as_written=tuple(written),
        )

    return parse


def _parse_metadata(obj: dict[str, Any], loc: Location) -> tuple[str, _Metadata]:
    problem_id = require(obj, "problem_id", str, loc)
    letters: set[str] = set()
    for entry in require_str_list(obj, "kinki", loc) if "kinki" in obj else []:
        token = normalize_answer_token(entry)
        # The published metadata writes several prohibited choices either as separate items or
        # run together in one string ("de", "abcd" — confirmed by the `reason` texts).
        if not (token.isascii() and token.isalpha()):
            raise loc.error(f"kinki entry {entry!r} is not choice letters")
        letters.update(token)
    category = optional(obj, "category", str, loc, "")
    return problem_id, _Metadata(category, tuple(sorted(letters)))


def read_block(path: str | os.PathLike[str], *, on_malformed: str = "error",
               stats: list[ReadStats] | None = None) -> list[IgakuQAQuestion]:
    """Read one `<exam>-<block>.jsonl` file, joined with its `_metadata.jsonl` when present."""
    path = Path(path)
    match = _BLOCK_FILE.fullmatch(path.name)
    if match is None:
        raise DataError("not an IgakuQA block file (expected <exam>-<block>.jsonl)", path)
    exam, block = int(match.group(1)), match.group(2)
    metadata: dict[str, _Metadata] = {}
    meta_path = path.with_name(f"{path.stem}_metadata.jsonl")  # as named: "095-A" stays "095-A"
    if meta_path.exists():
        meta_stats = ReadStats(str(meta_path))
        metadata = dict(read_jsonl(meta_path, _parse_metadata, on_malformed=on_malformed,
                                   stats=meta_stats))
        if stats is not None:
            stats.append(meta_stats)
    block_stats = ReadStats(str(path))
    questions = list(read_jsonl(path, _question_parser(exam, block, metadata),
                                on_malformed=on_malformed, stats=block_stats))
    if stats is not None:
        stats.append(block_stats)
    return questions


def find_block_files(root: str | os.PathLike[str]) -> list[Path]:
    """All `<exam>-<block>.jsonl` files under `root` (the IgakuQA checkout or its `data/`)."""
    root = Path(root)
    if not root.is_dir():
        raise DataError("IgakuQA directory does not exist", root)
    files = sorted((p for p in root.rglob("*.jsonl") if _BLOCK_FILE.fullmatch(p.name)),
                   key=lambda p: p.name)
    if not files:
        raise DataError("no IgakuQA block files (<exam>-<block>.jsonl) found", root)
    return files


def load_igakuqa(root: str | os.PathLike[str], *, years: Iterable[int] | None = None,
                 on_malformed: str = "error") -> IgakuQADataset:
    """Read every block under `root` (optionally only some years); problem ids must be unique."""
    wanted = None if years is None else set(years)
    stats: list[ReadStats] = []
    questions: list[IgakuQAQuestion] = []
    seen: dict[str, Path] = {}
    for path in find_block_files(root):
        exam = int(_BLOCK_FILE.fullmatch(path.name).group(1))  # type: ignore[union-attr]
        if wanted is not None and exam + EXAM_YEAR_OFFSET not in wanted:
            continue
        for question in read_block(path, on_malformed=on_malformed, stats=stats):
            if question.problem_id in seen:
                raise DataError(f"duplicate problem_id {question.problem_id!r} "
                                f"(also in {seen[question.problem_id]})", path)
            seen[question.problem_id] = path
            questions.append(question)
    return IgakuQADataset(questions, stats)
