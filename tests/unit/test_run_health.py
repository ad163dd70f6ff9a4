"""Run health (`train/health.py`): each signal trips at its threshold and not before; the verdict
over steps (the run's own start, warnings once, the stop after `trainer.stop_when_collapsed`
collapsed steps in a row, a resumed run's start and streak); and the defaults on real runs: no
signal on a healthy run of any shipped tiny recipe, a stop within a few steps of a collapse.

The real runs are tests/fixtures/health/*.jsonl (how they were made: the README there)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from megatron_rl.config import load_recipe
from megatron_rl.config.schema import HealthConfig
from megatron_rl.train.health import SIGNALS, RunHealth, baseline, read_rows, signals, verdict

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "recipes" / "tiny"
FIXTURES = REPO / "tests" / "fixtures" / "health"
H = HealthConfig()
CAP = 16
START = {"reward/mean": 0.4, "format_rate": 0.96, "entropy": 0.2}
HEALTHY = {"reward/mean": 0.45, "format_rate": 0.97, "zero_variance_group_frac": 0.25, "grad_norm": 0.5,
           "entropy": 0.18, "mismatch/abs_mean": 1.5e-7, "response_length/mean": 8.0}


def tripped(**changes: float) -> set[str]:
    return set(signals({**HEALTHY, **changes}, START, H, CAP))


# ------------------------------------------------------------------------ one step's signals
def test_a_healthy_step_trips_nothing_and_a_dead_one_everything() -> None:
    assert tripped() == set()
    dead = {"reward/mean": 0.0, "format_rate": 0.0, "zero_variance_group_frac": 1.0, "grad_norm": 0.0,
            "entropy": 1.5, "mismatch/abs_mean": 0.8, "response_length/mean": 16.0}
    assert tripped(**dead) == set(SIGNALS)


@pytest.mark.parametrize(("key", "safe", "trips", "signal"), [
    ("reward/mean", 0.1, 0.099, "reward"),                      # 0.4 − 0.75 × 0.4
    ("format_rate", 0.24, 0.2399, "format_rate"),               # 0.25 × 0.96
    ("zero_variance_group_frac", 0.949, 0.95, "flat_groups"),
    ("grad_norm", 1e-3, 0.00099, "grad_norm"),
    ("entropy", 0.0101, 0.0099, "entropy"),                     # 0.05 × 0.2
    ("entropy", 1.0, 1.001, "entropy"),                         # 5 × 0.2
    ("mismatch/abs_mean", 0.5, 0.501, "mismatch"),
    ("response_length/mean", 15.19, 15.2, "length_at_cap"),      # 0.95 × 16
])
def test_each_signal_trips_at_its_threshold(key: str, safe: float, trips: float, signal: str) -> None:
    changes: dict[str, float] = {key: safe}
    if signal in ("flat_groups", "grad_norm"):
        changes["reward/mean"] = 0.4        # not above the start
    assert tripped(**changes) == set()
    assert tripped(**{**changes, key: trips}) == {signal}


def test_flat_groups_and_no_gradient_of_a_run_that_got_better_are_not_a_collapse() -> None:
    solved = {"zero_variance_group_frac": 1.0, "grad_norm": 0.0}
    assert tripped(**solved, **{"reward/mean": 0.41}) == set()
    assert tripped(**solved, **{"reward/mean": 0.4}) == {"flat_groups", "grad_norm"}


def test_a_negative_start_and_missing_or_non_finite_metrics() -> None:
    start = {**START, "reward/mean": -0.5}
    assert set(signals({**HEALTHY, "reward/mean": -0.87}, start, H, CAP)) == set()
    assert set(signals({**HEALTHY, "reward/mean": -0.88}, start, H, CAP)) == {"reward"}
    # A task without a format rate, a skipped update's NaN gradient: those signals stay quiet.
    no_format = {k: v for k, v in HEALTHY.items() if k != "format_rate"}
    assert set(signals({**no_format, "grad_norm": float("nan"), "reward/mean": 0.0}, START, H, CAP)) == {"reward"}
    # On the first step there is no start yet: only the absolute bounds apply.
    assert set(signals({**HEALTHY, "reward/mean": 0.0, "response_length/mean": 16.0}, {}, H, CAP)) == {"length_at_cap"}


def test_the_start_is_the_mean_of_the_first_steps() -> None:
    rows = [{"reward/mean": 0.3, "format_rate": 0.9, "entropy": None}, {"reward/mean": 0.5, "format_rate": 1.0}]
    assert baseline(rows) == pytest.approx({"reward/mean": 0.4, "format_rate": 0.95})


def test_the_start_is_the_steps_before_up_to_baseline_steps_so_step_2_can_collapse() -> None:
    h = RunHealth(dataclasses.replace(H, baseline_steps=3), 5, CAP)
    h.check(1, {**HEALTHY, "reward/mean": 0.3})
    m = {**HEALTHY, "reward/mean": 0.0, "format_rate": 0.0}
    h.check(2, m)                                        # against step 1 alone
    assert (m["health/reward"], m["health/format_rate"], m["health/collapsed"]) == (1, 1, 1)
    for step in (3, 4, 5):
        h.check(step, {**HEALTHY, "reward/mean": 0.6})
    assert h.start["reward/mean"] == pytest.approx(0.5)   # steps 1, 3, 4; the collapsed step 2 is no start


# ------------------------------------------------------------------------ the verdict over steps
def monitor(stop_after: int = 3, **health: Any) -> RunHealth:
    return RunHealth(dataclasses.replace(H, baseline_steps=2, **health), stop_after, CAP)


DEAD = {**HEALTHY, "reward/mean": 0.0, "format_rate": 0.0, "response_length/mean": 16.0}


def test_warned_once_per_signal_stopped_after_the_streak_naming_signals_and_start(
        capsys: pytest.CaptureFixture[str]) -> None:
    h = monitor()
    lines = [h.check(step, dict(m)) for step, m in enumerate([HEALTHY, HEALTHY], start=1)]
    assert lines == [None, None] and capsys.readouterr().out == ""
    m = {**HEALTHY, "response_length/mean": 16.0}                  # one signal: a warning only
    assert h.check(3, m) is None
    assert (m["health/ok"], m["health/signals"], m["health/collapsed"], m["health/length_at_cap"]) == (0, 1, 0, 1)
    assert "[health] warning at step 3: mean response length 16 at the cap (16)" in capsys.readouterr().out
    assert h.check(4, dict(DEAD)) is None
    out = capsys.readouterr().out
    assert "warning at step 4: reward 0 vs" in out and "format rate 0 vs" in out and "length" not in out
    assert h.check(5, dict(DEAD)) is None and capsys.readouterr().out == ""      # nothing new to say
    m = dict(DEAD)
    line = h.check(6, m)
    assert m["health/collapsed_steps"] == 3 and m["health/collapsed"] == 1
    assert line is not None and line.startswith("the run collapsed at step 4: reward, format_rate, length_at_cap "
                                                "tripped on 3 steps in a row (trainer.stop_when_collapsed 3)")
    assert "at step 6: reward 0 vs 0.45" in line


def test_a_healthy_step_resets_the_streak_and_zero_never_stops() -> None:
    h = monitor()
    for step, m in enumerate([HEALTHY, HEALTHY, DEAD, DEAD, HEALTHY, DEAD, DEAD], start=1):
        assert h.check(step, dict(m)) is None
    assert (h.streak, h.streak_start) == (2, 6)
    never = monitor(stop_after=0)
    assert all(never.check(step, dict(HEALTHY if step <= 2 else DEAD)) is None for step in range(1, 30))
    assert never.streak == 27


def test_min_signals_decides_what_a_collapsed_step_is() -> None:
    h = monitor(stop_after=1, min_signals=4)
    assert h.check(1, dict(HEALTHY)) is None and h.check(2, dict(HEALTHY)) is None
    assert h.check(3, dict(DEAD)) is None                           # 3 signals < 4
    assert h.check(4, {**DEAD, "mismatch/abs_mean": 0.9}) is not None


def test_a_resumed_run_keeps_its_start_and_streak(tmp_path: Path) -> None:
    straight = monitor()
    rows = []
    for step, m in enumerate([HEALTHY, HEALTHY, DEAD, DEAD], start=1):
        m = dict(m)
        straight.check(step, m)
        rows.append({"step": step, **m})
    path = tmp_path / "metrics.jsonl"
    # Rows of steps after the checkpoint (5) and a torn last line are what a kill leaves.
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + json.dumps({"step": 5, **DEAD}) + "\n{\"ste")
    assert [r["step"] for r in read_rows(path, 4)] == [1, 2, 3, 4] and read_rows(path, 0) == []
    cfg = load_recipe(TINY / "grpo.yaml", ["trainer.stop_when_collapsed=3", "trainer.health.baseline_steps=2",
                                           "rollout.max_response_length=16"])
    resumed = RunHealth.of(cfg, tmp_path, 4)
    assert (resumed.start, resumed.streak, resumed.streak_start) == (straight.start, 2, 3)
    line = resumed.check(5, dict(DEAD))
    assert line is not None and line.startswith("the run collapsed at step 3:")
    assert RunHealth.of(cfg, tmp_path / "fresh", 0).history == []


def test_the_verdict_of_a_finished_run() -> None:
    h = monitor(stop_after=0)
    rows = []
    for step, m in enumerate([HEALTHY, HEALTHY, DEAD, HEALTHY, DEAD, DEAD], start=1):
        m = dict(m)
        h.check(step, m)
        rows.append({"step": step, **m})
    assert verdict(rows) == {"collapsed": True, "first_collapsed_step": 3, "collapsed_steps_in_a_row": 2,
                             "signals": ["format_rate", "length_at_cap", "reward"]}
    assert verdict(rows[:2])["collapsed"] is False


# ------------------------------------------------------------------------ real runs
def replay(name: str, recipe: str, *overrides: str) -> tuple[list[dict[str, Any]], str | None]:
    """A fixture's rows through the health of `recipe` (its own thresholds and length cap), as the
    loop checks them: the rows with their `health/*` and the stop line (None: the run went on)."""
    health = RunHealth.of(load_recipe(TINY / recipe, list(overrides)), FIXTURES / "none", 0)
    rows = [json.loads(line) for line in (FIXTURES / f"{name}.jsonl").read_text().splitlines()]
    for row in rows:
        line = health.check(row["step"], row, rank0=False)
        if line is not None:
            return rows[:rows.index(row) + 1], line
    return rows, None


ASYNC = ("rollout.max_staleness=1", "rollout.placement=disaggregated", "rollout.nodes=1")


@pytest.mark.parametrize(("name", "recipe", "overrides", "steps"), [
    ("tiny_grpo", "grpo.yaml", (), 80), ("tiny_gspo", "gspo.yaml", (), 40), ("tiny_chord", "chord.yaml", (), 80),
    ("tiny_grpo_lora", "grpo_lora.yaml", (), 80),
    # bench/async_bench.py's two runs: its sync one dipped to format rate 0.55 at step 6 and came
    # back; its async one (token TIS, the default) has the staleness in its mismatch (up to 0.05).
    ("tiny_grpo_bench_sync", "grpo.yaml", (), 80), ("tiny_grpo_async_tis", "grpo.yaml", ASYNC, 80)])
def test_no_signal_trips_on_a_healthy_run_of_a_shipped_tiny_recipe(name: str, recipe: str, overrides: tuple[str, ...],
                                                                   steps: int) -> None:
    # Each run is the recipe's own, all of its `trainer.max_steps` (the fixtures' README).
    assert load_recipe(TINY / recipe).trainer.max_steps == steps
    rows, line = replay(name, recipe, *overrides)
    assert line is None and len(rows) == steps
    noisy = {(r["step"], s) for r in rows for s in SIGNALS if r[f"health/{s}"]}
    assert noisy == set(), noisy


def test_the_tiny_grpo_at_20x_its_learning_rate_is_stopped_within_the_streak_of_its_collapse() -> None:
    # `megatron-rl train recipes/tiny/grpo.yaml trainer.lr=2e-2`: dead from step 2 (reward 0, format 0,
    # every group flat, grad norm 0, entropy 23× its start, the length cap).
    rows, line = replay("tiny_grpo_lr20x", "grpo.yaml")
    stop_after = load_recipe(TINY / "grpo.yaml").trainer.stop_when_collapsed
    assert stop_after == 5
    assert [r["health/collapsed"] for r in rows] == [0] + [1] * stop_after
    assert line is not None and line.startswith(
        "the run collapsed at step 2: reward, format_rate, flat_groups, grad_norm, entropy, length_at_cap tripped on 5 "
        "steps in a row")


def test_the_async_run_without_a_correction_that_nearly_died_is_flagged_at_its_dip() -> None:
    # async_bench with `algorithm.correction.mode=none` written: at step 65 the collapse
    # began (reward 0.02, format rate 0.07, answers at the cap, mismatch 0.11) and, that time, the run
    # came back at step 67. One collapsed step: flagged in health/*, no stop at the default streak.
    rows, line = replay("tiny_grpo_async_none", "grpo.yaml", *ASYNC, "algorithm.correction.mode=none")
    assert line is None and len(rows) == 80
    assert [r["step"] for r in rows if r["health/collapsed"]] == [65]
    assert verdict(rows) == {"collapsed": True, "first_collapsed_step": 65, "collapsed_steps_in_a_row": 1,
                             "signals": ["format_rate", "length_at_cap", "reward"]}
    _, line = replay("tiny_grpo_async_none", "grpo.yaml", *ASYNC, "trainer.stop_when_collapsed=1")
    assert line is not None and line.startswith("the run collapsed at step 65: reward, format_rate, length_at_cap")


def test_the_async_run_without_a_correction_that_died_is_stopped_within_the_streak() -> None:
    # The same bench, a third try: reward 0.36 → 0 from step 8 (format 0.01, every group flat, grad
    # norm 0, then every answer at the cap); its health stopped it at step 12, exit 1, as replayed here.
    rows, line = replay("tiny_grpo_async_none_collapsed", "grpo.yaml", *ASYNC, "algorithm.correction.mode=none")
    assert [r["step"] for r in rows if r["health/collapsed"]] == [8, 9, 10, 11, 12] and rows[-1]["step"] == 12
    assert line is not None and line.startswith("the run collapsed at step 8: reward, format_rate, length_at_cap "
                                                "tripped on 5 steps in a row")
