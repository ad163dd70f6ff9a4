"""Accuracy of single-answer MCQ predictions against prompt files (MedXpertQA, MedMCQA, ...).

`megatron-rl eval mcq --pred P --gold PROMPTS` reads the `{problem_id, output}` lines that
`eval generate` writes and the prompt file they were generated from (`data prepare medxpertqa`,
`medmcqa`): a prediction is correct when the answer read from its output equals the prompt's gold
answer set. The answer is the `[ans]…[/ans]` tag when there is one, else an explicit statement
("The correct answer is C", "Answer: C", "答え: C"; `--parse flexible` adds "answer is C",
"option C" and a last line that is only the letter), with the letters of the question's own
options (a–j for MedXpertQA Text): the rules of `tasks/medmcqa/rewards.py`, so the training
reward and the evaluation read answers alike. A prediction with no answer counts as wrong and is counted as
`no_answer`; a prompt without a prediction is `missing` and counts as wrong too (the denominator
is always the prompt file), so a partial run cannot inflate the score.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from ...data.schema import DataError, Location, PromptRecord, read_jsonl, require
from ..medmcqa.rewards import extract_medmcqa_answer
from .answer import gold_sets

PARSE_MODES: tuple[str, ...] = ("strict", "flexible")


def read_outputs(path: str | os.PathLike[str]) -> dict[str, str]:
    """problem_id → output of an `eval generate` file; a repeated id is an error."""
    out: dict[str, str] = {}

    def parse(obj: dict[str, Any], loc: Location) -> None:
        pid, text = require(obj, "problem_id", str, loc), require(obj, "output", str, loc)
        if pid in out:
            raise loc.error(f"problem_id {pid!r} appears twice")
        out[pid] = text

    for _ in read_jsonl(path, parse):
        pass
    return out


def answer_of(output: str, record: PromptRecord, parse: str = "flexible") -> frozenset[str] | None:
    last = chr(ord("a") + max(len(record.choices), 1) - 1)
    return extract_medmcqa_answer(output, flexible=parse == "flexible", last_letter=last)


def _cell(n: int, correct: int) -> dict[str, Any]:
    return {"n": n, "correct": correct, "accuracy": correct / n if n else float("nan")}


def score_mcq(prompts: Sequence[PromptRecord], outputs: dict[str, str], group_keys: Sequence[str] = (),
              parse: str = "flexible") -> dict[str, Any]:
    if parse not in PARSE_MODES:
        raise ValueError(f"parse must be one of {', '.join(PARSE_MODES)}, got {parse!r}")
    ids = {p.id for p in prompts}
    unknown = sorted(set(outputs) - ids)
    if unknown:
        raise DataError(f"{len(unknown)} predictions name no prompt of the gold file (first: {unknown[:3]})")
    correct = no_answer = missing = 0
    groups: dict[str, dict[str, list[int]]] = {k: defaultdict(lambda: [0, 0]) for k in group_keys}
    for record in prompts:
        output = outputs.get(record.id)
        answer = None if output is None else answer_of(output, record, parse)
        missing += output is None
        no_answer += output is not None and answer is None
        hit = answer is not None and answer in gold_sets(record.to_dict())
        correct += hit
        for key in group_keys:
            cell = groups[key][str(record.metadata.get(key, ""))]
            cell[0] += 1
            cell[1] += hit
    report = {"overall": {**_cell(len(prompts), correct), "no_answer": no_answer, "missing": missing},
              "parse": parse,
              "by": {k: {v: _cell(*c) for v, c in sorted(cells.items())} for k, cells in groups.items()}}
    return report


def render_markdown(report: dict[str, Any], title: str = "MCQ accuracy") -> str:
    o = report["overall"]
    lines = [f"# {title}", "", "| n | correct | accuracy | no answer | missing |", "|---:|---:|---:|---:|---:|",
             f"| {o['n']} | {o['correct']} | {100 * o['accuracy']:.2f} % | {o['no_answer']} | {o['missing']} |"]
    for key, cells in report["by"].items():
        lines += ["", f"## By {key}", "", f"| {key} | n | accuracy |", "|---|---:|---:|"]
        lines += [f"| {v or '—'} | {c['n']} | {100 * c['accuracy']:.2f} % |" for v, c in cells.items()]
    lines.append("")
    return "\n".join(lines) + "\n"
