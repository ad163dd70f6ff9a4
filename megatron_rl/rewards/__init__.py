"""Rewards: the registry of reward functions and the generic ones (`japanese_only`).

Importing this package registers the generic rewards; the built-in tasks' own rewards
(`mcq_answer`, `prohibited_choice`, `medmcqa_strict`, `medmcqa_flexible`) live in their task
folders (`megatron_rl/tasks/`) and register when those are imported.
"""

# Importing the reward modules registers them.
from megatron_rl.rewards import language  # noqa: F401
from megatron_rl.rewards.registry import (
    MAX_TAIL_CHARS,
    REWARDS,
    UnknownRewardError,
    available_rewards,
    combine,
    get_reward,
    register_reward,
)

__all__ = [
    "MAX_TAIL_CHARS",
    "REWARDS",
    "UnknownRewardError",
    "available_rewards",
    "combine",
    "get_reward",
    "register_reward",
]
