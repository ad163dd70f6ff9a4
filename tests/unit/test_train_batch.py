"""Pure pieces of the training step: batch packing, KL-in-reward, data order (no servers)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from megatron_rl.tasks import resolve_task
from megatron_rl.train.batch import Scores, build_batch, kl_penalty, score_groups, with_advantages
from megatron_rl.train.data import DataOrder
from megatron_rl.types import RolloutGroup, Sample


def groups() -> list[RolloutGroup]:
    out = []
    for p, answers in enumerate((["a", "b"], ["c", "c"])):
        samples = [Sample(prompt_ids=[5, 6, 7][: 2 + p], response_ids=[10 + i + 50 * p, 11, 12][: 2 + i],
                          response_logprobs=[-0.5 - i, -0.25, -0.125][: 2 + i]) for i in range(2)]
        for s, letter in zip(samples, answers):
            s.text = f"[ans]{letter}[/ans]"
        out.append(RolloutGroup(prompt_index=p, record={"answer": ["a"] if p == 0 else ["c"]}, samples=samples))
    return out


def test_batch_aligns_masks_and_rollout_logprobs_to_target_positions() -> None:
    gs = groups()
    texts = {tuple(x.response_ids): x.text for g in gs for x in g.samples}
    # Prompt 0 answers "a" (right) then "b"; prompt 1 answers "c" twice (right): rewards 1, 0, 1, 1.
    gs[1].samples[1].response_ids = [99, 11]
    texts[(99, 11)] = "[ans]c[/ans]"
    scores = score_groups(gs, resolve_task("mcq", {"mcq_answer": 1.0}), decode=lambda ids: texts[tuple(ids)])
    scored = build_batch(gs, scores, seq_len=8, pad_id=0)
    assert scored.rewards.tolist() == [1.0, 0.0, 1.0, 1.0]
    assert scored.reward_parts["mcq_answer"].tolist() == [1.0, 0.0, 1.0, 1.0]
    assert scores.task_metrics == {"format_rate": 1.0, "accuracy": 0.75}
    assert scores.texts == ["[ans]a[/ans]", "[ans]b[/ans]", "[ans]c[/ans]", "[ans]c[/ans]"]
    b = scored.batch
    s = gs[0].samples[1]                           # prompt [5, 6], response [11, 11, 12]
    assert b.tokens[1].tolist() == [5, 6, 11, 11, 12, 0, 0, 0]
    # Position t predicts token t+1: the response tokens sit at targets 1..3.
    assert b.mask[1].tolist() == [0, 1, 1, 1, 0, 0, 0]
    assert b.rollout_logprobs[1, 1:4].tolist() == s.response_logprobs


def test_kl_in_reward_penalises_before_the_group_normalisation() -> None:
    gs = groups()
    scores = Scores(["", "", "", ""], [1.0] * 4, [{"x": 1.0}] * 4, {})
    scored = build_batch(gs, scores, seq_len=8, pad_id=0)
    b = replace(scored.batch, old_logprobs=torch.full_like(scored.batch.mask, -1.0),
                ref_logprobs=torch.full_like(scored.batch.mask, -1.5))
    penalty = kl_penalty(b, beta=0.1, estimator="k3", clamp=10.0)
    delta = -0.5                                   # log π_ref − log π
    k3 = math.exp(delta) - delta - 1
    expected = [0.1 * k3 * float(m.sum()) for m in b.mask]
    assert penalty.tolist() == pytest.approx(expected, rel=1e-12)
    penalised, _ = with_advantages(scored, b, "grpo", mask_zero_variance=False, penalty=penalty)
    # Equal rewards, but the longer response paid more KL: it gets the negative advantage.
    assert penalised.advantages[0] > 0 > penalised.advantages[1]
    masked, zero_variance_frac = with_advantages(scored, b, "grpo", mask_zero_variance=True)
    assert zero_variance_frac == 1.0 and float(masked.mask.sum()) == 0.0
    # A phase returns a new batch: its input is left as it was.
    assert float(b.mask.sum()) > 0 and float(b.advantages.abs().sum()) == 0.0


def test_data_order_is_seeded_and_resumable() -> None:
    a = DataOrder(size=10, seed=3)
    first = a.next_indices(7) + a.next_indices(7)          # crosses into epoch 1
    assert sorted(first[:10]) == list(range(10)) and a.epoch == 1 and a.position == 4
    b = DataOrder(size=10, seed=3)
    b.next_indices(7)
    state = b.state()
    c = DataOrder(size=10, seed=3)
    c.load(state)
    assert c.next_indices(7) == first[7:]
    assert DataOrder(size=10, seed=4).next_indices(10) != first[:10]
