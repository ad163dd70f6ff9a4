"""A task and rewards defined outside `megatron_rl`, the way a user writes them; the recipe in
tests/e2e/test_task_plugins.py names them by their Python paths."""

from __future__ import annotations

import os
from typing import Any

from megatron_rl.data.schema import PromptRecord
from megatron_rl.tasks import Task

# The prompt format appends each record id it renders here, so the test can see that the trainer
# used this task's prompt format.
PROMPT_LOG_ENV = "CUSTOM_TASK_PROMPT_LOG"


def brevity(response: str, sample: Any) -> float:
    """1.0 for an empty response, falling linearly to 0.0 at 32 characters."""
    return max(0.0, 1.0 - len(response) / 32)


def one_argument(response: str) -> float:
    return 0.0


def terse_prompt(record: PromptRecord) -> list[dict[str, str]]:
    log = os.environ.get(PROMPT_LOG_ENV)
    if log:
        with open(log, "a", encoding="utf-8") as f:
            f.write(record.id + "\n")
    return [*record.messages[:-1], {"role": "user", "content": record.messages[-1]["content"] + " Be brief."}]


TASK = Task(name="terse", rewards={"tests.helpers.custom_task:brevity": 1.0}, prompt=terse_prompt,
            probe_response="[ans]b[/ans]")
NOT_A_TASK = 42
