"""π_old from the update's own forward (`train/policy.py::old_from_update`) on real megatron-core,
one rank on gloo: with one update per rollout the separate π_old forward is skipped, and the
update's loss, reduced gradients, objective metrics (TIS weights, KL, entropy) and the step's
metrics (`mismatch/abs_mean` reads π_old) equal the path with the extra forward.

Tolerances: the loss and the gradients do not read π_old at all on this path (the actor's ratio
is 1 by construction), so they must agree to the last bit of fp32 reduction order (rel 1e-6);
π_old's log-probs themselves come from the training forward instead of an eval-mode forward of
the same micro-batches, fp32 noise only (2e-6 absolute, as across micro-batch layouts in
tests/integration/test_megatron_parallel.py); a wrong row order or a shifted column moves them by O(1).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
import torch
import torch.distributed as dist

from megatron_rl.megatron import cpu_compat

cpu_compat.apply()

from megatron_rl.config.loader import load_recipe  # noqa: E402
from megatron_rl.megatron.devices import init_distributed  # noqa: E402
from megatron_rl.train import policy as policy_module  # noqa: E402
from megatron_rl.train.batch import ScoredRollout  # noqa: E402
from megatron_rl.train.metrics import step_metrics  # noqa: E402
from megatron_rl.train.policy import Policy, old_from_update, starting_checkpoint  # noqa: E402
from megatron_rl.types import TrainBatch  # noqa: E402
from tests.helpers.rollout import REPO, unit_paths  # noqa: E402

RECIPE = REPO / "recipes" / "tiny" / "grpo.yaml"
REL = 1e-6
LOGPROB_ATOL = 2e-6
ROWS, SEQ = 24, 80            # the tiny recipe's 64 prompt + 16 response tokens


@pytest.fixture(scope="module", autouse=True)
def one_rank() -> Iterator[None]:
    torch.set_num_threads(1)
    init_distributed(store=dist.HashStore())
    yield
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    dist.destroy_process_group()


def recipe(*overrides: str) -> Any:
    return load_recipe(RECIPE, [*unit_paths(RECIPE), *overrides])


def test_only_a_single_update_without_reward_kl_or_lora_dropout_reuses_the_forward() -> None:
    assert old_from_update(recipe())
    assert not old_from_update(recipe("algorithm.steps_per_generation=2", "trainer.global_batch_size=256"))
    assert not old_from_update(recipe("algorithm.kl_beta=0.05", "algorithm.kl_in_reward=true"))
    assert not old_from_update(recipe("lora.rank=4", "lora.dropout=0.1"))


def rollout_batch(vocab: int) -> ScoredRollout:
    """Rows of different prompt and response lengths (the budget path cuts them), engine
    log-probs near the policy's, and rewards with a flat group (masked by the advantages)."""
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, vocab, (ROWS, SEQ), generator=g)
    mask = torch.zeros(ROWS, SEQ - 1)
    lengths = torch.zeros(ROWS, dtype=torch.float64)
    for r in range(ROWS):
        prompt, response = 8 + (r * 7) % 56, 1 + (r * 5) % 16
        mask[r, prompt - 1:prompt - 1 + response] = 1.0
        lengths[r] = response
    rollout = (-6.0 + 0.3 * torch.randn(ROWS, SEQ - 1, generator=g)) * mask
    rewards = torch.rand(ROWS, generator=g, dtype=torch.float64)
    rewards[:8] = 1.0
    batch = TrainBatch(tokens=tokens, mask=mask, advantages=torch.zeros(ROWS), rollout_logprobs=rollout)
    return ScoredRollout(batch, rewards, {}, lengths, group_size=8)


def one_step(overrides: tuple[str, ...], scored: ScoredRollout) -> dict[str, Any]:
    """`train/loop.py::learn`'s policy half: π_old/π_ref → advantages → one update → π_old filled."""
    from megatron_rl.train.batch import with_advantages

    cfg = recipe(*overrides)
    policy = Policy(cfg, starting_checkpoint(cfg), updates=10)
    forwards = []
    compute = policy.actor.compute_logprobs
    policy.actor.compute_logprobs = lambda *a, **k: forwards.append(1) or compute(*a, **k)   # type: ignore[method-assign]
    grads: list[torch.Tensor] = []
    prepare = policy.actor.optimizer.prepare_grads

    def recording_prepare() -> bool:      # the reduced gradient, before the guarded step clips it
        m = policy.actor.model
        grads.append(torch.cat([b.grad_data.detach().clone() for group in m.bucket_groups +
                                m.expert_parallel_bucket_groups for b in group.buckets]))
        return prepare()

    policy.actor.optimizer.prepare_grads = recording_prepare   # type: ignore[method-assign]
    batch, routing = policy.logprobs(scored.batch)
    batch, flat = with_advantages(scored, batch, "grpo", True)
    updates = policy.update(batch, 1, None)
    batch = policy.with_old_from_update(batch)
    metrics = step_metrics(scored, batch, flat, updates, {}, {}, 1)
    weights = torch.cat([p.detach().reshape(-1).clone() for p in policy.actor.model.parameters()])
    return {"forwards": len(forwards), "batch": batch, "routing": routing, "updates": updates, "metrics": metrics,
            "grads": grads, "weights": weights}


@pytest.mark.parametrize("layout", ["budget", "padded"])
def test_the_update_forward_as_pi_old_equals_the_extra_forward(layout: str,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    overrides = ("algorithm.kl_beta=0.05", "algorithm.entropy_coef=0.01", "algorithm.correction.mode=tis_token",
                 "algorithm.correction.cap=1.5")
    if layout == "padded":
        overrides += ("trainer.max_tokens_per_microbatch=null", "trainer.micro_batch_size=8")
    scored = rollout_batch(512)
    reused = one_step(overrides, scored)
    with monkeypatch.context() as m:
        m.setattr(policy_module, "old_from_update", lambda cfg: False)
        extra = one_step(overrides, scored)
    # The reference forward stays; the actor's own π_old forward is gone.
    assert (reused["forwards"], extra["forwards"]) == (0, 1)
    assert reused["routing"] == extra["routing"] == {}
    old, want = reused["batch"].old_logprobs, extra["batch"].old_logprobs
    mask = reused["batch"].mask
    assert old.shape == want.shape == (ROWS, SEQ - 1)
    assert float(((old - want).abs() * mask).max()) <= LOGPROB_ATOL
    assert bool(((want < 0) | (mask == 0)).all())                       # real log-probs where masked
    assert torch.equal(reused["batch"].advantages, extra["batch"].advantages)
    assert mask.sum() < scored.batch.mask.sum()                          # the flat group was masked
    got_u, want_u = reused["updates"][0], extra["updates"][0]
    assert sorted(got_u) == sorted(want_u)
    for key in want_u:
        assert got_u[key] == pytest.approx(want_u[key], rel=REL, abs=1e-12, nan_ok=True), key
    assert want_u["token/is_weight_mean"] != 1.0 and "token/kl_mean" in want_u     # TIS and KL were live
    got_m, want_m = reused["metrics"], extra["metrics"]
    assert sorted(got_m) == sorted(want_m)
    for key in want_m:
        assert got_m[key] == pytest.approx(want_m[key], rel=REL, abs=1e-12, nan_ok=True), key
    assert want_m["mismatch/abs_mean"] > 0.1                             # π_old really read
    (g_got,), (g_want,) = reused["grads"], extra["grads"]
    scale = float(g_want.abs().max())
    assert scale > 1e-4 and float((g_got - g_want).abs().max()) <= REL * scale
    assert float((reused["weights"] - extra["weights"]).abs().max()) <= 1e-6


def test_a_stale_pi_old_is_refused_without_old_logprobs() -> None:
    cfg = recipe()
    policy = Policy(cfg, starting_checkpoint(cfg), updates=2)
    batch = replace(rollout_batch(512).batch, advantages=torch.ones(ROWS))
    with pytest.raises(ValueError, match="steps_per_generation is 1"):
        policy.actor.train_step(batch, replace(cfg.algorithm, steps_per_generation=2), temperature=1.0, rl_step=0)
