"""Rollout groups → rewards → advantages → a `TrainBatch` aligned to target positions."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..advantages import compute_advantages
from ..rollout.routes import routes_batch
from ..tasks import LoadedTask
from ..types import RolloutGroup, TrainBatch


@dataclass
class ScoredRollout:
    batch: TrainBatch
    rewards: torch.Tensor
    reward_parts: dict[str, torch.Tensor]
    response_lengths: torch.Tensor
    zero_variance_frac: float
    group_size: int


def score_groups(groups: Sequence[RolloutGroup], task: LoadedTask,
                 decode: Callable[[list[int]], str]) -> dict[str, float]:
    """Fill each group's rewards (weighted sum) and per-function parts; returns the task's batch
    metrics (format rate, accuracy)."""
    for g in groups:
        g.rewards, g.reward_parts = [], []
        for s in g.samples:
            text = decode(s.response_ids)
            s.text = text
            total, parts = task.reward(text, g.record)
            g.rewards.append(total)
            g.reward_parts.append(parts)
    return task.batch_metrics([s.text for g in groups for s in g.samples],
                              [g.record for g in groups for _ in g.samples])


def build_batch(groups: Sequence[RolloutGroup], seq_len: int, pad_id: int) -> ScoredRollout:
    """Pad every prompt+response to `seq_len`; masks cover the response tokens' target positions.

    The rows stay `seq_len` wide on the host: the width is the constant of the
    `seq-mean-token-sum-norm` denominator, so it must not follow the batch's longest row. The
    trainer computes only what the masks need (`trainer.max_tokens_per_microbatch`).

    Advantages are filled in by `set_advantages` once the rewards are final (a KL-in-reward
    penalty needs the reference log-probs of this very batch first)."""
    samples = [s for g in groups for s in g.samples]
    n = len(samples)
    tokens = torch.full((n, seq_len), pad_id, dtype=torch.long)
    mask = torch.zeros(n, seq_len - 1)
    rollout_lp = torch.zeros(n, seq_len - 1)
    for i, s in enumerate(samples):
        seq = (s.prompt_ids + s.response_ids)[:seq_len]
        tokens[i, :len(seq)] = torch.tensor(seq)
        start, stop = len(s.prompt_ids) - 1, len(seq) - 1
        mask[i, start:stop] = 1.0
        rollout_lp[i, start:stop] = torch.tensor(s.response_logprobs[:stop - start])
    rewards = torch.tensor([r for g in groups for r in g.rewards], dtype=torch.float64)
    names = sorted(groups[0].reward_parts[0]) if groups and groups[0].reward_parts else []
    parts = {k: torch.tensor([p[k] for g in groups for p in g.reward_parts]) for k in names}
    lengths = torch.tensor([len(s.response_ids) for s in samples], dtype=torch.float64)
    batch = TrainBatch(tokens=tokens, mask=mask, advantages=torch.zeros(n), rollout_logprobs=rollout_lp)
    packed = routes_batch([s.routed_experts for s in samples], seq_len)
    if packed is not None:
        batch.routes, batch.routes_valid = packed
    return ScoredRollout(batch, rewards, parts, lengths, 0.0, len(groups[0].samples))


def kl_penalty(batch: TrainBatch, beta: float, estimator: str, clamp: float) -> torch.Tensor:
    """β · Σ_t KL_t(π_old ‖ π_ref) per sample, for KL applied to the reward instead of the loss."""
    from ..objectives import kl_estimate

    assert batch.old_logprobs is not None and batch.ref_logprobs is not None, \
        "KL in the reward needs the old and the reference log-probs"
    kl = kl_estimate(batch.old_logprobs.double(), batch.ref_logprobs.double(), estimator, clamp, 20.0)
    return beta * (kl * batch.mask).sum(dim=1)


def set_advantages(scored: ScoredRollout, estimator: str, mask_zero_variance: bool,
                   penalty: torch.Tensor | None = None) -> None:
    """Group-relative advantages from the (penalised) rewards; optionally drop flat groups."""
    rewards = scored.rewards if penalty is None else scored.rewards - penalty
    adv = compute_advantages(rewards, group_size=scored.group_size, estimator=estimator,
                             drop_zero_variance=mask_zero_variance)
    scored.batch.advantages = adv.advantages.float()
    if mask_zero_variance and adv.sample_mask is not None:
        scored.batch.mask = scored.batch.mask * adv.sample_mask.to(scored.batch.mask.dtype).unsqueeze(1)
    scored.zero_variance_frac = adv.frac_zero_variance
