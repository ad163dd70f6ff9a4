"""IgakuQA (Japanese medical licensing exam) in the `[ans]…[/ans]` format.

Rewards of the published setup: answer correctness (1.5) and staying in Japanese (1.0). The scorer
is the benchmark's official rule (`scoring.is_correct`): the predicted set equals the gold
set or an accepted alternative, and the questions in `ALL_CORRECT_IDS` count for every answer.
"""

from __future__ import annotations

import math
from typing import Any

from ...rewards.registry import sample_field
from ..mcq.answer import extract_answer, format_answer, mcq_answer
from ..mcq.task import has_answer_tag
from ..task import Task
from .data import ALL_CORRECT_IDS, IgakuQAQuestion, parse_problem_id
from .scoring import letter_set_correct, selects_prohibited


def official_score(response: str, sample: Any) -> float:
    if sample_field(sample, "id") in ALL_CORRECT_IDS:
        return 1.0
    return mcq_answer(response, sample)


def _question(record: dict[str, Any]) -> IgakuQAQuestion:
    """The scorer's question from a prompt record written by `data prepare igakuqa`."""
    meta = record.get("metadata", {})
    exam, block, number = parse_problem_id(record["id"]) or (0, "", 0)
    return IgakuQAQuestion(problem_id=record["id"], exam=exam, block=block, number=number, problem_text="",
                           choices=tuple(record["choices"]), answer=tuple(record["answer"]),
                           alternatives=tuple(tuple(a) for a in record.get("alternatives", [])),
                           points=int(meta.get("points", 1)), text_only=bool(meta.get("text_only", True)),
                           kinki=tuple(meta.get("kinki", ())))


def benchmark_metrics(responses: list[str], samples: list[Any]) -> dict[str, float]:
    """The IgakuQA rule on the eval prompts that came from IgakuQA: accuracy, points earned / points
    possible, and how often a prohibited choice (kinki) was selected."""
    questions = [(_question(s), extract_answer(r)) for r, s in zip(responses, samples, strict=True)
                 if s.get("source") == "igakuqa"]
    if not questions:
        return {}
    # A raw output's tag is read as a letter set (its canonical "a,c" string): on such strings the
    # benchmark's own rule and the letter-set rule agree (scoring.py).
    correct = [letter_set_correct(q, answer) for q, answer in questions]
    possible = sum(q.points for q, _ in questions)
    earned = sum(q.points for (q, _), ok in zip(questions, correct, strict=True) if ok)
    return {"igakuqa/questions": float(len(questions)),
            "igakuqa/accuracy": sum(correct) / len(questions),
            "igakuqa/score": earned / possible if possible else math.nan,
            "igakuqa/prohibited_rate": sum(selects_prohibited(q, a) for q, a in questions) / len(questions)}


TASK = Task(name="igakuqa", rewards={"mcq_answer": 1.5, "japanese_only": 1.0}, format_ok=has_answer_tag,
            score=official_score, eval_metrics=benchmark_metrics, probe_response=format_answer("a"))
