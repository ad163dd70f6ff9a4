"""CHORD: on-policy RL blended with SFT on expert demonstrations.

loss = (1 − μ_t)·L_RL + μ_t·L_SFT, where L_RL is any registered objective
(``cfg.chord.rl_objective``) on the rollout stream and L_SFT is the negative
log-likelihood of the expert tokens (their own mask and global denominators,
aggregated with ``cfg.chord.sft_loss_agg_mode``). With ``chord.phi`` each expert token's
NLL is weighted by φ_t = p_t(1 − p_t) (p_t = exp(log-prob of the expert token),
stop-gradient), which down-weights tokens the policy already knows (p → 1) and
tokens far from it (p → 0), peaking at p = 0.5.
"""

from __future__ import annotations

import math

from torch import Tensor

from megatron_rl.config.schema import AlgorithmConfig
from megatron_rl.objectives.aggregation import GlobalDenominators, aggregation_weights
from megatron_rl.objectives.common import Metrics, masked_stats, masked_sum, unit_counts
from megatron_rl.objectives.registry import get_objective, register_objective
from megatron_rl.objectives.types import LossInputs, LossOutput


def optimizer_step(rollout_step: int, steps_per_generation: int, minibatch: int) -> int:
    """Optimizer updates done before minibatch ``minibatch`` (0-based) of rollout step
    ``rollout_step`` (1-based): the unit of μ's schedule. ms-swift's CHORD counts
    ``trainer.state.global_step``, i.e. optimizer steps (swift/trainers/rlhf_trainer/utils.py,
    release/3.11), and so does our LR schedule; counting rollout steps instead would make
    "decay over 500 steps" last 500 × steps_per_generation updates. That is ms-swift's
    *transformers* trainer: its 3.11 Megatron path (001's) has no CHORD at all, and 001 plugged
    CHORD in itself without stating the unit, so optimizer steps are our reading, not 001's."""
    return (rollout_step - 1) * steps_per_generation + minibatch


def mu_schedule(step: int, mu_peak: float, mu_valley: float, warmup_steps: int, decay_steps: int) -> float:
    """μ_t at optimizer step ``step`` (``optimizer_step``): linear 0 → μ_peak over
    ``warmup_steps``, cosine μ_peak → μ_valley over ``decay_steps``, then constant μ_valley
    (μ(warmup) = μ_peak, μ(warmup+decay) = μ_valley)."""
    if step < warmup_steps:
        return mu_peak * step / warmup_steps
    if step < warmup_steps + decay_steps:
        progress = (step - warmup_steps) / decay_steps
        return mu_valley + (mu_peak - mu_valley) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return mu_valley


def phi_weights(logprobs: Tensor) -> Tensor:
    """φ = p(1 − p) with p = exp(logprobs), detached (a weight, not a loss term)."""
    p = logprobs.detach().exp()
    return p * (1.0 - p)


def sft_loss(
    logprobs: Tensor, mask: Tensor, denoms: GlobalDenominators, mode: str, phi: bool
) -> tuple[Tensor, Metrics]:
    """(φ-weighted) NLL of expert tokens, aggregated with the SFT stream's denominators."""
    nll = -logprobs
    if phi:
        weights_phi = phi_weights(logprobs)
        nll = nll * weights_phi
    loss = masked_sum(nll * aggregation_weights(mask, denoms, mode, nll.dtype), mask)
    counts = unit_counts(mask)
    metrics: Metrics = {"sft_token/count": counts["token/count"], "sft_seq/count": counts["seq/count"]}
    metrics.update(masked_stats("sft_token/nll", -logprobs, mask))
    if phi:
        metrics.update(masked_stats("sft_token/phi", weights_phi, mask))
    return loss, metrics


@register_objective("chord")
def chord(
    inputs: LossInputs,
    cfg: AlgorithmConfig,
    denoms: GlobalDenominators,
    *,
    step: int = 0,
    sft_denoms: GlobalDenominators | None = None,
) -> LossOutput:
    c = cfg.chord
    if c.rl_objective == "chord":
        raise ValueError("chord's rl_objective cannot be chord itself")
    if inputs.sft_logprobs is None or inputs.sft_mask is None or sft_denoms is None:
        raise ValueError("chord needs sft_logprobs, sft_mask and sft_denoms")
    mu = mu_schedule(step, c.mu_peak, c.mu_valley, c.mu_warmup_steps, c.mu_decay_steps)
    rl = get_objective(c.rl_objective)(inputs, cfg, denoms, step=step)
    sft, sft_metrics = sft_loss(
        inputs.sft_logprobs, inputs.sft_mask, sft_denoms, c.sft_loss_agg_mode, c.phi
    )
    loss = (1.0 - mu) * rl.loss + mu * sft
    metrics = dict(rl.metrics)
    metrics["loss/rl"] = metrics.pop("loss/total")
    metrics.update(sft_metrics)
    metrics["loss/sft"] = sft.detach()
    metrics["loss/total"] = loss.detach()
    metrics["const/mu"] = loss.new_tensor(mu).detach()
    return LossOutput(loss, metrics)
