"""RL objectives (GRPO, GSPO, GSPO-token, CHORD) over one shared input record.

Importing the package registers every built-in objective, aggregation mode, KL
estimator and mismatch correction. Typical trainer use::

    denoms = all_reduce_denominators(denominators_from_masks(masks, max_len), dp_group)
    out = get_objective(name)(inputs, cfg, denoms, step=step, sft_denoms=sft_denoms)
    out.loss.backward()                       # per micro-batch
    stats = finalize_metrics(all_reduce_metrics(combine_metrics(all_metrics), dp_group))
"""

from megatron_rl.objectives import chord, grpo, gspo  # noqa: F401  (registration)
from megatron_rl.objectives.aggregation import (
    GlobalDenominators,
    aggregate,
    aggregation_weights,
    all_reduce_denominators,
    available_aggregations,
    denominators_from_masks,
)
from megatron_rl.objectives.chord import mu_schedule, phi_weights
from megatron_rl.objectives.common import CORRECTIONS, KL_ESTIMATORS, clipped_surrogate, kl_estimate
from megatron_rl.objectives.metrics import (
    all_reduce_metrics,
    combine_metrics,
    finalize_metrics,
    reduce_metrics,
)
from megatron_rl.objectives.registry import (
    available_objectives,
    get_objective,
    register_objective,
)
from megatron_rl.objectives.types import LossInputs, LossOutput

__all__ = [
    "CORRECTIONS",
    "GlobalDenominators",
    "KL_ESTIMATORS",
    "LossInputs",
    "LossOutput",
    "aggregate",
    "aggregation_weights",
    "all_reduce_denominators",
    "all_reduce_metrics",
    "available_aggregations",
    "available_objectives",
    "clipped_surrogate",
    "combine_metrics",
    "denominators_from_masks",
    "finalize_metrics",
    "get_objective",
    "kl_estimate",
    "mu_schedule",
    "phi_weights",
    "reduce_metrics",
    "register_objective",
]
