"""Tasks and rewards as plugins: built-in tasks load like a user's; a bad path fails before any
model or server starts, naming the path; the tiny model trains with a task and reward defined in
tests/helpers/custom_task.py (a real vLLM server and megatron-core, as in test_train_e2e.py)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from megatron_rl.rollout.server import EXTERNAL_SERVERS_ENV
from tests.helpers import custom_task
from tests.helpers.rollout import demo_assets
from tests.helpers.train import SMALL, cli, write_recipe


def test_tiny_model_trains_with_a_task_and_reward_from_a_test_file(tmp_path: Path, demo_servers_dir: Path) -> None:
    recipe = write_recipe(tmp_path, "task: tests.helpers.custom_task\nrewards:\n  weights:\n"
                                    "    tests.helpers.custom_task:brevity: 1.0\n    mcq_answer: 0.5\n")
    log = tmp_path / "prompts.log"
    proc = cli("train", str(recipe), *SMALL, "trainer.max_steps=2", f"logging.output_dir={tmp_path}",
               "logging.run_name=r",
               env={custom_task.PROMPT_LOG_ENV: str(log), EXTERNAL_SERVERS_ENV: str(demo_servers_dir)})
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    rows = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        brevity, mcq = r["reward/tests.helpers.custom_task:brevity/mean"], r["reward/mcq_answer/mean"]
        assert 0.0 <= brevity <= 1.0 and 0.0 <= mcq <= 1.0
        assert r["reward/mean"] == pytest.approx(brevity + 0.5 * mcq, abs=1e-6)
        assert "accuracy" not in r and "format_rate" not in r   # the task defines neither hook
        assert r["sync/verify_max_abs_diff"] <= 1e-4            # probe: the task's "[ans]b[/ans]"
        assert r["update_skipped"] == 0
    assert any(r["grad_norm"] > 0 for r in rows)
    # Every training and eval prompt (the tiny recipes evaluate on eval.jsonl) was rendered by the
    # task's prompt format.
    n_prompts = sum(1 for name in ("train", "eval")
                    for line in (demo_assets()[name]).read_text().splitlines() if line.strip())
    assert len(log.read_text().splitlines()) == n_prompts
    (task_line,) = re.findall(r"^  task +(.*)$", proc.stdout, re.M)
    name, rewards = task_line.split(": ", 1)
    assert name == "terse"
    assert sorted(rewards.split(", ")) == ["mcq_answer ×0.5", "tests.helpers.custom_task:brevity ×1"]
