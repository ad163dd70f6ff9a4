"""bench/peer_bench.py's arithmetic (the runs themselves need TRL, a bench-only dependency)."""

from __future__ import annotations

import pytest

from bench.peer_bench import reward_noise, summarize


def test_steady_state_leaves_out_the_warmup_and_start_up_counts_the_whole_process() -> None:
    times = [9.0, 1.0, 3.0, 2.0] + [2.0] * 8
    rewards = [0.1] * 10 + [0.5, 0.7]
    got = summarize(times, rewards, {"train": [5.0, 1.0, 1.5, 2.0] + [1.0] * 8}, wall_s=60.0, warmup=1)
    assert got["steady_s_per_step"] == 2.0 and got["steady_steps_per_s"] == 0.5       # 9 s first step left out
    assert got["with_startup_steps_per_s"] == pytest.approx(12 / 60.0)
    assert got["reward_first10"] == pytest.approx(0.1)
    assert got["reward_last10"] == pytest.approx((0.1 * 8 + 0.5 + 0.7) / 10)
    assert got["phase_median_s"] == {"train": 1.0}


def test_reward_gap_is_within_noise_only_when_under_two_standard_errors() -> None:
    runs = [{"ours": {"reward_last10": o}, "trl": {"reward_last10": t}}
            for o, t in [(0.45, 0.50), (0.47, 0.46), (0.49, 0.48)]]
    got = reward_noise(runs)
    assert got["ours"]["mean"] == pytest.approx(0.47) and got["trl"]["mean"] == pytest.approx(0.48)
    assert got["ours"]["sd"] == pytest.approx(0.02) and got["trl"]["sd"] == pytest.approx(0.02)
    assert got["gap"] == pytest.approx(-0.01)
    assert got["se_of_gap"] == pytest.approx((2 * 0.02 ** 2 / 3) ** 0.5)
    assert got["within_noise"] is True
    far = reward_noise([{"ours": {"reward_last10": o}, "trl": {"reward_last10": o + 0.1}} for o in (0.45, 0.47)])
    assert far["within_noise"] is False
    one = reward_noise(runs[:1])                  # one seed: a gap, but no noise to judge it by
    assert one["gap"] == pytest.approx(-0.05) and "within_noise" not in one
