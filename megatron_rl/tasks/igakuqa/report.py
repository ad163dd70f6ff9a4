"""IgakuQA report: accuracy and points per block, year and overall, text-only subset, category,
prohibited-choice selections, format failures, and pass/fail against the official criteria.

Which questions are evaluated: every gold question of each exam block that has at least one
prediction. A gold question of such a block without a prediction counts as wrong and is reported
as `missing`; a prediction whose problem_id is not in the gold data is an error.

Pass/fail (the exam's rule): required (必修, blocks B and E, clinical questions 3 points) score at
least `required_min`, the remaining blocks (1 point each) at least `general_min`, and at most
`MAX_PROHIBITED` questions answered with a prohibited choice. The thresholds are those MHLW
announced for each exam, as quoted by these secondary sources (retrieved for this table):
  112 (2018) 160/200, 208/299  savingdoctor.com/entry/2018/03/19/223235 (quotes MHLW)
  113 (2019) 160/200, 209/296  jmedj.co.jp/journal/paper/detail.php?id=11988
  114 (2020) 158/197, 217/299  igaku-shoin.co.jp paper PA03367_03; ishiyaku-k.com
  115 (2021) 160/200, 209/300  newtongym8.com (quotes MHLW, 第115回医師国家試験 合格発表)
  116 (2022) 158/197, 214/297  doctor.mynavi.jp/column/kokushi2022
  prohibited choices: "禁忌肢問題選択数は3問以下" in every one of these announcements.
The totals match the IgakuQA point sums for the same blocks exactly; when they do not (a partial
or different question set) pass/fail is reported as n/a instead of guessed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from ...data.schema import DataError
from .data import IgakuQAQuestion
from .scoring import (
    DEFAULT_RULE,
    RULE_DESCRIPTIONS,
    PredictionSet,
    check_rule,
    is_correct,
    selects_prohibited,
)

MAX_PROHIBITED = 3
EXAM_BLOCKS = frozenset("ABCDEF")


@dataclass(frozen=True)
class PassCriteria:
    required_min: int
    required_total: int
    general_min: int
    general_total: int


PASS_CRITERIA: dict[int, PassCriteria] = {
    2018: PassCriteria(160, 200, 208, 299),
    2019: PassCriteria(160, 200, 209, 296),
    2020: PassCriteria(158, 197, 217, 299),
    2021: PassCriteria(160, 200, 209, 300),
    2022: PassCriteria(158, 197, 214, 297),
}


@dataclass(frozen=True)
class QuestionResult:
    question: IgakuQAQuestion
    predicted: frozenset[str] | None
    missing: bool
    correct: bool
    prohibited: bool

    @property
    def earned(self) -> int:
        return self.question.points if self.correct else 0

    @property
    def format_failure(self) -> bool:
        return not self.missing and self.predicted is None


def evaluate(gold: Mapping[str, IgakuQAQuestion], predictions: PredictionSet,
             rule: str = DEFAULT_RULE) -> list[QuestionResult]:
    """Score every gold question of the blocks the predictions cover (see module docstring) by
    `rule` (`scoring.RULES`)."""
    check_rule(rule)
    for given in predictions.predictions.values():
        if given.problem_id not in gold:
            raise DataError(f"problem_id {given.problem_id!r} is not in the gold data",
                            given.path, given.line)
    blocks = {gold[pid].exam_block for pid in predictions.predictions}
    results = []
    for question in gold.values():
        if question.exam_block not in blocks:
            continue
        prediction = predictions.predictions.get(question.problem_id)
        answer = prediction.answer if prediction is not None else None
        results.append(QuestionResult(
            question=question, predicted=answer, missing=prediction is None,
            correct=is_correct(question, prediction, rule),
            prohibited=selects_prohibited(question, answer),
        ))
    return results


@dataclass(frozen=True)
class GroupStats:
    n: int
    correct: int
    score: int
    total: int
    prohibited: int
    format_failures: int
    missing: int

    @classmethod
    def of(cls, results: Iterable[QuestionResult]) -> GroupStats:
        rs = list(results)
        return cls(n=len(rs), correct=sum(r.correct for r in rs), score=sum(r.earned for r in rs),
                   total=sum(r.question.points for r in rs),
                   prohibited=sum(r.prohibited for r in rs),
                   format_failures=sum(r.format_failure for r in rs),
                   missing=sum(r.missing for r in rs))

    @property
    def accuracy(self) -> float:
        return self.correct / self.n if self.n else 0.0

    @property
    def format_failure_rate(self) -> float:
        return self.format_failures / self.n if self.n else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"n": self.n, "correct": self.correct, "accuracy": self.accuracy,
                "score": self.score, "total": self.total, "prohibited": self.prohibited,
                "format_failures": self.format_failures,
                "format_failure_rate": self.format_failure_rate, "missing": self.missing}


_Item = TypeVar("_Item")


def group_by(results: Iterable[_Item], key: Callable[[_Item], Any]) -> dict[Any, list[_Item]]:
    groups: dict[Any, list[_Item]] = {}
    for result in results:
        groups.setdefault(key(result), []).append(result)
    return groups


def pass_fail(year: int, results: list[QuestionResult]) -> dict[str, Any]:
    """The exam verdict for one year's results, or status "n/a" with the reason."""
    criteria = PASS_CRITERIA.get(year)
    if criteria is None:
        return {"status": "n/a", "reason": f"no sourced pass criteria for {year}"}
    blocks = {r.question.block for r in results}
    if blocks != EXAM_BLOCKS:
        return {"status": "n/a", "reason": f"incomplete exam (blocks {''.join(sorted(blocks))})"}
    required = GroupStats.of(r for r in results if r.question.required)
    general = GroupStats.of(r for r in results if not r.question.required)
    if (required.total, general.total) != (criteria.required_total, criteria.general_total):
        return {"status": "n/a", "reason": f"point totals {required.total}/{general.total} differ "
                                           f"from the official {criteria.required_total}/"
                                           f"{criteria.general_total}"}
    prohibited = sum(r.prohibited for r in results)
    passed = (required.score >= criteria.required_min and general.score >= criteria.general_min
              and prohibited <= MAX_PROHIBITED)
    return {"status": "pass" if passed else "fail",
            "required_score": required.score, "required_min": criteria.required_min,
            "required_total": required.total, "general_score": general.score,
            "general_min": criteria.general_min, "general_total": general.total,
            "prohibited": prohibited, "max_prohibited": MAX_PROHIBITED}


def build_report(results: list[QuestionResult], system: str,
                 rule: str = DEFAULT_RULE) -> dict[str, Any]:
    """The whole report as plain data (what `--json` prints); `rule` is the one `evaluate` used."""
    by_year = group_by(results, lambda r: r.question.year)
    by_block = group_by(results, lambda r: r.question.exam_block)
    by_text = group_by(results, lambda r: r.question.text_only)
    by_category = group_by(results, lambda r: r.question.category or "(none)")
    return {
        "system": system,
        "rule": check_rule(rule),
        "overall": GroupStats.of(results).to_dict(),
        "by_year": [{"year": y, "exam": rs[0].question.exam, **GroupStats.of(rs).to_dict(),
                     "pass": pass_fail(y, rs)} for y, rs in sorted(by_year.items())],
        "by_block": [{"block": b, **GroupStats.of(rs).to_dict()}
                     for b, rs in sorted(by_block.items())],
        "text_only": [{"text_only": t, **GroupStats.of(rs).to_dict()}
                      for t, rs in sorted(by_text.items(), reverse=True)],
        "by_category": [{"category": c, **GroupStats.of(rs).to_dict()}
                        for c, rs in sorted(by_category.items(), key=lambda kv: (-len(kv[1]),
                                                                                  kv[0]))],
    }


def pct(value: float) -> str:
    return f"{100 * value:.1f}%"


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines.extend("| " + " | ".join(row) + " |" for row in rows)
    return "\n".join(lines)


def _stats_cells(row: Mapping[str, Any]) -> list[str]:
    return [str(row["n"]), pct(row["accuracy"]), f"{row['score']}/{row['total']}",
            str(row["prohibited"]), pct(row["format_failure_rate"]), str(row["missing"])]


_STATS_HEADER = ["n", "Accuracy", "Points", "Prohibited", "Format fail", "Missing"]


def _pass_cell(verdict: Mapping[str, Any]) -> str:
    if verdict["status"] == "n/a":
        return f"n/a ({verdict['reason']})"
    return (f"{verdict['status'].upper()} (req {verdict['required_score']}/"
            f"{verdict['required_total']} ≥{verdict['required_min']}, gen "
            f"{verdict['general_score']}/{verdict['general_total']} ≥{verdict['general_min']}, "
            f"kinki {verdict['prohibited']} ≤{verdict['max_prohibited']})")


def render_markdown(report: Mapping[str, Any]) -> str:
    overall = report["overall"]
    parts = [f"## IgakuQA: {report['system']}", "",
             f"Scoring rule: {RULE_DESCRIPTIONS[report['rule']]}.", "",
             markdown_table(["Scope", *_STATS_HEADER], [["overall", *_stats_cells(overall)]]), "",
             "### By year", "",
             markdown_table(["Year", "Exam", *_STATS_HEADER, "Pass"],
                    [[str(r["year"]), str(r["exam"]), *_stats_cells(r), _pass_cell(r["pass"])]
                     for r in report["by_year"]]), "",
             "### By block", "",
             markdown_table(["Block", *_STATS_HEADER], [[r["block"], *_stats_cells(r)]
                                               for r in report["by_block"]]), "",
             "### Text-only subset", "",
             markdown_table(["Questions", *_STATS_HEADER],
                    [["text only" if r["text_only"] else "image missing", *_stats_cells(r)]
                     for r in report["text_only"]]), "",
             "### By category", "",
             markdown_table(["Category", *_STATS_HEADER], [[r["category"], *_stats_cells(r)]
                                                  for r in report["by_category"]])]
    return "\n".join(parts) + "\n"
