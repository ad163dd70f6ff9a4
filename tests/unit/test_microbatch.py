"""Token-budget micro-batch planning (pure logic; the model-level equality is in
tests/integration/test_megatron_parallel.py::test_budget_microbatches_equal_the_padded_path)."""

from __future__ import annotations

import random

import pytest
import torch

from megatron_rl.megatron.microbatch import needed_lengths, plan_microbatches, take
from megatron_rl.types import TrainBatch


def test_needed_lengths_follow_the_last_masked_target() -> None:
    mask = torch.zeros(4, 9)
    mask[0, 2:5] = 1          # last target 4 predicts token 5 -> tokens [0, 6)
    mask[1, 8] = 1            # the very last target -> the full 10 tokens
    mask[3, 0] = 1            # target 0 predicts token 1 -> 2 tokens
    assert needed_lengths(mask) == [6, 10, 2, 2]      # row 2: empty mask, still one target


def _check(plans: list, lengths: list[int], sft: list[int], dp: int, budget: int, multiple: int) -> None:
    assert len(plans) == dp and len({len(p) for p in plans}) == 1          # same count on every rank
    rows = sorted(i for rank in plans for mb in rank for i in mb.rows)
    sft_rows = sorted(i for rank in plans for mb in rank for i in mb.sft_rows)
    assert rows == list(range(len(lengths))) and sft_rows == list(range(len(sft)))   # each row once
    for rank in plans:
        for mb in rank:
            assert mb.rows, "every micro-batch carries RL rows"
            assert mb.length % multiple == 0
            assert mb.length >= max([lengths[i] for i in mb.rows] + [sft[i] for i in mb.sft_rows])
            assert mb.length < max([lengths[i] for i in mb.rows] + [sft[i] for i in mb.sft_rows]) + multiple
            if len(mb.rows) + len(mb.sft_rows) > 1:
                assert mb.padded_tokens <= budget, (mb, budget)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(("dp", "multiple", "with_sft"), [(1, 1, False), (2, 2, False), (4, 1, True), (2, 2, True)])
def test_plans_cover_every_row_once_within_budget_and_balanced(seed: int, dp: int, multiple: int,
                                                               with_sft: bool) -> None:
    rng = random.Random(seed)
    max_len, budget = 512, 1024
    # 80 % short answers (< 10 % of the budget), 20 % long ones up to the full length.
    lengths = [rng.randint(2, 100) if rng.random() < 0.8 else rng.randint(100, max_len) for _ in range(8 * dp)]
    sft = [rng.randint(2, 300) for _ in range(3 * dp)] if with_sft else []
    plans = plan_microbatches(lengths, dp, budget, multiple, sft)
    _check(plans, lengths, sft, dp, budget, multiple)
    loads = [sum(mb.padded_tokens for mb in rank) for rank in plans]
    biggest = max(mb.padded_tokens for rank in plans for mb in rank)
    assert max(loads) - min(loads) <= biggest                       # LPT bound on the imbalance
    padded = sum(loads)
    assert padded < 0.5 * (len(lengths) + len(sft)) * max_len       # far below padding every row to max


def test_a_row_longer_than_the_budget_gets_a_micro_batch_of_its_own() -> None:
    plans = plan_microbatches([900, 10, 12, 700], dp=1, budget=500)
    assert [(mb.rows, mb.length) for mb in plans[0]] == [((0,), 900), ((3,), 700), ((2, 1), 12)]


def test_rows_are_split_so_every_rank_gets_the_same_count() -> None:
    # All four fit in one micro-batch, but two DP ranks need one each: the group is halved.
    plans = plan_microbatches([5, 6, 7, 8], dp=2, budget=1000)
    assert [[mb.rows for mb in rank] for rank in plans] == [[(3, 2)], [(1, 0)]]


def test_bad_row_counts_are_refused() -> None:
    with pytest.raises(ValueError, match="do not split over DP 2"):
        plan_microbatches([5, 6, 7], dp=2, budget=100)
    with pytest.raises(ValueError, match="must be >= 1"):
        plan_microbatches([5, 6], dp=1, budget=0)


def test_take_cuts_rows_and_pads_only_past_the_batch_width() -> None:
    g = torch.Generator().manual_seed(0)
    n, length = 5, 10
    batch = TrainBatch(tokens=torch.randint(1, 50, (n, length), generator=g),
                       mask=torch.rand(n, length - 1, generator=g),
                       advantages=torch.randn(n, generator=g), old_logprobs=torch.randn(n, length - 1, generator=g),
                       sft_tokens=torch.randint(1, 50, (3, 7), generator=g), sft_mask=torch.rand(3, 6, generator=g))
    [[mb]] = plan_microbatches([4, 6], dp=1, budget=100, sft_lengths=[3])
    got = take(batch, type(mb)(rows=(3, 1), sft_rows=(2,), length=6))
    assert torch.equal(got.tokens, batch.tokens[[3, 1], :6]) and torch.equal(got.mask, batch.mask[[3, 1], :5])
    assert torch.equal(got.advantages, batch.advantages[[3, 1]])
    assert torch.equal(got.old_logprobs, batch.old_logprobs[[3, 1], :5]) and got.ref_logprobs is None
    assert torch.equal(got.sft_tokens, batch.sft_tokens[[2], :6]) and torch.equal(got.sft_mask, batch.sft_mask[[2], :5])
    wide = take(batch, type(mb)(rows=(0,), sft_rows=(), length=9))    # SFT rows are only 7 wide
    assert wide.sft_tokens.shape == (0, 9)
    longer = take(batch, type(mb)(rows=(0,), sft_rows=(0,), length=9))
    assert torch.equal(longer.sft_tokens[0, :7], batch.sft_tokens[0]) and longer.sft_tokens[0, 7:].eq(0).all()
