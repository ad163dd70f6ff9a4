"""GSPO: Group Sequence Policy Optimization (sequence-level importance ratio).

``gspo``: s_i = exp(mean_t(log π − log π_old)) over the response mask (the
geometric mean of the token ratios), clipped to [1−ε_low, 1+ε_high] (the paper
uses ε_low = 3e-4, ε_high = 4e-4) with the sequence advantage A_i. The sequence
loss is broadcast to the sequence's tokens so the shared aggregation modes apply;
``seq-mean-token-mean`` reproduces the paper's 1/G Σ_i. Clip counts are per
sequence (``seq/clip_*_count``).

``gspo_token``: s_{i,t} = sg[s_i] · π_t / sg[π_t] with per-token advantages. Its
value equals s_i and ∂s_{i,t}/∂log π_t = s_i, so with a constant advantage per
sequence it matches ``gspo`` in value and gradient under every aggregation mode
(all modes weight the tokens of one sequence uniformly). Clip counts are per token.
"""

from __future__ import annotations

from torch import Tensor

from megatron_rl.config.schema import AlgorithmConfig
from megatron_rl.objectives.aggregation import GlobalDenominators
from megatron_rl.objectives.common import (
    LOG_RATIO_CLAMP,
    bool_mask,
    clamped_exp,
    clipped_surrogate,
    log_ratio,
    masked_stats,
    masked_sum,
    policy_loss,
    sequence_log_ratio,
    surrogate_metrics,
    token_advantages,
)
from megatron_rl.objectives.registry import register_objective
from megatron_rl.objectives.types import LossInputs, LossOutput


def sequence_log_ratio_of(inputs: LossInputs, cfg: AlgorithmConfig) -> Tensor:
    """log s_i = mean over valid tokens of (log π − log π_old), shape [B]."""
    token_lr = log_ratio(inputs.logprobs, inputs.old_logprobs.detach(), LOG_RATIO_CLAMP)
    return sequence_log_ratio(token_lr, inputs.mask, mean=True)


def sequence_advantages(advantages: Tensor, mask: Tensor) -> Tensor:
    """[B] advantages; per-token input is reduced by its masked mean.

    GSPO is defined with one advantage per sequence, so the mean is exact when the
    per-token advantages are a broadcast; use ``gspo_token`` for varying ones.
    """
    adv = advantages.detach()
    if adv.dim() == 1:
        return adv
    lengths = bool_mask(mask).sum(dim=-1).clamp_min(1).to(adv.dtype)
    return masked_sum(token_advantages(adv, mask), mask, dim=-1) / lengths


@register_objective("gspo")
def gspo(
    inputs: LossInputs,
    cfg: AlgorithmConfig,
    denoms: GlobalDenominators,
    *,
    step: int = 0,
    sft_denoms: GlobalDenominators | None = None,
) -> LossOutput:
    seq_ratio = clamped_exp(sequence_log_ratio_of(inputs, cfg), LOG_RATIO_CLAMP)
    seq_adv = sequence_advantages(inputs.advantages, inputs.mask)
    surrogate = clipped_surrogate(seq_ratio, seq_adv, cfg.clip_eps_low, cfg.clip_eps_high, cfg.dual_clip_c)
    token_loss = surrogate.loss.unsqueeze(-1).expand(inputs.mask.shape)
    loss, metrics = policy_loss(token_loss, inputs, cfg, denoms)
    non_empty = bool_mask(inputs.mask).any(dim=-1)
    metrics.update(surrogate_metrics("seq", surrogate, non_empty))
    metrics.update(masked_stats("seq/ratio", seq_ratio, non_empty))
    return LossOutput(loss, metrics)


@register_objective("gspo_token")
def gspo_token(
    inputs: LossInputs,
    cfg: AlgorithmConfig,
    denoms: GlobalDenominators,
    *,
    step: int = 0,
    sft_denoms: GlobalDenominators | None = None,
) -> LossOutput:
    seq_lr = sequence_log_ratio_of(inputs, cfg).detach()
    logp = inputs.logprobs
    token_log_ratio = seq_lr.unsqueeze(-1) + (logp - logp.detach())
    ratio = clamped_exp(token_log_ratio, LOG_RATIO_CLAMP)
    adv = token_advantages(inputs.advantages, inputs.mask)
    surrogate = clipped_surrogate(ratio, adv, cfg.clip_eps_low, cfg.clip_eps_high, cfg.dual_clip_c)
    loss, metrics = policy_loss(surrogate.loss, inputs, cfg, denoms)
    metrics.update(surrogate_metrics("token", surrogate, inputs.mask))
    non_empty = bool_mask(inputs.mask).any(dim=-1)
    metrics.update(masked_stats("seq/ratio", seq_lr.exp(), non_empty))
    return LossOutput(loss, metrics)
