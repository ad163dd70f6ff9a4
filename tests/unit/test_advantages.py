"""Group-normalized advantages against a float64 pure-Python reference."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_rl.advantages import available_advantage_estimators, compute_advantages

TOL = 1e-12


def reference(rewards: list[list[float]], estimator: str, eps: float) -> list[list[float]]:
    out = []
    for group in rewards:
        g = len(group)
        mean = sum(group) / g
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / g)  # population std
        if max(group) == min(group):
            out.append([0.0] * g)
        elif estimator == "grpo":
            out.append([(r - mean) / (std + eps) for r in group])
        else:
            out.append([r - mean for r in group])
    return out


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo"])
@pytest.mark.parametrize("flat", [True, False])
def test_matches_reference(estimator: str, flat: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    rewards = torch.randn(6, 5, generator=gen, dtype=torch.float64)
    rewards[2] = 0.7  # zero-variance group
    rewards[4] = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0], dtype=torch.float64)  # binary rewards
    expected = torch.tensor(reference(rewards.tolist(), estimator, 1e-6), dtype=torch.float64)
    inp = rewards.reshape(-1) if flat else rewards
    res = compute_advantages(inp, group_size=5 if flat else None, estimator=estimator, eps=1e-6)
    assert res.advantages.shape == inp.shape
    assert res.advantages.dtype == torch.float64
    torch.testing.assert_close(res.advantages.reshape(6, 5), expected, atol=TOL, rtol=0)


def test_grpo_group_has_zero_mean_unit_population_variance() -> None:
    rewards = torch.tensor([[0.0, 1.0, 1.0, 3.0]], dtype=torch.float64)
    adv = compute_advantages(rewards, eps=0.0).advantages
    assert abs(float(adv.mean())) < TOL
    assert abs(float((adv**2).mean()) - 1.0) < TOL  # divides by G, not G - 1


def test_zero_variance_groups_detected_and_masked() -> None:
    # 0.1 repeated: float32 mean of identical values need not be bit-exact, detection must be.
    rewards = torch.tensor([0.1, 0.1, 0.1, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 2.0, 2.5, 3.0], dtype=torch.float32)
    res = compute_advantages(rewards, group_size=3, drop_zero_variance=True)
    assert res.zero_variance_groups.tolist() == [True, False, True, False]
    assert res.num_zero_variance == 2
    assert res.frac_zero_variance == pytest.approx(0.5)
    assert res.sample_mask is not None
    assert res.sample_mask.tolist() == [False] * 3 + [True] * 3 + [False] * 3 + [True] * 3
    assert torch.all(res.advantages[:3] == 0) and torch.all(res.advantages[6:9] == 0)
    assert res.advantages.dtype == torch.float32


def test_no_mask_unless_requested_and_integer_rewards() -> None:
    res = compute_advantages(torch.tensor([[1, 0], [1, 1]]))
    assert res.sample_mask is None
    assert res.advantages.dtype == torch.float32
    assert res.advantages[0, 0] > 0 > res.advantages[0, 1]


def test_group_size_one_is_zero_variance() -> None:
    res = compute_advantages(torch.tensor([1.0, 2.0]), group_size=1)
    assert res.num_zero_variance == 2 and torch.all(res.advantages == 0)


def test_errors_list_allowed_names_and_bad_shapes() -> None:
    assert available_advantage_estimators() == ["dr_grpo", "grpo"]
    with pytest.raises(ValueError, match="allowed: dr_grpo, grpo"):
        compute_advantages(torch.zeros(4), group_size=2, estimator="ppo")
    with pytest.raises(ValueError, match="groups of 3"):
        compute_advantages(torch.zeros(4), group_size=3)
    with pytest.raises(ValueError):
        compute_advantages(torch.zeros(4))
    with pytest.raises(ValueError):
        compute_advantages(torch.zeros(2, 4), group_size=3)


def _ms_swift_advantages(rewards: list[list[float]]) -> list[list[float]]:
    """ms-swift 3.11 `_compute_advantages` (scale_rewards 'group', the grpo default): (r − group
    mean) / (torch.std (Bessel) + 1e-4), in float64."""
    out = []
    for group in rewards:
        mean = sum(group) / len(group)
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / (len(group) - 1))
        out.append([(r - mean) / (std + 1e-4) for r in group])
    return out


@pytest.mark.parametrize("g", [2, 16])
def test_unbiased_std_with_eps_1e4_is_ms_swift_s(g: int) -> None:
    gen = torch.Generator().manual_seed(g)
    rewards = torch.randint(0, 3, (5, g), generator=gen).double() * 0.5
    rewards[0] = 1.0                                         # a flat group: 0 in both
    got = compute_advantages(rewards, estimator="grpo", eps=1e-4, unbiased=True).advantages
    expected = _ms_swift_advantages(rewards.tolist())
    assert got.flatten().tolist() == pytest.approx([a for group in expected for a in group], abs=1e-12)
    pop = compute_advantages(rewards, estimator="grpo", eps=1e-4).advantages
    varied = rewards.amax(-1) != rewards.amin(-1)
    ratio = (got[varied] / pop[varied])[pop[varied].abs() > 0]
    assert ratio.tolist() == pytest.approx([math.sqrt((g - 1) / g)] * ratio.numel(), rel=1e-3)


def test_article_000_s_two_sample_groups_get_0707_not_1() -> None:
    rewards = torch.tensor([[1.0, 0.1]], dtype=torch.float64)           # correct vs formatted-wrong
    ms_swift = compute_advantages(rewards, eps=1e-4, unbiased=True).advantages
    ours = compute_advantages(rewards).advantages
    assert ms_swift[0, 0].item() == pytest.approx(0.45 / (0.45 * math.sqrt(2) + 1e-4))
    assert ms_swift[0, 0].item() == pytest.approx(0.7070, abs=1e-4)
    assert ours[0, 0].item() == pytest.approx(1.0, abs=1e-5)
