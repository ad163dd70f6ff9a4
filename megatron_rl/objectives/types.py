"""Plain records shared by every objective: inputs and output.

The objectives' hyper-parameters are the recipe's own `AlgorithmConfig` (config/schema.py): no
copy, so a recipe value and its default reach the loss unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor


@dataclass
class LossInputs:
    """Per-micro-batch tensors for one loss evaluation (shapes ``[B, T]`` unless noted).

    ``logprobs`` (and ``entropy`` / ``sft_logprobs``) carry the graph; the other
    tensors are treated as constants (they are detached inside the objectives).
    ``advantages`` is ``[B]`` (one value per sequence) or ``[B, T]`` (per token).
    ``old_logprobs`` are the trainer's log-probs of the behaviour policy,
    ``rollout_logprobs`` the inference engine's; their gap is what the mismatch
    correction acts on. With asynchronous rollout (``rollout.max_staleness`` k >= 1)
    π_old is the policy being updated — the trainer's log-probs at its current
    weights, before this step's updates — while the samples came from weights up to
    k versions older: ``rollout_logprobs`` are then the behaviour policy's own, and
    the correction weights π_old/π_rollout cover both the engine mismatch and the
    staleness (the decoupled objective of AReaL-style asynchronous PPO: the clip
    keeps the update near π_old, the correction reweights toward it).
    ``sft_logprobs``/``sft_mask`` (``[B', T']``) are the expert stream of CHORD:
    log-probs of the demonstration tokens under the current policy.
    """

    logprobs: Tensor
    old_logprobs: Tensor
    advantages: Tensor
    mask: Tensor
    ref_logprobs: Tensor | None = None
    rollout_logprobs: Tensor | None = None
    entropy: Tensor | None = None
    sft_logprobs: Tensor | None = None
    sft_mask: Tensor | None = None


@dataclass
class LossOutput:
    """A differentiable scalar loss plus additive metrics.

    ``loss`` is this micro-batch's SUM divided by the global denominators, so the
    losses of all micro-batches (and DP ranks) add up to the global loss. The
    metric naming convention that :func:`reduce_metrics` relies on is described in
    ``megatron_rl/objectives/metrics.py``.
    """

    loss: Tensor
    metrics: dict[str, Tensor] = field(default_factory=dict)

