"""Rule-based rewards for medical MCQ RL: answer correctness, prohibited choices, language.

Importing this package registers the built-in rewards (`mcq_answer`, `prohibited_choice`,
`japanese_only`, `medmcqa_strict`, `medmcqa_flexible`) with the registry.
"""

# Importing the reward modules registers them.
from megatron_rl.rewards import language, mcq, medmcqa  # noqa: F401
from megatron_rl.rewards.registry import (
    MAX_TAIL_CHARS,
    UnknownRewardError,
    available_rewards,
    combine,
    get_reward,
    register_reward,
)

__all__ = [
    "MAX_TAIL_CHARS",
    "UnknownRewardError",
    "available_rewards",
    "combine",
    "get_reward",
    "register_reward",
]
