"""A task: how a prompt is shown to the policy, how a response is rewarded, how it is scored.

The trainer knows tasks only through this class. Built-in tasks (`mcq`, `igakuqa`, `medmcqa`)
are modules with a `TASK` attribute, found exactly like a user's task (see `plugins.py`), so a new
task never means editing the trainer.

A reward (or a scorer) is a pure function `(response: str, sample) -> float`; `sample` is the
prompt's JSONL record as a dict (`megatron_rl.data.schema.PromptRecord.to_dict()`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..data.schema import PromptRecord

RewardFn = Callable[[str, Any], float]
Messages = list[dict[str, str]]


def stored_messages(record: PromptRecord) -> Messages:
    """The default prompt format: the chat messages the data file already holds."""
    return record.messages


@dataclass(frozen=True, kw_only=True)
class Task:
    name: str
    """Shown in the start-up summary and the resolved recipe."""
    rewards: Mapping[str, float]
    """Default reward weights (registered names or `module.path:function`), used when the recipe's
    `rewards.weights` is empty."""
    prompt: Callable[[PromptRecord], Messages] = stored_messages
    """The prompt format: chat messages for one record (rendered with the tokenizer's template)."""
    format_ok: Callable[[str], bool] | None = None
    """Does a response have the answer format? Its batch mean is logged as `format_rate`."""
    score: RewardFn | None = None
    """The eval scorer: 1.0 for a correct response. Its batch mean is logged as `accuracy`."""
    eval_metrics: Callable[[list[str], list[Any]], dict[str, float]] | None = None
    """Extra metrics of a periodic evaluation pass over (responses, samples), logged under `eval/`
    (e.g. the benchmark's own points and prohibited-choice rate)."""
    probe_response: str = "The answer is 42."
    """Text appended to a few prompts to check, after each weight sync, that the rollout server and
    the trainer compute the same log-probs. Any text in the task's vocabulary works."""


@dataclass(frozen=True)
class LoadedTask:
    """A task with the recipe's reward functions resolved (what the loop calls)."""

    task: Task
    weights: dict[str, float]
    functions: dict[str, RewardFn] = field(repr=False)

    def reward(self, response: str, sample: Any) -> tuple[float, dict[str, float]]:
        """(Σ weight · reward, {name: unweighted reward})."""
        parts = {name: float(fn(response, sample)) for name, fn in self.functions.items()}
        return sum(self.weights[name] * value for name, value in parts.items()), parts

    def batch_metrics(self, responses: list[str], samples: list[Any]) -> dict[str, float]:
        """`format_rate` and `accuracy` over a batch, for the hooks the task defines."""
        out: dict[str, float] = {}
        if responses and self.task.format_ok is not None:
            out["format_rate"] = sum(bool(self.task.format_ok(r)) for r in responses) / len(responses)
        if responses and self.task.score is not None:
            scores = [float(self.task.score(r, s)) for r, s in zip(responses, samples, strict=True)]
            out["accuracy"] = sum(scores) / len(scores)
        return out
