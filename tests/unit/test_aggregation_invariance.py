"""One big batch == the sum of k micro-batches under global denominators.

For every objective × aggregation mode (with KL, entropy bonus, mismatch
correction, and CHORD's separate SFT stream) the micro-batch losses must add up
to the big-batch loss and produce the same gradient, for k = 1, 2, 3 uneven
splits. The reduced metrics must agree too. Also checks the denominator helpers,
including the DP all-reduce over two gloo processes.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor

from megatron_rl.config.schema import AlgorithmConfig, ChordConfig, CorrectionConfig
from megatron_rl.objectives import (
    GlobalDenominators,
    LossInputs,
    aggregate,
    all_reduce_denominators,
    all_reduce_metrics,
    combine_metrics,
    denominators_from_masks,
    finalize_metrics,
    get_objective,
    reduce_metrics,
)

TOL = 1e-10
MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
MAX_LEN = 12
# Row boundaries of the splits: 7 rollout rows, 5 expert rows.
SPLITS = {1: ([7], [5]), 2: ([2, 5], [4, 1]), 3: ([1, 4, 2], [2, 0, 3])}
CASES = [
    ("grpo", {"correction": "tis_token"}),
    ("gspo", {"correction": "mask_seq"}),
    ("gspo_token", {"correction": "tis_seq"}),
    ("chord", {"correction": "mask_token", "chord": {"rl_objective": "grpo", "phi": True}}),
    ("chord", {"chord": {"rl_objective": "gspo", "sft_loss_agg_mode": "seq-mean-token-sum"}}),
]


def make_batch(seed: int) -> dict[str, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    lengths = [8, 3, 0, 12, 5, 1, 7]
    b, t = len(lengths), MAX_LEN

    def rnd(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    mask = torch.tensor([[j < n for j in range(t)] for n in lengths])
    old = -torch.rand(b, t, generator=gen, dtype=torch.float64) * 3
    sft_mask = torch.tensor([[j < n for j in range(9)] for n in [9, 4, 6, 2, 5]])
    return {
        "logp": (old + 0.5 * rnd(b, t)).requires_grad_(), "old": old, "rollout": old + 0.3 * rnd(b, t),
        "ref": old + 0.2 * rnd(b, t), "entropy": rnd(b, t).abs().requires_grad_(), "adv": rnd(b),
        "mask": mask, "sft_logp": (-torch.rand(5, 9, generator=gen, dtype=torch.float64) * 2).requires_grad_(),
        "sft_mask": sft_mask,
    }


def slice_inputs(d: dict[str, Tensor], rows: slice, sft_rows: slice) -> LossInputs:
    return LossInputs(
        logprobs=d["logp"][rows], old_logprobs=d["old"][rows], advantages=d["adv"][rows],
        mask=d["mask"][rows], ref_logprobs=d["ref"][rows], rollout_logprobs=d["rollout"][rows],
        entropy=d["entropy"][rows], sft_logprobs=d["sft_logp"][sft_rows], sft_mask=d["sft_mask"][sft_rows],
    )


def boundaries(sizes: list[int]) -> list[slice]:
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [slice(s, s + n) for s, n in zip(starts, sizes)]


def run_split(name: str, cfg: AlgorithmConfig, d: dict[str, Tensor], k: int) -> tuple[Tensor, list[Tensor], dict]:
    sizes, sft_sizes = SPLITS[k]
    parts = list(zip(boundaries(sizes), boundaries(sft_sizes)))
    denoms = denominators_from_masks([d["mask"][r] for r, _ in parts], MAX_LEN)
    sft_denoms = denominators_from_masks([d["sft_mask"][s] for _, s in parts], MAX_LEN)
    outs = [get_objective(name)(slice_inputs(d, r, s), cfg, denoms, step=3, sft_denoms=sft_denoms) for r, s in parts]
    total = sum(o.loss for o in outs)
    leaves = [d["logp"], d["entropy"], d["sft_logp"]]
    g = torch.autograd.grad(total, leaves, allow_unused=True)
    return total.detach(), [torch.zeros_like(x) if gi is None else gi for x, gi in zip(leaves, g)], reduce_metrics(
        [o.metrics for o in outs]
    )


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("name", "extra"), CASES, ids=lambda x: str(x))
def test_micro_batch_sum_equals_big_batch(name: str, extra: dict, mode: str) -> None:
    cfg = AlgorithmConfig(
        clip_eps_low=0.2, clip_eps_high=0.3, dual_clip_c=2.5, kl_beta=0.05, kl_clamp=5.0, entropy_coef=0.02,
        loss_agg_mode=mode, correction=CorrectionConfig(mode=extra.get("correction", "none"), threshold=1.5),
        chord=ChordConfig(mu_warmup_steps=2, mu_decay_steps=5, **extra.get("chord", {})),
    )
    d = make_batch(seed=MODES.index(mode))
    big_loss, big_grads, big_stats = run_split(name, cfg, d, 1)
    assert any(float(g.abs().sum()) > 0 for g in big_grads)
    for k in (2, 3):
        loss, grads, stats = run_split(name, cfg, d, k)
        assert abs(float(loss) - float(big_loss)) <= TOL
        for a, b in zip(grads, big_grads):
            torch.testing.assert_close(a, b, atol=TOL, rtol=0)
        assert stats.keys() == big_stats.keys()
        for key, value in big_stats.items():
            assert stats[key] == pytest.approx(value, abs=1e-9, nan_ok=True), key


def test_aggregate_counts_match_direct_formulas() -> None:
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [9.0, 9.0, 9.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])
    d = denominators_from_masks([mask], max_len=5)
    assert d == GlobalDenominators(num_tokens=4.0, num_sequences=2.0, max_response_len=5)
    assert float(aggregate(values, mask, d, "token-mean")) == pytest.approx(10 / 4)
    assert float(aggregate(values, mask, d, "seq-mean-token-mean")) == pytest.approx((6 / 3 + 4 / 1) / 2)
    assert float(aggregate(values, mask, d, "seq-mean-token-sum")) == pytest.approx(10 / 2)
    assert float(aggregate(values, mask, d, "seq-mean-token-sum-norm")) == pytest.approx(10 / (2 * 5))
    empty = denominators_from_masks([mask[2:]], max_len=5)
    assert float(aggregate(values[2:], mask[2:], empty, "seq-mean-token-mean")) == 0.0


def _dist_worker(rank: int, world: int, init_file: str, results: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        mask = torch.ones(rank + 1, 4)
        mask[0, 3] = 0
        local = denominators_from_masks([mask], max_len=7)
        reduced = all_reduce_denominators(local)
        metrics = {
            "token/count": torch.tensor(float(rank + 1)), "token/ratio_sum": torch.tensor(2.0 * (rank + 1)),
            "token/ratio_min": torch.tensor(0.5 - rank), "token/ratio_max": torch.tensor(1.0 + rank),
            "loss/pg": torch.tensor(0.25), "const/mu": torch.tensor(0.4),
        }
        results[rank] = (reduced, finalize_metrics(all_reduce_metrics(combine_metrics([metrics]))))
    finally:
        dist.destroy_process_group()


def test_all_reduce_denominators_and_metrics_gloo() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        manager = mp.Manager()
        results = manager.dict()
        mp.spawn(_dist_worker, args=(2, os.path.join(tmp, "init"), results), nprocs=2, join=True)
        for rank in range(2):
            denoms, stats = results[rank]
            # rank 0: 1 row of 3 tokens; rank 1: 2 rows, 3 + 4 tokens.
            assert denoms == GlobalDenominators(num_tokens=10.0, num_sequences=3.0, max_response_len=7)
            assert stats["token/count"] == 3.0
            assert stats["token/ratio_mean"] == pytest.approx((2.0 + 4.0) / 3.0)
            assert stats["token/ratio_min"] == pytest.approx(-0.5)
            assert stats["token/ratio_max"] == pytest.approx(2.0)
            assert stats["loss/pg"] == pytest.approx(0.5)
            assert stats["const/mu"] == pytest.approx(0.4)
        manager.shutdown()
