"""Group-normalized advantages (GRPO, Dr.GRPO) with zero-variance group reporting.

Rewards come as ``[num_groups * G]`` (each prompt's G samples contiguous) or as
``[num_groups, G]``; the advantages keep the input's shape.

* ``grpo``:    A = (r − mean_g) / (std_g + eps)
* ``dr_grpo``: A = r − mean_g  (Dr.GRPO drops the std division, which otherwise
  up-weights prompts that are nearly always solved or nearly always failed)

std is by default the POPULATION standard deviation (divide by G, ``unbiased=False``):
it is the spread of this finite group, not an estimate of a wider population, so the
normalized group has exactly zero mean and unit variance and the formula is defined
for G = 1. ``unbiased=True`` is Bessel's correction, torch.std's default and the one
ms-swift (``(r − mean) / (std + 1e-4)``, ``_compute_advantages``), TRL and verl use: it
shrinks advantages by sqrt((G−1)/G), ×0.707 at G = 2, ×0.968 at G = 16. A global
rescale only to a first approximation: it moves the policy term against the KL and
SFT terms and against the gradient clip, so recipes that reproduce ms-swift runs
choose it (``algorithm.advantage_std: unbiased``, ``advantage_eps: 1e-4``).

A group whose rewards are all equal carries no learning signal: its advantages are
exactly 0 (set explicitly, not left to rounding of r − mean). Such groups are
reported, and with ``drop_zero_variance`` a per-sample keep-mask is returned so the
caller can drop them (DAPO's dynamic sampling). Zero variance is detected by
max == min, which is exact, rather than by a tolerance on std.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from megatron_rl.registry import Registry

# An estimator maps grouped rewards [num_groups, G], eps and whether the std is unbiased to
# advantages [num_groups, G].
AdvantageEstimator = Callable[[Tensor, float, bool], Tensor]
ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = Registry("advantage estimator")


@ADVANTAGE_ESTIMATORS.register("grpo")
def _grpo(grouped: Tensor, eps: float, unbiased: bool) -> Tensor:
    centered = grouped - grouped.mean(dim=-1, keepdim=True)
    if unbiased and grouped.shape[-1] < 2:
        return torch.zeros_like(grouped)       # one sample has no spread (and every G-1 std is NaN)
    return centered / (grouped.std(dim=-1, unbiased=unbiased, keepdim=True) + eps)


@ADVANTAGE_ESTIMATORS.register("dr_grpo")
def _dr_grpo(grouped: Tensor, eps: float, unbiased: bool) -> Tensor:
    return grouped - grouped.mean(dim=-1, keepdim=True)


def available_advantage_estimators() -> list[str]:
    return ADVANTAGE_ESTIMATORS.names()


@dataclass
class AdvantageResult:
    """Advantages (input shape), zero-variance groups, and the optional keep-mask.

    ``sample_mask`` (bool, input shape, True = keep) is set only when dropping was
    requested; ``zero_variance_groups`` is a bool per group.
    """

    advantages: Tensor
    zero_variance_groups: Tensor
    num_zero_variance: int
    frac_zero_variance: float
    sample_mask: Tensor | None = None


def group_rewards(rewards: Tensor, group_size: int | None) -> Tensor:
    """View rewards as [num_groups, G]; a 1-D input needs ``group_size``."""
    if rewards.dim() == 2:
        if group_size is not None and rewards.shape[1] != group_size:
            raise ValueError(f"rewards {tuple(rewards.shape)} do not have group_size {group_size}")
        return rewards
    if rewards.dim() != 1 or group_size is None or group_size < 1:
        raise ValueError("rewards must be [num_groups, G], or [num_groups*G] with group_size >= 1")
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    return rewards.reshape(-1, group_size)


def compute_advantages(
    rewards: Tensor,
    group_size: int | None = None,
    estimator: str = "grpo",
    eps: float = 1e-6,
    drop_zero_variance: bool = False,
    unbiased: bool = False,
) -> AdvantageResult:
    """Group-normalized advantages of ``rewards`` with the named ``estimator``.

    Computed in float64 (rewards are few; this removes any doubt about the mean of
    identical float32 values) and returned in the rewards' floating dtype (float32
    for integer rewards).
    """
    estimate = ADVANTAGE_ESTIMATORS.get(estimator)
    out_dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    grouped = group_rewards(rewards, group_size).detach().to(torch.float64)
    zero_var = grouped.amax(dim=-1) == grouped.amin(dim=-1)
    adv = estimate(grouped, eps, unbiased).masked_fill(zero_var.unsqueeze(-1), 0.0)
    num_zero = int(zero_var.sum())
    keep = None
    if drop_zero_variance:
        keep = (~zero_var).unsqueeze(-1).expand(grouped.shape).reshape(rewards.shape)
    return AdvantageResult(
        advantages=adv.to(out_dtype).reshape(rewards.shape),
        zero_variance_groups=zero_var,
        num_zero_variance=num_zero,
        frac_zero_variance=num_zero / max(grouped.shape[0], 1),
        sample_mask=keep,
    )
