"""bench/peer_bench.py's arithmetic (the runs themselves need TRL, a bench-only dependency)."""

from __future__ import annotations

import pytest

from bench.peer_bench import summarize


def test_steady_state_leaves_out_the_warmup_and_start_up_counts_the_whole_process() -> None:
    times = [9.0, 1.0, 3.0, 2.0] + [2.0] * 8
    rewards = [0.1] * 10 + [0.5, 0.7]
    got = summarize(times, rewards, {"train": [5.0, 1.0, 1.5, 2.0] + [1.0] * 8}, wall_s=60.0, warmup=1)
    assert got["steady_s_per_step"] == 2.0 and got["steady_steps_per_s"] == 0.5       # 9 s first step left out
    assert got["with_startup_steps_per_s"] == pytest.approx(12 / 60.0)
    assert got["reward_first10"] == pytest.approx(0.1)
    assert got["reward_last10"] == pytest.approx((0.1 * 8 + 0.5 + 0.7) / 10)
    assert got["phase_median_s"] == {"train": 1.0}
