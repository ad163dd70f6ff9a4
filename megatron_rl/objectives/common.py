"""Building blocks shared by all objectives.

Log-ratios, clamped exponentials, masked reductions, the PPO clipped surrogate,
KL estimators, the entropy bonus and the rollout↔trainer mismatch correction live
here once; the objectives only decide which ratio feeds the surrogate.

Masks are ``[B, T]`` (bool or float, non-zero = valid). Padded positions may hold
any finite value: reductions select with ``torch.where`` and log-ratios are clamped
before ``exp``, so padding never reaches the loss or overflows. (NaN on padding
would still poison the backward of ``exp``; the log-prob kernel never emits it.)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from megatron_rl.config.schema import AlgorithmConfig, CorrectionConfig
from megatron_rl.objectives.aggregation import GlobalDenominators, aggregation_weights
from megatron_rl.objectives.types import LossInputs
from megatron_rl.registry import Registry

Metrics = dict[str, Tensor]

LOG_RATIO_CLAMP = 20.0
"""Every log-ratio is clamped to ±this before ``exp`` (overflow guard, not a hyper-parameter)."""


# ----------------------------------------------------------------------------- masks


def bool_mask(mask: Tensor) -> Tensor:
    return mask if mask.dtype == torch.bool else mask != 0


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    zeros = x.new_zeros(())
    selected = torch.where(bool_mask(mask), x, zeros)
    return selected.sum() if dim is None else selected.sum(dim=dim)


def masked_stats(name: str, x: Tensor, mask: Tensor) -> Metrics:
    """``{name}_sum/_min/_max`` of the valid entries (detached; ±inf when empty)."""
    x = x.detach()
    m = bool_mask(mask)
    inf = torch.full((), math.inf, dtype=x.dtype, device=x.device)
    return {
        f"{name}_sum": masked_sum(x, m),
        f"{name}_min": torch.where(m, x, inf).min() if x.numel() else inf,
        f"{name}_max": torch.where(m, x, -inf).max() if x.numel() else -inf,
    }


def count(mask: Tensor) -> Tensor:
    return bool_mask(mask).sum().to(torch.float64)


def unit_counts(mask: Tensor) -> Metrics:
    """Denominators for :func:`reduce_metrics`: valid tokens and non-empty sequences."""
    m = bool_mask(mask)
    return {"token/count": count(m), "seq/count": count(m.any(dim=-1))}


# ---------------------------------------------------------------------- ratios


def log_ratio(logp: Tensor, logp_base: Tensor, clamp: float) -> Tensor:
    """``logp − logp_base`` clamped to ±clamp.

    The clamp (default ±20, i.e. ratios in [2e-9, 5e8]) only guards ``exp`` against
    overflow from garbage on padding or a diverged policy; inside it the gradient is
    exact, outside it is zero, which is the safe choice for such outliers.
    """
    return (logp - logp_base).clamp(-clamp, clamp)


def clamped_exp(log_value: Tensor, clamp: float) -> Tensor:
    return torch.exp(log_value.clamp(-clamp, clamp))


def sequence_log_ratio(token_log_ratio: Tensor, mask: Tensor, mean: bool) -> Tensor:
    """Σ_t (``mean=False``) or mean_t (``mean=True``) of token log-ratios, per row [B]."""
    total = masked_sum(token_log_ratio, mask, dim=-1)
    if not mean:
        return total
    return total / bool_mask(mask).sum(dim=-1).clamp_min(1).to(total.dtype)


def token_advantages(advantages: Tensor, mask: Tensor) -> Tensor:
    """Broadcast per-sequence advantages [B] to [B, T]; per-token ones pass through."""
    adv = advantages.detach()
    if adv.dim() == 1:
        return adv.unsqueeze(-1).expand(mask.shape)
    if adv.shape != mask.shape:
        raise ValueError(f"advantages {tuple(adv.shape)} do not match mask {tuple(mask.shape)}")
    return adv


# ---------------------------------------------------------- clipped surrogate


@dataclass
class Surrogate:
    """Per-element PPO loss and where each clip was the active branch."""

    loss: Tensor
    clip_low: Tensor
    clip_high: Tensor
    dual_clip: Tensor


def clipped_surrogate(
    ratio: Tensor,
    advantages: Tensor,
    eps_low: float,
    eps_high: float,
    dual_clip_c: float | None = None,
) -> Surrogate:
    """PPO loss ``max(−A·r, −A·clip(r, 1−ε_low, 1+ε_high))``, optionally dual-clipped.

    Dual-clip caps the loss of negative-advantage elements at ``−A·c``: without it a
    huge ratio on a bad token would produce an unbounded push. The ``clip_*`` flags
    mark elements whose gradient is zeroed by a clip (the active branch).
    """
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    loss = torch.maximum(unclipped, clipped)
    r = ratio.detach()
    clip_high = (advantages > 0) & (r > 1.0 + eps_high)
    clip_low = (advantages < 0) & (r < 1.0 - eps_low)
    dual_clip = torch.zeros_like(clip_low)
    if dual_clip_c is not None:
        dual_clip = (advantages < 0) & (r > dual_clip_c)
        loss = torch.where(advantages < 0, torch.minimum(loss, -advantages * dual_clip_c), loss)
    return Surrogate(loss, clip_low, clip_high, dual_clip)


def surrogate_metrics(unit: str, s: Surrogate, mask: Tensor) -> Metrics:
    m = bool_mask(mask)
    return {
        f"{unit}/clip_low_count": count(s.clip_low & m),
        f"{unit}/clip_high_count": count(s.clip_high & m),
        f"{unit}/dual_clip_count": count(s.dual_clip & m),
    }


# ------------------------------------------------------------------ KL estimators

# Each estimator maps the clamped log-ratio δ = logp − ref_logp to a per-token
# estimate of KL(π‖π_ref) under samples from π.
KLEstimator = Callable[[Tensor], Tensor]
KL_ESTIMATORS: Registry[KLEstimator] = Registry("KL estimator")


@KL_ESTIMATORS.register("k1")
def _kl_k1(delta: Tensor) -> Tensor:
    return delta


@KL_ESTIMATORS.register("k2")
def _kl_k2(delta: Tensor) -> Tensor:
    return 0.5 * delta.square()


@KL_ESTIMATORS.register("k3")
def _kl_k3(delta: Tensor) -> Tensor:
    # Schulman's low-variance estimator exp(−δ) + δ − 1 ≥ 0 (unbiased, since E[exp(−δ)] = 1).
    return torch.expm1(-delta) + delta


def kl_estimate(
    logp: Tensor, ref_logp: Tensor, estimator: str, value_clamp: float | None, log_clamp: float
) -> Tensor:
    """Per-token KL estimate; ``value_clamp`` bounds it to ±value_clamp.

    The value clamp limits the damage of a few tokens where π and π_ref disagree
    wildly (k3 grows like exp(|δ|)); clamped tokens contribute no gradient.
    """
    kl = KL_ESTIMATORS.get(estimator)(log_ratio(logp, ref_logp.detach(), log_clamp))
    return kl if value_clamp is None else kl.clamp(-value_clamp, value_clamp)


# ------------------------------------------------------- mismatch correction
#
# The rollout engine (vLLM) and the trainer (Megatron) compute slightly different
# probabilities for the same behaviour policy. With δ_t = logp_old − logp_rollout
# (trainer over engine), the policy-gradient term of each token is multiplied by a
# stop-gradient weight w:
#
# * tis_token:  w_t = min(exp(δ_t), C)                      truncated IS per token
# * tis_seq:    w_i = min(exp(Δ_i), C) for every token of sequence i
# * mask_token: w_t = 1 if exp(δ_t) ∈ [1/θ, θ] else 0
# * mask_seq:   w_i = 1 if exp(Δ_i) ∈ [1/θ, θ] else 0
#
# Δ_i = Σ_t δ_t by default: the exact sequence-level importance ratio
# π_old(y)/π_rollout(y). With ``correction.seq_mean`` it is mean_t δ_t (geometric
# mean, GSPO-style), which does not grow with length and suits masking long outputs.
# Masked tokens keep counting in the global denominators (weight 0, like a TIS
# weight), so the caller's denominators stay independent of the correction.
# Only the policy-gradient term is weighted; the KL and entropy terms are not.
# With asynchronous rollout (`rollout.max_staleness` > 0) logp_rollout comes from
# weights up to k versions older than π_old, so δ_t also measures the staleness
# (`LossInputs`); the same weights correct for both.

CorrectionFn = Callable[[Tensor, Tensor, CorrectionConfig], tuple[Tensor | None, Metrics]]
CORRECTIONS: Registry[CorrectionFn] = Registry("mismatch correction mode")


def _seq_delta(delta: Tensor, mask: Tensor, c: CorrectionConfig) -> Tensor:
    per_seq = sequence_log_ratio(delta, mask, c.seq_mean)
    return per_seq.unsqueeze(-1).expand(delta.shape)


@CORRECTIONS.register("none")
def _no_correction(delta: Tensor, mask: Tensor, c: CorrectionConfig) -> tuple[None, Metrics]:
    return None, {}


@CORRECTIONS.register("tis_token")
def _tis_token(delta: Tensor, mask: Tensor, c: CorrectionConfig) -> tuple[Tensor, Metrics]:
    raw = clamped_exp(delta, LOG_RATIO_CLAMP)
    truncated = (raw > c.cap) & bool_mask(mask)
    return raw.clamp(max=c.cap), {"token/tis_truncated_count": count(truncated)}


@CORRECTIONS.register("tis_seq")
def _tis_seq(delta: Tensor, mask: Tensor, c: CorrectionConfig) -> tuple[Tensor, Metrics]:
    raw = clamped_exp(_seq_delta(delta, mask, c), LOG_RATIO_CLAMP)
    truncated = (raw[:, 0] > c.cap) & bool_mask(mask).any(dim=-1)
    return raw.clamp(max=c.cap), {"seq/tis_truncated_count": count(truncated)}


@CORRECTIONS.register("mask_token")
def _mask_token(delta: Tensor, mask: Tensor, c: CorrectionConfig) -> tuple[Tensor, Metrics]:
    keep = delta.abs() <= math.log(c.threshold)
    dropped = ~keep & bool_mask(mask)
    return keep.to(delta.dtype), {"token/masked_count": count(dropped)}


@CORRECTIONS.register("mask_seq")
def _mask_seq(delta: Tensor, mask: Tensor, c: CorrectionConfig) -> tuple[Tensor, Metrics]:
    keep = _seq_delta(delta, mask, c).abs() <= math.log(c.threshold)
    dropped = ~keep[:, 0] & bool_mask(mask).any(dim=-1)
    return keep.to(delta.dtype), {"seq/masked_count": count(dropped)}


def mismatch_correction(inputs: LossInputs, c: CorrectionConfig) -> tuple[Tensor | None, Metrics]:
    """Detached per-token weights for the policy-gradient term (None = all ones). The trainer
    passes the recipe's mode in force (`RecipeConfig.algorithm_in_force`); an 'auto' that reaches
    here comes from an `AlgorithmConfig` without a recipe, which knows no staleness: on-policy."""
    mode = "none" if c.mode == "auto" else c.mode
    correct = CORRECTIONS.get(mode)
    if inputs.rollout_logprobs is None:
        if mode != "none":
            raise ValueError(f"correction mode {mode!r} needs rollout_logprobs")
        return None, {}
    delta = log_ratio(inputs.old_logprobs.detach(), inputs.rollout_logprobs.detach(), LOG_RATIO_CLAMP)
    weights, metrics = correct(delta, inputs.mask, c)
    metrics.update(masked_stats("token/mismatch_abs", delta.abs(), inputs.mask))
    if weights is not None:
        weights = weights.detach()
        metrics.update(masked_stats("token/is_weight", weights, inputs.mask))
    return weights, metrics


# ------------------------------------------------------------- loss assembly


def policy_loss(
    pg: Tensor, inputs: LossInputs, cfg: AlgorithmConfig, denoms: GlobalDenominators
) -> tuple[Tensor, Metrics]:
    """Total loss from a per-token policy-gradient loss ``pg`` [B, T].

    Applies the mismatch weights to ``pg``, adds ``kl_beta``·KL and the entropy
    bonus, aggregates all of them with ``cfg.loss_agg_mode`` and the global
    denominators, and returns the scalar with additive metrics. ``loss/kl`` and
    ``loss/entropy`` are the aggregated KL and entropy themselves (not scaled by
    their coefficients); ``loss/total = loss/pg + β·loss/kl − c·loss/entropy``.
    """
    mask = inputs.mask
    weights = aggregation_weights(mask, denoms, cfg.loss_agg_mode, pg.dtype)
    is_weights, metrics = mismatch_correction(inputs, cfg.correction)
    if is_weights is not None:
        pg = pg * is_weights
    total = masked_sum(pg * weights, mask)
    metrics["loss/pg"] = total.detach()
    metrics.update(unit_counts(mask))
    for coef, term in _regularizers(inputs, cfg, weights, metrics):
        total = total + coef * term
    metrics["loss/total"] = total.detach()
    return total, metrics


def kl_loss_beta(cfg: AlgorithmConfig) -> float:
    """The KL coefficient of the loss: 0 when the penalty goes into the reward instead."""
    return 0.0 if cfg.kl_in_reward else cfg.kl_beta


def _regularizers(
    inputs: LossInputs, cfg: AlgorithmConfig, weights: Tensor, metrics: Metrics
) -> list[tuple[float, Tensor]]:
    """(coefficient, aggregated term) pairs for KL and entropy; logs them when available.

    A term with a zero coefficient is only logged (detached) so that its backward,
    e.g. through the entropy of the log-prob kernel, is not paid for nothing.
    """
    mask = inputs.mask
    terms: list[tuple[float, Tensor]] = []
    beta = kl_loss_beta(cfg)
    if inputs.ref_logprobs is None and beta != 0:
        raise ValueError("kl_beta != 0 (with kl_in_reward off) needs ref_logprobs")
    if inputs.entropy is None and cfg.entropy_coef != 0:
        raise ValueError("entropy_coef != 0 needs entropy")
    if inputs.ref_logprobs is not None:
        logp = inputs.logprobs if beta != 0 else inputs.logprobs.detach()
        kl = kl_estimate(logp, inputs.ref_logprobs, cfg.kl_estimator, cfg.kl_clamp, LOG_RATIO_CLAMP)
        kl_loss = masked_sum(kl * weights, mask)
        metrics["loss/kl"] = kl_loss.detach()
        metrics.update(masked_stats("token/kl", kl, mask))
        if beta != 0:
            terms.append((beta, kl_loss))
    if inputs.entropy is not None:
        entropy = inputs.entropy if cfg.entropy_coef != 0 else inputs.entropy.detach()
        entropy_agg = masked_sum(entropy * weights, mask)
        metrics["loss/entropy"] = entropy_agg.detach()
        metrics.update(masked_stats("token/entropy", entropy, mask))
        if cfg.entropy_coef != 0:
            terms.append((-cfg.entropy_coef, entropy_agg))
    return terms
