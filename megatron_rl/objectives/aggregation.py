"""Loss aggregation over tokens and sequences with GLOBAL denominators.

The contract: a micro-batch's loss is ``Σ_local (per-token loss × weight)`` where
the weights divide by denominators counted over ALL micro-batches of the step and
all data-parallel ranks (:class:`GlobalDenominators`, computed by the caller).
Summing the micro-batch losses (gradient accumulation + DP all-reduce SUM) then
gives exactly the loss of one big batch, independent of how it was split — which a
per-micro-batch mean would not.

Modes (``B`` = sequences with at least one valid token, ``N`` = valid tokens):

* ``token-mean``:              Σ_tokens ℓ / N_global
* ``seq-mean-token-mean``:     Σ_seq (Σ_t ℓ / len_seq) / B_global
* ``seq-mean-token-sum``:      Σ_seq Σ_t ℓ / B_global
* ``seq-mean-token-sum-norm``: Σ_seq Σ_t ℓ / (B_global · L_max) — Dr.GRPO's
  constant normalizer. ``L_max`` must be the configured generation budget
  (max response tokens), NOT the longest response of the batch: only a constant
  removes the length bias that Dr.GRPO is about.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_rl.registry import Registry


@dataclass(frozen=True)
class GlobalDenominators:
    """Step-wide counts: valid tokens, non-empty sequences, max response length."""

    num_tokens: float
    num_sequences: float
    max_response_len: int

    def __post_init__(self) -> None:
        if self.num_tokens < 0 or self.num_sequences < 0 or self.max_response_len < 1:
            raise ValueError(f"invalid denominators {self}")


# A weight function maps (mask [B, T] float, denominators) to per-token weights
# [B, T] such that loss = Σ ℓ · w. Expressing modes as weights keeps the masking and
# the summation in one place and lets metrics reuse the same weighting.
WeightFn = Callable[[Tensor, GlobalDenominators], Tensor]
AGGREGATIONS: Registry[WeightFn] = Registry("loss aggregation mode")


def _safe(denominator: float) -> float:
    # A zero global count means every local mask is empty too; 0/1 keeps the loss
    # at an exact, differentiable zero instead of NaN.
    return max(float(denominator), 1.0)


def sequence_lengths(mask: Tensor) -> Tensor:
    """Valid tokens per sequence (float), at least 1 to keep empty rows finite."""
    return mask.sum(dim=-1).clamp_min(1.0)


@AGGREGATIONS.register("token-mean")
def _token_mean(mask: Tensor, d: GlobalDenominators) -> Tensor:
    return mask / _safe(d.num_tokens)


@AGGREGATIONS.register("seq-mean-token-mean")
def _seq_mean_token_mean(mask: Tensor, d: GlobalDenominators) -> Tensor:
    return mask / sequence_lengths(mask).unsqueeze(-1) / _safe(d.num_sequences)


@AGGREGATIONS.register("seq-mean-token-sum")
def _seq_mean_token_sum(mask: Tensor, d: GlobalDenominators) -> Tensor:
    return mask / _safe(d.num_sequences)


@AGGREGATIONS.register("seq-mean-token-sum-norm")
def _seq_mean_token_sum_norm(mask: Tensor, d: GlobalDenominators) -> Tensor:
    return mask / (_safe(d.num_sequences) * d.max_response_len)


def available_aggregations() -> list[str]:
    return AGGREGATIONS.names()


def aggregation_weights(
    mask: Tensor, denoms: GlobalDenominators, mode: str, dtype: torch.dtype = torch.float32
) -> Tensor:
    """Per-token weights of ``mode`` in ``dtype`` (zero on padding); ``Σ ℓ·w`` is the loss."""
    return AGGREGATIONS.get(mode)((mask != 0).to(dtype), denoms)


def aggregate(values: Tensor, mask: Tensor, denoms: GlobalDenominators, mode: str) -> Tensor:
    """Aggregate per-token ``values`` [B, T] into this micro-batch's share of the loss."""
    weights = aggregation_weights(mask, denoms, mode, values.dtype)
    # where() rather than a plain product so NaN/inf on padded positions cannot leak in.
    return torch.where(weights != 0, values * weights, values.new_zeros(())).sum()


def denominators_from_masks(masks: Sequence[Tensor], max_len: int) -> GlobalDenominators:
    """Denominators over all micro-batch masks of a step (on this process only)."""
    num_tokens = 0.0
    num_sequences = 0.0
    for mask in masks:
        m = mask.to(torch.float64)
        num_tokens += float(m.sum())
        num_sequences += float((m.sum(dim=-1) > 0).sum())
    return GlobalDenominators(num_tokens, num_sequences, int(max_len))


def all_reduce_denominators(
    d: GlobalDenominators,
    group: dist.ProcessGroup | None = None,
    device: torch.device | str | None = None,
) -> GlobalDenominators:
    """Sum token/sequence counts over ``group`` (the DP group); L_max is a constant.

    ``device`` defaults to the current CUDA device for NCCL and CPU otherwise.
    Counts travel as float64 so they stay exact far beyond 2**24 tokens.
    """
    if device is None:
        nccl = dist.get_backend(group) == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if nccl else "cpu"
    counts = torch.tensor([d.num_tokens, d.num_sequences], dtype=torch.float64, device=device)
    dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=group)
    return GlobalDenominators(float(counts[0]), float(counts[1]), d.max_response_len)
