"""Rollout groups → rewards → advantages → a `TrainBatch` aligned to target positions; and the
padding every trained row goes through (`pack`), also for CHORD's expert rows and the fixed probe
batch of sync verification."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..advantages import compute_advantages
from ..route_rows import RouteRows
from ..tasks import LoadedTask
from ..types import RolloutGroup, TrainBatch


@dataclass(frozen=True)
class Scores:
    """What the task's reward functions made of one step's samples, in sample order."""

    texts: list[str]
    """Each response decoded without special tokens (what the reward functions read)."""
    rewards: list[float]
    """The weighted sum per sample."""
    parts: list[dict[str, float]]
    """Each reward function's own value per sample, by name."""
    task_metrics: dict[str, float]
    """The task's batch metrics (format rate, accuracy)."""


@dataclass(frozen=True)
class ScoredRollout:
    batch: TrainBatch
    """Tokens, response masks and rollout log-probs; no advantages or policy log-probs yet."""
    rewards: torch.Tensor
    reward_parts: dict[str, torch.Tensor]
    response_lengths: torch.Tensor
    group_size: int


def score_groups(groups: Sequence[RolloutGroup], task: LoadedTask,
                 decode: Callable[[list[int]], str]) -> Scores:
    """Every sample's rewards (weighted sum and per function) and the task's batch metrics."""
    texts, totals, parts = [], [], []
    for g in groups:
        for s in g.samples:
            text = decode(s.response_ids)
            total, by_name = task.reward(text, g.record)
            texts.append(text)
            totals.append(total)
            parts.append(by_name)
    records = [g.record for g in groups for _ in g.samples]
    return Scores(texts, totals, parts, task.batch_metrics(texts, records))


def build_batch(groups: Sequence[RolloutGroup], scores: Scores, seq_len: int, pad_id: int) -> ScoredRollout:
    """Pad every prompt+response to `seq_len`; masks cover the response tokens' target positions.

    The rows stay `seq_len` wide on the host: the width is the constant of the
    `seq-mean-token-sum-norm` denominator, so it must not follow the batch's longest row. The
    trainer computes only what the masks need (`trainer.max_tokens_per_microbatch`).

    Advantages come from `with_advantages` once the rewards are final (a KL-in-reward penalty
    needs the reference log-probs of this very batch first)."""
    samples = [s for g in groups for s in g.samples]
    n = len(samples)
    tokens, mask = pack([s.prompt_ids + s.response_ids for s in samples], [len(s.prompt_ids) for s in samples],
                        seq_len, pad_id)
    rollout_lp = torch.zeros(n, seq_len - 1)
    for i, s in enumerate(samples):
        start, stop = len(s.prompt_ids) - 1, min(len(s.prompt_ids) + len(s.response_ids), seq_len) - 1
        rollout_lp[i, start:stop] = torch.tensor(s.response_logprobs[:stop - start])
    rewards = torch.tensor(scores.rewards, dtype=torch.float64)
    names = sorted(scores.parts[0]) if scores.parts else []
    parts = {k: torch.tensor([p[k] for p in scores.parts]) for k in names}
    lengths = torch.tensor([len(s.response_ids) for s in samples], dtype=torch.float64)
    # Per sample, compact: the dense [N, seq_len, layers, topk] exists one micro-batch at a time.
    routes = RouteRows.of_samples([s.routed_experts for s in samples], seq_len)
    batch = TrainBatch(tokens=tokens, mask=mask, advantages=torch.zeros(n), rollout_logprobs=rollout_lp,
                       routes=routes)
    return ScoredRollout(batch, rewards, parts, lengths, len(groups[0].samples))


def pack(sequences: Sequence[list[int]], prompt_lengths: Sequence[int], seq_len: int,
         pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows padded (or cut) to `seq_len`, and a mask over the target positions of each row's tokens
    after its prompt."""
    tokens = torch.full((len(sequences), seq_len), pad, dtype=torch.long)
    mask = torch.zeros(len(sequences), seq_len - 1)
    for i, (seq, plen) in enumerate(zip(sequences, prompt_lengths)):
        seq = seq[:seq_len]
        tokens[i, :len(seq)] = torch.tensor(seq)
        mask[i, plen - 1:len(seq) - 1] = 1.0
    return tokens, mask


def probe(tokenizer: Any, prompts: Sequence[list[int]], seq_len: int, pad: int, response: str,
          count: int = 4) -> TrainBatch:
    """A fixed batch for sync verification: the first prompts, each followed by `response`."""
    answer = tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    first = list(prompts[:count])
    tokens, mask = pack([p + answer for p in first], [len(p) for p in first], seq_len, pad)
    return TrainBatch(tokens=tokens, mask=mask, advantages=torch.zeros(len(first)))


def kl_penalty(batch: TrainBatch, beta: float, estimator: str, clamp: float | None) -> torch.Tensor:
    """β · Σ_t KL_t(π_old ‖ π_ref) per sample, for KL applied to the reward instead of the loss."""
    from ..objectives import kl_estimate

    assert batch.old_logprobs is not None and batch.ref_logprobs is not None, \
        "KL in the reward needs the old and the reference log-probs"
    kl = kl_estimate(batch.old_logprobs.double(), batch.ref_logprobs.double(), estimator, clamp, 20.0)
    return beta * (kl * batch.mask).sum(dim=1)


def with_advantages(scored: ScoredRollout, batch: TrainBatch, estimator: str, mask_zero_variance: bool,
                    penalty: torch.Tensor | None = None, *, unbiased_std: bool = False,
                    eps: float = 1e-6) -> tuple[TrainBatch, float]:
    """`batch` with group-relative advantages from the (penalised) rewards and, when
    `mask_zero_variance`, flat groups masked out; and the fraction of flat groups."""
    rewards = scored.rewards if penalty is None else scored.rewards - penalty
    adv = compute_advantages(rewards, group_size=scored.group_size, estimator=estimator, eps=eps,
                             drop_zero_variance=mask_zero_variance, unbiased=unbiased_std)
    mask = batch.mask
    if mask_zero_variance and adv.sample_mask is not None:
        mask = mask * adv.sample_mask.to(mask.dtype).unsqueeze(1)
    return replace(batch, advantages=adv.advantages.float(), mask=mask), adv.frac_zero_variance
