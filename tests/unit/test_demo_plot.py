"""The demo's reward curve: the rolling mean against a float64 reference, and the figure carries the
reward, its rolling mean and the periodic greedy eval accuracy as separate series."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from megatron_rl.commands.demo import plot, reward_figure, rolling_mean


def _rows(n: int = 25, every: int = 10) -> list[dict]:
    rng = random.Random(0)
    rows = [{"step": s, "reward/mean": rng.random(), "accuracy": rng.random()} for s in range(1, n + 1)]
    for r in rows:
        if r["step"] % every == 0:
            r["eval/accuracy"] = rng.random()
    return rows


@pytest.mark.parametrize("window", [1, 3, 10, 40])
def test_rolling_mean_matches_a_float64_window_mean(window: int) -> None:
    values = [r["reward/mean"] for r in _rows()]
    expected = [sum(values[max(0, i - window + 1):i + 1]) / len(values[max(0, i - window + 1):i + 1])
                for i in range(len(values))]
    assert rolling_mean(values, window) == pytest.approx(expected, rel=0, abs=1e-12)


def test_the_figure_shows_reward_its_rolling_mean_and_the_eval_points() -> None:
    import matplotlib.pyplot as plt

    rows = _rows()
    fig = reward_figure(rows, window=10)
    lines = {line.get_label(): line for line in fig.axes[0].get_lines()}
    plt.close(fig)
    assert set(lines) == {"reward (mean)", "reward (10-step rolling mean)", "accuracy (sampled)",
                          "eval accuracy (greedy)"}
    evals = lines["eval accuracy (greedy)"]
    assert list(evals.get_xdata()) == [10, 20]                         # only the steps that evaluated
    assert list(evals.get_ydata()) == [rows[9]["eval/accuracy"], rows[19]["eval/accuracy"]]
    assert evals.get_linestyle() == "None"                              # points, not a line
    rolled = lines["reward (10-step rolling mean)"].get_ydata()
    assert list(rolled) == pytest.approx(rolling_mean([r["reward/mean"] for r in rows], 10))


def test_plot_writes_the_png_into_the_run_dir(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _rows(5, every=2)))
    out = plot(tmp_path)
    assert out == tmp_path / "reward_curve.png" and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
