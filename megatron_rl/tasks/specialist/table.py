"""`eval specialist`: base + methods on the specialist exam, in article 001's layouts.

The gold is the prompt file `data prepare specialist` wrote (its `specialty` and `has_image`
metadata); each system is a JSONL of `{problem_id, output}` (what `eval generate` writes: the last
`[ans]` tag is the answer, `tasks/mcq/answer.py`) or `{problem_id, prediction}` ("a,c"). A question
is correct when the answer set equals the gold set. The denominator is always the gold file (after
`--include` / `--exclude`): a question a system has no line for counts as wrong and is reported as
missing, an answer that does not parse counts as wrong and is reported as a format failure, so a
partial run cannot raise a score. A line naming no gold question, or a question twice, is an error.

The layouts are IgakuQA's (`tasks/igakuqa/table.paired_layouts`): All and All (text only, the
questions without a figure) with Δ vs the baseline and the exact McNemar mark, McNemar between the
methods, per-specialty Δ with the best method (ties name each) and the count of specialties each
method is best in.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ...data.idlist import IdFilter
from ...data.schema import DataError, Location, PromptRecord, read_jsonl, require
from ..igakuqa.table import ALL, TEXT_ONLY, SystemSpec, paired_layouts
from ..mcq.answer import extract_answer, parse_choice_set


@dataclass(frozen=True)
class SpecialistGold:
    id: str
    specialty: str
    has_image: bool
    accepted: tuple[frozenset[str], ...]


@dataclass(frozen=True)
class SpecialistResult:
    problem_id: str
    correct: bool
    missing: bool
    format_failure: bool


def load_gold(path: str | os.PathLike[str]) -> dict[str, SpecialistGold]:
    """The questions of a `data prepare specialist` file, by id."""
    gold: dict[str, SpecialistGold] = {}

    def parse(obj: dict[str, Any], loc: Location) -> None:
        question = _gold_of(PromptRecord.from_dict(obj, loc), loc)
        if question.id in gold:
            raise loc.error(f"duplicate id {question.id!r}")
        gold[question.id] = question

    for _ in read_jsonl(path, parse):
        pass
    if not gold:
        raise DataError("no questions", path)
    return gold


def _gold_of(record: PromptRecord, loc: Location) -> SpecialistGold:
    specialty = record.metadata.get("specialty")
    has_image = record.metadata.get("has_image")
    if not isinstance(specialty, str) or not isinstance(has_image, bool):
        raise loc.error("metadata must hold 'specialty' (str) and 'has_image' (bool): "
                        "write the gold with `data prepare specialist`")
    return SpecialistGold(record.id, specialty, has_image, tuple(record.accepted_sets()))


def read_answers(path: str | os.PathLike[str], gold: Mapping[str, SpecialistGold]) -> dict[str, frozenset[str] | None]:
    """problem_id → parsed answer set (None: nothing parseable) of one system's predictions."""
    answers: dict[str, frozenset[str] | None] = {}
    lines: dict[str, int | None] = {}

    def parse(obj: dict[str, Any], loc: Location) -> None:
        pid = require(obj, "problem_id", str, loc)
        if pid not in gold:
            raise loc.error(f"problem_id {pid!r} is not a question of the gold file")
        if pid in answers:
            raise loc.error(f"problem_id {pid!r} appears twice (first at line {lines[pid]})")
        if "prediction" in obj:
            answers[pid] = parse_choice_set(require(obj, "prediction", str, loc))
        elif "output" in obj:
            answers[pid] = extract_answer(require(obj, "output", str, loc))
        else:
            raise loc.error("missing key 'output' (raw model output) or 'prediction' (letters)")
        lines[pid] = loc.line

    for _ in read_jsonl(path, parse):
        pass
    return answers


def score(gold: Mapping[str, SpecialistGold], ids: Sequence[str],
          answers: Mapping[str, frozenset[str] | None]) -> dict[str, SpecialistResult]:
    out = {}
    for pid in ids:
        answer = answers.get(pid)
        out[pid] = SpecialistResult(pid, correct=answer is not None and answer in gold[pid].accepted,
                                    missing=pid not in answers, format_failure=pid in answers and answer is None)
    return out


def build_specialist_table(gold: Mapping[str, SpecialistGold], systems: Sequence[SystemSpec], baseline: str,
                           ids: IdFilter | None = None) -> dict[str, Any]:
    """The layouts of `systems` (label → prediction file) on the gold questions `ids` keeps."""
    id_filter = ids or IdFilter()
    kept = id_filter.apply(gold)
    if not kept:
        raise DataError("no question is left to score (check --include / --exclude)")
    by_id = {s.label: score(gold, kept, read_answers(s.path, gold)) for s in systems}
    columns = {ALL: kept, TEXT_ONLY: [pid for pid in kept if not gold[pid].has_image]}
    table = {"benchmark": "Specialist exam", **paired_layouts(by_id, baseline, columns,
                                                              lambda pid: gold[pid].specialty)}
    table["missing"] = {label: sum(r.missing for r in rs.values()) for label, rs in by_id.items()}
    table["format_failures"] = {label: sum(r.format_failure for r in rs.values()) for label, rs in by_id.items()}
    table["questions"] = id_filter.to_dict()
    table["notes"] = [id_filter.describe() + "; unanswered questions count as wrong (missing: "
                      + ", ".join(f"{k} {v}" for k, v in table["missing"].items()) + "; format failures: "
                      + ", ".join(f"{k} {v}" for k, v in table["format_failures"].items()) + ")."]
    return table
