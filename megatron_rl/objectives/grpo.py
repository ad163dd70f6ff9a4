"""GRPO / PPO-style token-level objective.

Per token: ratio r_t = π(y_t)/π_old(y_t), loss = max(−A·r, −A·clip(r, 1−ε_low, 1+ε_high))
(optionally dual-clipped for A < 0), aggregated with the configured mode. Clip
statistics count tokens.
"""

from __future__ import annotations

from megatron_rl.config.schema import AlgorithmConfig
from megatron_rl.objectives.aggregation import GlobalDenominators
from megatron_rl.objectives.common import (
    LOG_RATIO_CLAMP,
    clipped_surrogate,
    log_ratio,
    masked_stats,
    policy_loss,
    surrogate_metrics,
    token_advantages,
)
from megatron_rl.objectives.registry import register_objective
from megatron_rl.objectives.types import LossInputs, LossOutput


@register_objective("grpo")
def grpo(
    inputs: LossInputs,
    cfg: AlgorithmConfig,
    denoms: GlobalDenominators,
    *,
    step: int = 0,
    sft_denoms: GlobalDenominators | None = None,
) -> LossOutput:
    ratio = log_ratio(inputs.logprobs, inputs.old_logprobs.detach(), LOG_RATIO_CLAMP).exp()
    adv = token_advantages(inputs.advantages, inputs.mask)
    surrogate = clipped_surrogate(ratio, adv, cfg.clip_eps_low, cfg.clip_eps_high, cfg.dual_clip_c)
    loss, metrics = policy_loss(surrogate.loss, inputs, cfg, denoms)
    metrics.update(surrogate_metrics("token", surrogate, inputs.mask))
    metrics.update(masked_stats("token/ratio", ratio, inputs.mask))
    return LossOutput(loss, metrics)
