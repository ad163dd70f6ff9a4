"""bench/async_bench.py's summary (pure logic; the bench itself runs two 80-step trainings on real
servers): steady steps/s from the rows' arrival times, the reward windows, the noise test and the goal."""

from __future__ import annotations

import math
import statistics
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench import async_bench  # noqa: E402


def _rows(rewards: list[float], **extra: float) -> list[dict]:
    return [{"step": i, "reward/mean": r, "time/step": 1.0, **extra} for i, r in enumerate(rewards, 1)]


def _arrivals(n: int, start: float, every: float) -> dict[int, float]:
    return {s: start + (s - 1) * every for s in range(1, n + 1)}


def test_throughput_is_steps_over_the_time_between_the_first_and_last_rows() -> None:
    rows = _rows([0.5] * 20)
    # Start-up and step 1 end when the first row appears and do not count (the origin of the
    # times is arbitrary): (20 - 1) steps over (t20 - t1).
    arrivals = _arrivals(20, start=1000.0, every=2.0)
    assert async_bench.mode_stats(rows, arrivals)["steps_per_s"] == pytest.approx(0.5)
    arrivals[1] = 900.0                     # a slow step 2 (row 1 → row 2) does count
    assert async_bench.mode_stats(rows, arrivals)["steps_per_s"] == pytest.approx(19 / (arrivals[20] - 900.0))
    stats = async_bench.mode_stats(rows, arrivals)
    assert stats["time_step_sum_s"] == 20.0 and stats["steady_wall_s"] == pytest.approx(138.0)
    assert async_bench.mode_stats(rows[:1], {1: 5.0})["steps_per_s"] is None


def test_reward_windows_noise_staleness_and_waits() -> None:
    rewards = [0.1 * (i % 3) + i / 100 for i in range(1, 31)]
    rows = _rows(rewards, **{"rollout/staleness_mean": 0.5, "rollout/dropped_stale": 2.0,
                             "time/trainer_wait_s": 0.25})
    rows[7]["rollout/staleness_max"] = 1.0
    rows[3]["time/trainer_wait_s"] = float("nan")       # a non-finite value is not averaged in
    stats = async_bench.mode_stats(list(reversed(rows)), _arrivals(30, 0.0, 1.0))   # order does not matter
    assert stats["reward_first10"] == pytest.approx(statistics.fmean(rewards[:10]))
    assert stats["reward_last10"] == pytest.approx(statistics.fmean(rewards[-10:]))
    assert stats["reward_last10_se"] == pytest.approx(statistics.stdev(rewards[-10:]) / math.sqrt(10))
    assert stats["staleness_mean"] == 0.5 and stats["staleness_max"] == 1.0 and stats["dropped_stale"] == 60.0
    assert stats["trainer_wait_s"] == 0.25 and stats["rollout_wait_s"] is None
    assert stats["reward_curve"][0] == (1, rewards[0]) and len(stats["reward_curve"]) == 30


def _pair(async_rewards: list[float], async_every: float) -> dict:
    sync_rewards = [0.6, 0.62, 0.58, 0.61, 0.59] * 4
    return {"sync": async_bench.mode_stats(_rows(sync_rewards), _arrivals(20, 0.0, 2.0)),
            "async": async_bench.mode_stats(_rows(async_rewards), _arrivals(20, 0.0, async_every))}


def test_goal_met_needs_the_speedup_and_an_end_reward_within_noise() -> None:
    same = [0.61, 0.6, 0.59, 0.6, 0.6] * 4
    out = async_bench.summarize(_pair(same, async_every=1.4), steps=20)
    assert out["speedup"] == pytest.approx(2.0 / 1.4)
    assert out["end_reward_within_noise"] is True and out["goal_met"] is True
    assert out["reward_noise"] == pytest.approx(statistics.stdev([0.6, 0.62, 0.58, 0.61, 0.59] * 2) / math.sqrt(10))

    slow = async_bench.summarize(_pair(same, async_every=1.6), steps=20)    # 1.25× < 1.3
    assert slow["end_reward_within_noise"] is True and slow["goal_met"] is False

    worse = async_bench.summarize(_pair([r - 0.05 for r in same], async_every=1.0), steps=20)
    assert worse["speedup"] == pytest.approx(2.0)
    assert worse["end_reward_diff"] == pytest.approx(-0.05)
    assert worse["end_reward_within_noise"] is False and worse["goal_met"] is False


def test_a_collapsed_side_is_never_a_result_and_says_why() -> None:
    same = [0.61, 0.6, 0.59, 0.6, 0.6] * 4
    stats = _pair(same, async_every=1.0)
    assert async_bench.summarize(stats, steps=20)["goal_met"] is True
    stats["async"]["health"] = {**stats["async"]["health"], "collapsed": True}
    stats["async"]["health_stop"] = "the run collapsed at step 5: reward, grad_norm tripped"
    out = async_bench.summarize(stats, steps=20)
    assert (out["goal_met"], out["sync_healthy"], out["async_healthy"]) == (False, True, False)
    assert out["goal_reason"] == "async run collapsed (the run collapsed at step 5: reward, grad_norm tripped)"
    # From the rows alone: a collapsed step logged by the trainer's health is enough.
    rows = _rows(same, **{"health/collapsed": 0.0})
    rows[4].update({"health/collapsed": 1.0, "health/collapsed_steps": 1.0, "health/reward": 1.0})
    stats["sync"] = async_bench.mode_stats(rows, _arrivals(20, 0.0, 2.0))
    assert stats["sync"]["health"] == {"collapsed": True, "first_collapsed_step": 5, "collapsed_steps_in_a_row": 1,
                                       "signals": ["reward"]}
    assert async_bench.summarize(stats, steps=20)["goal_reason"] == (
        "sync run collapsed at step 5 (longest streak 1 step(s): reward); async run collapsed (the run collapsed at "
        "step 5: reward, grad_norm tripped)")
    assert async_bench.health_stop("x\nerror: the run collapsed at step 3: a; checkpointed step 7\n") == \
        "the run collapsed at step 3: a; checkpointed step 7"
    assert async_bench.health_stop("error: trainer died") is None


def test_one_mode_alone_gives_nulls_not_a_verdict() -> None:
    stats = {"sync": async_bench.mode_stats(_rows([0.5, 0.6, 0.7]), _arrivals(3, 0.0, 1.0))}
    out = async_bench.summarize(stats, steps=3)
    assert out["sync_steps_per_s"] == pytest.approx(1.0)
    assert out["async_steps_per_s"] is None and out["speedup"] is None and out["goal_met"] is None
    assert out["sync_trainer_wait_s"] is None and out["goal_speedup"] == 1.3


def test_the_servers_variable_is_the_trainers() -> None:
    from megatron_rl.rollout.server import EXTERNAL_SERVERS_ENV

    assert async_bench.SERVERS_ENV == EXTERNAL_SERVERS_ENV
