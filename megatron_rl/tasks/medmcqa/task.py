"""MedMCQA (English medical MCQ, options a–d): strict answer-statement parsing.

The reward gives a small credit to a formatted wrong answer (`rewards.py`); the scorer counts
only correct answers.
"""

from __future__ import annotations

from typing import Any

from ..mcq.answer import format_answer, gold_sets
from ..task import Task
from .rewards import extract_medmcqa_answer


def states_an_answer(response: str) -> bool:
    return extract_medmcqa_answer(response, flexible=False) is not None


def correct(response: str, sample: Any) -> float:
    return 1.0 if extract_medmcqa_answer(response, flexible=False) in gold_sets(sample) else 0.0


TASK = Task(name="medmcqa", rewards={"medmcqa_strict": 1.0}, format_ok=states_an_answer, score=correct,
            probe_response=format_answer("a"))
