"""Length-aware micro-batches under a token budget, balanced over data-parallel ranks.

The padded path gives every micro-batch `micro_batch_size` rows of the batch's full width
(`max_prompt_length + max_response_length`). Here each row is cut to the tokens it needs (through
the target of its last masked position), rows of similar length share a micro-batch, and a
micro-batch holds at most `budget` tokens *including its own padding* (rows × its longest row).

The loss contract makes this free of numerical side effects: every micro-batch's loss is a sum
divided by denominators of the whole step, computed before the split, and a causal model's
log-probs at a position do not depend on the pads after it. So regrouping changes only the
reduction order of the sums (float round-off), never the loss or the gradient.

Every DP rank gets the same number of micro-batches: expert-parallel all-to-alls and the
pipeline schedule run once per micro-batch on every rank, so counts must agree; the groups are
dealt out so that each rank's padded-token total is as even as the grouping allows.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import torch

from ..types import TrainBatch


@dataclass(frozen=True)
class MicroBatchPlan:
    """Rows of one micro-batch (indices into the step's batch) and the width they are cut to."""

    rows: tuple[int, ...]
    sft_rows: tuple[int, ...]
    length: int
    """Tokens per row (the longest row rounded up to `multiple`); log-probs have `length − 1`."""

    @property
    def padded_tokens(self) -> int:
        return (len(self.rows) + len(self.sft_rows)) * self.length


def needed_lengths(mask: torch.Tensor) -> list[int]:
    """Tokens each row needs: target position t predicts token t + 1, so a row whose last masked
    position is t needs tokens [0, t + 2). A row with an empty mask needs 2 (one target)."""
    width = mask.shape[1]
    positions = torch.arange(1, width + 1, dtype=torch.long)
    last = ((mask != 0).long() * positions).amax(dim=1) if width else torch.zeros(mask.shape[0], dtype=torch.long)
    return [max(2, int(t) + 1) for t in last]


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass
class _Group:
    rows: list[tuple[int, int]]          # (row index, needed length), longest first
    sft: list[tuple[int, int]]
    multiple: int

    @property
    def length(self) -> int:
        longest = max(n for _, n in self.rows + self.sft)
        return _round_up(longest, self.multiple)

    @property
    def cost(self) -> int:
        return (len(self.rows) + len(self.sft)) * self.length

    def cost_with(self, n: int) -> int:
        return (len(self.rows) + len(self.sft) + 1) * max(self.length, _round_up(n, self.multiple))


def _greedy(items: list[tuple[int, int]], budget: int, multiple: int) -> list[_Group]:
    """Longest first; a row joins the current group while the group's padded tokens fit."""
    groups: list[_Group] = []
    for item in items:
        if groups and groups[-1].cost_with(item[1]) <= budget:
            groups[-1].rows.append(item)
        else:
            groups.append(_Group([item], [], multiple))
    return groups


def _split_to(groups: list[_Group], count: int) -> list[_Group]:
    """Halve the costliest splittable group until there are `count` groups."""
    done = [g for g in groups if len(g.rows) == 1]
    heap = [(-g.cost, i, g) for i, g in enumerate(groups) if len(g.rows) > 1]
    heapq.heapify(heap)
    tie = len(groups)
    while len(done) + len(heap) < count:
        if not heap:
            raise ValueError(f"cannot form {count} micro-batches from {len(done)} rows")
        _, _, g = heapq.heappop(heap)
        half = len(g.rows) // 2
        for part in (_Group(g.rows[:half], [], g.multiple), _Group(g.rows[half:], [], g.multiple)):
            tie += 1
            if len(part.rows) > 1:
                heapq.heappush(heap, (-part.cost, tie, part))
            else:
                done.append(part)
    return done + [g for _, _, g in heap]


def _deal(groups: list[_Group], dp: int) -> list[list[_Group]]:
    """Costliest group first, to the least-loaded rank that still has room (equal counts)."""
    per_rank = len(groups) // dp
    ranks: list[list[_Group]] = [[] for _ in range(dp)]
    heap = [(0, r) for r in range(dp)]
    for g in sorted(groups, key=lambda x: -x.cost):
        load, r = heapq.heappop(heap)
        ranks[r].append(g)
        if len(ranks[r]) < per_rank:
            heapq.heappush(heap, (load + g.cost, r))
    return ranks


def _attach_sft(ranks: list[list[_Group]], sft: list[tuple[int, int]], budget: int) -> bool:
    """Each expert row (longest first) joins the micro-batch where it fits the budget on the
    least-loaded rank; if it fits nowhere, the one it enlarges least. True if all fitted."""
    loads = [sum(g.cost for g in gs) for gs in ranks]
    fitted = True
    for item in sft:
        def key(rg: tuple[int, _Group], length: int = item[1]) -> tuple[bool, int, int]:
            r, g = rg
            grown = g.cost_with(length)
            return grown > budget, (loads[r] + grown - g.cost) if grown <= budget else grown, grown - g.cost
        r, g = min(((r, g) for r, gs in enumerate(ranks) for g in gs), key=key)
        fitted &= g.cost_with(item[1]) <= budget or (not g.rows and not g.sft)
        loads[r] += g.cost_with(item[1]) - g.cost
        g.sft.append(item)
    return fitted


def plan_microbatches(lengths: list[int], dp: int, budget: int, multiple: int = 1,
                      sft_lengths: list[int] | None = None) -> list[list[MicroBatchPlan]]:
    """Per DP rank, its micro-batches (all ranks the same count).

    `lengths` and `sft_lengths` are the tokens each RL / expert row needs; `multiple` rounds every
    micro-batch's width (sequence parallelism needs a multiple of TP). A row longer than the
    budget gets a micro-batch of its own. Every micro-batch holds at least one RL row.
    """
    if budget < 1 or dp < 1 or multiple < 1:
        raise ValueError(f"budget {budget}, dp {dp} and multiple {multiple} must be >= 1")
    if not lengths or len(lengths) % dp:
        raise ValueError(f"{len(lengths)} rows do not split over DP {dp} (need a positive multiple)")
    order = sorted(enumerate(lengths), key=lambda x: (-x[1], x[0]))
    sft = sorted(enumerate(sft_lengths or []), key=lambda x: (-x[1], x[0]))
    groups = _greedy(order, budget, multiple)
    # Room for the expert rows too: enough micro-batches for all padded tokens, RL rows permitting;
    # one more per rank while an expert row fits nowhere.
    total = sum(min(g.cost, budget) for g in groups) + sum(_round_up(n, multiple) for _, n in sft)
    per_rank = min(max(math.ceil(len(groups) / dp), math.ceil(total / (dp * budget))), len(lengths) // dp)
    while True:
        ranks = _deal(_split_to(_greedy(order, budget, multiple), per_rank * dp), dp)
        if _attach_sft(ranks, sft, budget) or per_rank == len(lengths) // dp:
            break
        per_rank += 1
    return [[MicroBatchPlan(tuple(i for i, _ in g.rows), tuple(i for i, _ in g.sft), g.length)
             for g in sorted(gs, key=lambda x: -x.length)] for gs in ranks]


def _fit(t: torch.Tensor, width: int) -> torch.Tensor:
    """`t` cut (or zero-padded) to `width` columns."""
    if t.shape[1] >= width:
        return t[:, :width]
    return torch.nn.functional.pad(t, (0, width - t.shape[1]))


def take(batch: TrainBatch, plan: MicroBatchPlan) -> TrainBatch:
    """The micro-batch's rows of `batch`, cut to `plan.length` tokens (`length − 1` targets)."""
    idx = torch.tensor(plan.rows, dtype=torch.long)
    width = plan.length

    def rows(t: torch.Tensor, w: int) -> torch.Tensor:
        return _fit(t.index_select(0, idx), w)

    def cut(t: torch.Tensor | None, w: int) -> torch.Tensor | None:
        return None if t is None else rows(t, w)

    mb = TrainBatch(rows(batch.tokens, width), rows(batch.mask, width - 1), batch.advantages.index_select(0, idx),
                    cut(batch.old_logprobs, width - 1), cut(batch.ref_logprobs, width - 1),
                    cut(batch.rollout_logprobs, width - 1))
    if batch.routes is not None:           # compact; cut to `width` when expanded (`_feed_routes`)
        mb.routes = batch.routes.select(plan.rows)
    if batch.sft_tokens is not None:
        assert batch.sft_mask is not None, "expert rows come with their mask"
        sidx = torch.tensor(plan.sft_rows, dtype=torch.long)
        mb.sft_tokens = _fit(batch.sft_tokens.index_select(0, sidx), width)
        mb.sft_mask = _fit(batch.sft_mask.index_select(0, sidx), width - 1)
    return mb
