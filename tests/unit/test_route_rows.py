"""R3 routes kept per sample and expanded one micro-batch at a time (`route_rows.py`, audit-2 #15):
the expansion is bit-identical to the dense batch the trainer built before (`routes_batch`, then
the micro-batch's rows, cut to its width and grown to its token shape), through the real batch
code (`build_batch`, `TrainBatch.rows`, `microbatch.take`); and the groups every rank receives
carry the routes' shapes only."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from megatron_rl.megatron.microbatch import needed_lengths, plan_microbatches, take
from megatron_rl.rollout.routes import routes_batch
from megatron_rl.route_rows import HeldRoutes, RouteRows, hold_on_rank0
from megatron_rl.train.batch import Scores, build_batch
from megatron_rl.types import RolloutGroup, Sample

SEQ_LEN = 24
LAYERS, TOPK = 3, 4


def dense_slice(routes: torch.Tensor, valid: torch.Tensor, rows: list[int], total: int,
                width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Today's path, verbatim: `take`'s index_select and cut, then the actor's `fit_routes`."""
    idx = torch.tensor(rows, dtype=torch.long)
    r, v = routes.index_select(0, idx)[:, :width], valid.index_select(0, idx)[:, :width]
    if r.shape[0] == total and r.shape[1] == width:
        return r, v
    n, w = min(total, r.shape[0]), min(width, r.shape[1])
    out, flags = r.new_zeros(total, width, *r.shape[2:]), v.new_zeros(total, width)
    out[:n, :w], flags[:n, :w] = r[:n, :w], v[:n, :w]
    return out, flags


def sample_routes(rng: np.random.Generator, experts: int) -> list[np.ndarray | None]:
    """Lengths around the width (cut ones, short ones, an empty one), one sample without routes."""
    dtype = np.uint8 if experts <= 256 else np.uint16
    lengths = [SEQ_LEN - 1, SEQ_LEN + 7, 5, 0, 1, SEQ_LEN, 13, SEQ_LEN - 1, 17]
    out: list[np.ndarray | None] = [rng.integers(0, experts, (n, LAYERS, TOPK)).astype(dtype) for n in lengths]
    out.insert(3, None)
    return out


def groups_of(routes: list[np.ndarray | None], rng: np.random.Generator) -> list[RolloutGroup]:
    samples = []
    for r in routes:
        n = SEQ_LEN + 1 if r is None else r.shape[0] + 1
        plen = int(rng.integers(1, max(2, min(n, SEQ_LEN) - 1)))
        ids = [int(x) for x in rng.integers(3, 50, n)]
        samples.append(Sample(ids[:plen], ids[plen:], [-0.5] * (n - plen), routed_experts=r))
    return [RolloutGroup(i, {}, samples[2 * i:2 * i + 2]) for i in range(len(samples) // 2)]


@pytest.mark.parametrize("experts", [64, 512, 32768], ids=["uint8", "uint16", "uint16-max"])
def test_expansion_equals_the_dense_batch_slice(experts: int) -> None:
    rng = np.random.default_rng(experts)
    arrays = sample_routes(rng, experts)
    if experts == 32768:
        arrays[0][0, 0, 0] = 32767                 # the largest id int16 holds
    want = routes_batch(arrays, SEQ_LEN)
    got = RouteRows.of_samples(arrays, SEQ_LEN)
    assert want is not None and got is not None
    routes, valid = want
    n = len(arrays)
    # Whole batch, then 200 random micro-batches: any rows in any order, any width, filler rows.
    for rows, total, width in [(list(range(n)), n, SEQ_LEN)] + [
            (list(rng.permutation(n)[:int(rng.integers(1, n + 1))]), 0, int(rng.integers(1, SEQ_LEN + 6)))
            for _ in range(200)]:
        total = total or len(rows) + int(rng.integers(0, 3))
        r, v = got.select(rows).dense(total, width)
        want_r, want_v = dense_slice(routes, valid, rows, total, width)
        assert r.dtype == want_r.dtype and torch.equal(r, want_r) and torch.equal(v, want_v), (rows, total, width)


def test_the_batch_path_expands_what_the_dense_batch_held() -> None:
    """build_batch → minibatch rows → budget plans (`take`) or the padded split, as the actor runs
    them; each micro-batch's expansion equals the old batch's slice at the token shape fed."""
    rng = np.random.default_rng(7)
    arrays = sample_routes(rng, 512)
    groups = groups_of(arrays, rng)
    scores = Scores([""] * len(arrays), [0.0] * len(arrays), [{}] * len(arrays), {})
    batch = build_batch(groups, scores, SEQ_LEN, 0).batch
    routes, valid = routes_batch(arrays, SEQ_LEN) or (None, None)
    assert batch.routes is not None and routes is not None and valid is not None
    half = batch.num_rows // 2
    for start in (0, half):
        minibatch = batch.rows(start, start + half)
        assert minibatch.routes is not None and len(minibatch.routes) == half
        for dp in (1, 5):
            for plan in (p for rank in plan_microbatches(needed_lengths(minibatch.mask), dp, 30, 2) for p in rank):
                mb = take(minibatch, plan)
                assert mb.routes is not None
                extra = 1                         # e.g. a CHORD expert row riding along: no routes
                got = mb.routes.dense(len(plan.rows) + extra, plan.length)
                want = dense_slice(routes, valid, [start + i for i in plan.rows], len(plan.rows) + extra, plan.length)
                assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        padded = minibatch.rows(1, 3)              # the padded split: contiguous rows, full width
        assert padded.routes is not None
        got = padded.routes.dense(2, SEQ_LEN)
        want = dense_slice(routes, valid, [start + 1, start + 2], 2, SEQ_LEN)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    # The log-prob pass's filler rows have no route.
    grown = batch.routes.padded(batch.num_rows + 3)
    r, v = grown.dense(batch.num_rows + 3, SEQ_LEN)
    assert torch.equal(r[:batch.num_rows], routes) and not v[batch.num_rows:].any()


def test_groups_sent_to_the_other_ranks_carry_shapes_only() -> None:
    rng = np.random.default_rng(3)
    arrays = sample_routes(rng, 512)
    groups = groups_of(arrays, rng)
    before = len(pickle.dumps(groups))
    sent = hold_on_rank0(groups)
    route_bytes = sum(a.nbytes for a in arrays if a is not None)
    assert len(pickle.dumps(sent)) < before - route_bytes
    kept = [s.routed_experts for g in groups for s in g.samples]
    got = [s.routed_experts for g in sent for s in g.samples]
    for a, k, s in zip(arrays, kept, got):
        if a is None:
            assert k is None and s is None
            continue
        assert isinstance(k, HeldRoutes) and k.array is a and k.shape == a.shape and k.dtype == "uint16"
        assert isinstance(s, HeldRoutes) and s.array is None and s == k
    # Rank 0 holding the same groups again (a regenerated step) still sends no array.
    assert all(s.routed_experts.array is None for g in hold_on_rank0(groups) for s in g.samples
               if s.routed_experts is not None)
    # Rank 0's store has every array; another rank's none until delivered, and says so.
    mine, theirs = RouteRows.of_samples(kept, SEQ_LEN), RouteRows.of_samples(got, SEQ_LEN)
    assert mine is not None and theirs is not None
    assert not mine.store.everywhere and not theirs.store.everywhere
    assert theirs.store.lengths == mine.store.lengths and theirs.store.arrays == {}
    assert torch.equal(mine.dense(len(arrays), SEQ_LEN)[0], routes_batch(arrays, SEQ_LEN)[0])  # type: ignore[index]
    with pytest.raises(RuntimeError, match="not delivered"):
        theirs.dense(len(arrays), SEQ_LEN)
    # The byte count a receiver allocates from the shapes alone is what rank 0 holds.
    assert theirs.store.nbytes(theirs.samples()) == mine.store.held_bytes()


def test_bad_routes_fail_on_rank0_before_the_broadcast() -> None:
    rng = np.random.default_rng(4)
    arrays = sample_routes(rng, 64)
    arrays[2] = np.zeros((4, LAYERS + 1, TOPK), dtype=np.uint8)
    with pytest.raises(ValueError, match="expected"):
        hold_on_rank0(groups_of(arrays, rng))
    wide = [np.full((2, LAYERS, TOPK), 40000, dtype=np.uint16)]
    with pytest.raises(ValueError, match="does not fit"):
        hold_on_rank0(groups_of(wide + [None], rng))
    with pytest.raises(ValueError, match="does not fit"):
        RouteRows.of_samples(wide, SEQ_LEN)
    assert RouteRows.of_samples([None, None], SEQ_LEN) is None
