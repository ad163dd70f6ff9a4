"""IgakuQA (Japanese medical licensing exam) in the `[ans]…[/ans]` format.

Rewards of the published setup: answer correctness (1.5) and staying in Japanese (1.0). The scorer
is the benchmark's official rule (`eval.scoring.is_correct`): the predicted set equals the gold
set or an accepted alternative, and the questions in `ALL_CORRECT_IDS` count for every answer.
"""

from __future__ import annotations

from typing import Any

from ..data.igakuqa import ALL_CORRECT_IDS
from ..rewards.mcq import format_answer, mcq_answer
from ..rewards.registry import sample_field
from .mcq import has_answer_tag
from .task import Task


def official_score(response: str, sample: Any) -> float:
    if sample_field(sample, "id") in ALL_CORRECT_IDS:
        return 1.0
    return mcq_answer(response, sample)


TASK = Task(name="igakuqa", rewards={"mcq_answer": 1.5, "japanese_only": 1.0}, format_ok=has_answer_tag,
            score=official_score, probe_response=format_answer("a"))
