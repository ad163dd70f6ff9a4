"""Multiple choice in the project's `[ans]…[/ans]` answer format (the demo's task).

A correct response's last answer tag names exactly the gold set (`answer.mcq_answer`).
"""

from __future__ import annotations

from ..task import Task
from .answer import extract_answer, format_answer, mcq_answer


def has_answer_tag(response: str) -> bool:
    return extract_answer(response) is not None


TASK = Task(name="mcq", rewards={"mcq_answer": 1.0}, format_ok=has_answer_tag, score=mcq_answer,
            probe_response=format_answer("a"))
