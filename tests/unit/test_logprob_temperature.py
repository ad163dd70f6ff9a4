"""The temperature of the run's log-probs (`rollout.logprobs_mode`, C22/C38 of audit 3): article
001's recipes use T = 1 as ms-swift 3.11's Megatron trainer did, article 000's QLoRA recipe keeps
logits ÷ T (the transformers trainer); `recipe show` prints which one; the recipe's temperature is
the one π_old, π_ref and the training step (π_θ, and CHORD's SFT NLL and φ, computed from the same
log-prob pass, `megatron/actor.py:train_step`) are computed at. Also the KL clamp 001 does not have."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from megatron_rl.cli import main
from megatron_rl.config import load_recipe
from megatron_rl.config.schema import AlgorithmConfig
from megatron_rl.megatron import cpu_compat
from megatron_rl.objectives.common import LOG_RATIO_CLAMP, kl_estimate
from megatron_rl.types import TrainBatch

cpu_compat.apply()   # as `megatron-rl train` does: the policy module imports the actor
from megatron_rl.train.policy import Policy  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
ARTICLE_001 = [REPO / "recipes" / model / f"{method}.yaml" for model in ("qwen3_next_80b_a3b", "qwen3_235b_a22b")
               for method in ("grpo", "gspo", "chord")]
QLORA = REPO / "recipes/qwen3_235b_a22b/gspo_qlora.yaml"


@pytest.mark.parametrize("recipe", ARTICLE_001, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_article_001_recipes_use_ms_swift_3_11_s_raw_logits(recipe: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = load_recipe(recipe)
    assert (cfg.rollout.logprobs_mode, cfg.rollout.temperature, cfg.rollout.logprobs_temperature) == ("raw", 0.9, 1.0)
    assert cfg.algorithm.kl_clamp is None                   # ms-swift clamps no per-token KL
    assert main(["recipe", "show", str(recipe), "--no-check-paths"]) == 0
    out = capsys.readouterr().out
    assert ("# log-probs of π_θ, π_old, π_ref and CHORD's SFT terms: T = 1 (rollout.logprobs_mode raw: raw logits, "
            "as ms-swift 3.11's Megatron trainer; sampling at T = 0.9)\n") in out
    assert "  logprobs_mode: raw\n" in out and "  kl_clamp: null\n" in out


def test_the_qlora_recipe_keeps_article_000_s_tempered_log_probs(capsys: pytest.CaptureFixture[str]) -> None:
    cfg = load_recipe(QLORA)
    assert (cfg.rollout.logprobs_mode, cfg.rollout.logprobs_temperature) == ("processed", 0.7)
    assert main(["recipe", "show", str(QLORA), "--no-check-paths"]) == 0
    assert "T = 0.7 (rollout.logprobs_mode processed: logits ÷ the sampling temperature" in capsys.readouterr().out


class Recording:
    """An actor / reference that records the temperature of every log-prob call."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, float, bool]] = []

    def compute_logprobs(self, batch: TrainBatch, temperature: float, replay: bool | None = None) -> torch.Tensor:
        self.calls.append(("logprobs", temperature, False))
        return torch.zeros(batch.mask.shape)

    def train_step(self, batch: TrainBatch, algorithm: AlgorithmConfig, *, temperature: float,
                   rl_step: int) -> dict[str, float]:
        self.calls.append(("train_step", temperature, batch.sft_tokens is not None))
        return {}


class Rows:
    pad_id = 0

    def next(self, count: int) -> list[list[int]]:
        return [[2, 5, 6, 7, 8]] * count          # prompt length 2, then the tokens


@pytest.mark.parametrize("mode, expected", [("raw", 1.0), ("processed", 0.9)])
def test_the_recipe_s_temperature_reaches_pi_old_pi_ref_and_the_update(mode: str, expected: float) -> None:
    cfg = load_recipe(REPO / "recipes/qwen3_next_80b_a3b/chord.yaml", [f"rollout.logprobs_mode={mode}"])
    policy = object.__new__(Policy)                 # the step logic only: no model is built
    actor, reference = Recording(), Recording()
    policy.cfg, policy.actor, policy.reference = cfg, actor, reference  # type: ignore[assignment]
    batch = TrainBatch(torch.ones(10, 6, dtype=torch.long), torch.ones(10, 5), torch.zeros(10))
    batch, _ = policy.logprobs(batch)
    policy.update(batch, 0, Rows())                 # type: ignore[arg-type]
    assert actor.calls == [("logprobs", expected, False)] + [("train_step", expected, True)] * 5
    assert reference.calls == [("logprobs", expected, False)]


def test_kl_clamp_null_leaves_the_k3_estimate_as_it_is() -> None:
    """k3 of δ = −6 is e^6 − 7 ≈ 396: kept whole without a clamp (ms-swift), cut to 10 by the default."""
    logp = torch.tensor([-6.1, -0.1, -1.0], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([-0.1, -6.1, -1.2], dtype=torch.float64)
    exact = [math.exp(r - lp) - (r - lp) - 1 for lp, r in zip(logp.tolist(), ref.tolist(), strict=True)]
    unclamped = kl_estimate(logp, ref, "k3", AlgorithmConfig(kl_clamp=None).kl_clamp, LOG_RATIO_CLAMP)
    torch.testing.assert_close(unclamped.detach(), torch.tensor(exact, dtype=torch.float64), atol=1e-12, rtol=0)
    (grad,) = torch.autograd.grad(unclamped.sum(), logp)
    assert bool(torch.all(grad != 0))               # every token keeps its gradient
    clamped = kl_estimate(logp, ref, "k3", AlgorithmConfig().kl_clamp, LOG_RATIO_CLAMP)
    assert float(clamped[0]) == 10.0 and float(clamped[1]) == pytest.approx(exact[1], abs=1e-12)
    assert exact[0] > 390
    cfg: Any = load_recipe(REPO / "recipes/tiny/grpo.yaml", ["algorithm.kl_clamp=null"])
    assert cfg.algorithm.kl_clamp is None
    assert replace(cfg.algorithm, kl_clamp=5.0).kl_clamp == 5.0
