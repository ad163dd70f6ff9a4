"""Periodic evaluation in a real tiny run: `eval/*` metrics from greedy answers on `data.eval_path`."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.train import metrics, run_train


def test_a_run_with_eval_path_logs_eval_metrics(tmp_path: Path, demo_servers_dir: Path) -> None:
    run = run_train("grpo.yaml", tmp_path, "r", "trainer.max_steps=2", "evaluation.interval=1",
                    "evaluation.max_prompts=12", "rollout.max_response_length=16", servers=demo_servers_dir)
    rows = metrics(run)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["eval/prompts"] == 12
        # One greedy sample per prompt, scored with the task's rewards (mcq: mcq_answer, weight 1).
        assert r["eval/reward_mean"] == pytest.approx(r["eval/reward/mcq_answer_mean"]) == r["eval/accuracy"]
        assert r["eval/accuracy"] * 12 == pytest.approx(round(r["eval/accuracy"] * 12))   # k of 12 right
        assert 0 < r["eval/response_length_mean"] <= 16
        assert r["time/eval"] > 0
