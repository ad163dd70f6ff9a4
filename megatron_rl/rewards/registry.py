"""Reward registry: rewards register by name; recipes refer to them by name and weight.

A reward is a pure function `(response: str, sample) -> float` where `sample` is a
`megatron_rl.data.schema.PromptRecord` or the equivalent mapping (one decoded JSONL line). Rewards
import only the standard library, so scoring never pulls in torch.

The generic rewards of this package (`language.py`) register when `megatron_rl.rewards` is
imported; a task's own rewards live in its folder (`megatron_rl/tasks/<name>/`) and register when
that module is imported. `megatron_rl.tasks.reward_function` imports every built-in task first, so
a recipe can name any built-in reward.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from megatron_rl.registry import Registry

RewardFn = Callable[[str, Any], float]

# Responses longer than this are scored on their last MAX_TAIL_CHARS characters only. The answer
# tag is asked for at the end of the response, and a rollout is capped by max_new_tokens anyway
# (4096 characters is 2–4k tokens of Japanese), so in normal operation the tail is the whole
# response. The bound is what keeps a reward's cost independent of response length: a degenerate
# 1 MB rollout costs the same few microseconds as a normal one.
MAX_TAIL_CHARS = 4096


class UnknownRewardError(ValueError):
    """Raised for a reward name that is not registered; the message lists the allowed names."""


REWARDS: Registry[RewardFn] = Registry("reward", error=UnknownRewardError)


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator: register `fn` under `name` (names are unique)."""
    return REWARDS.register(name)


def available_rewards() -> list[str]:
    return REWARDS.names()


def get_reward(name: str) -> RewardFn:
    return REWARDS.get(name)


def combine(weights: Mapping[str, float], response: str,
            sample: Any) -> tuple[float, dict[str, float]]:
    """Weighted sum of rewards: returns (sum of weight * reward, {name: unweighted reward}).

    All names are resolved before any reward runs, so a typo fails before work is done.
    """
    fns: dict[str, RewardFn] = {}
    for name, weight in weights.items():
        if not isinstance(weight, (int, float)) or isinstance(weight, bool) \
                or not math.isfinite(weight):
            raise ValueError(f"weight for reward {name!r} must be a finite number, got {weight!r}")
        fns[name] = get_reward(name)
    per_name = {name: float(fn(response, sample)) for name, fn in fns.items()}
    total = sum(float(weights[name]) * value for name, value in per_name.items())
    return total, per_name


def tail(text: str, limit: int = MAX_TAIL_CHARS) -> str:
    return text[-limit:] if len(text) > limit else text


def sample_field(sample: Any, name: str, default: Any = None) -> Any:
    """Field `name` of a sample: top-level key/attribute first, then its `metadata`."""
    if isinstance(sample, Mapping):
        if name in sample:
            return sample[name]
        metadata = sample.get("metadata")
    else:
        if hasattr(sample, name):
            return getattr(sample, name)
        metadata = getattr(sample, "metadata", None)
    if isinstance(metadata, Mapping) and name in metadata:
        return metadata[name]
    return default
