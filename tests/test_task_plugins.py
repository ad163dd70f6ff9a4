"""Tasks and rewards as plugins: built-in tasks load like a user's; a bad path fails before any
model or server starts, naming the path; the tiny model trains with a task and reward defined in
tests/custom_task.py (a real vLLM server and megatron-core, as in test_train_e2e.py)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from megatron_rl.config import load_recipe
from megatron_rl.tasks import BUILTIN_TASKS, PluginError, Task, load_task_spec, plugin_problems, resolve_task
from tests import custom_task
from tests.rollout_fixtures import REPO, demo_assets

TINY = REPO / "recipes" / "tiny" / "grpo.yaml"
SMALL = ["trainer.global_batch_size=16", "rollout.n=4", "trainer.micro_batch_size=4", "rollout.max_concurrency=1"]


def write_recipe(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(f"defaults: {TINY}\n{body}")
    return path


def cli(*args: str, env: dict[str, str] | None = None, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megatron_rl.cli", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})))


# --- loading ---------------------------------------------------------------------------------------

def test_builtin_tasks_are_found_by_the_same_path_lookup_as_a_users() -> None:
    for name, path in BUILTIN_TASKS.items():
        task = load_task_spec(name)
        assert isinstance(task, Task) and task.name == name
        assert load_task_spec(path) is task is load_task_spec(f"{path}:TASK")
    assert load_task_spec("tests.custom_task") is custom_task.TASK


def test_recipe_names_rewards_by_path_with_weights(tmp_path: Path) -> None:
    recipe = write_recipe(tmp_path, "task: tests.custom_task\nrewards:\n  weights:\n"
                                    "    tests.custom_task:brevity: 2.0\n    mcq_answer: 0.5\n")
    cfg = load_recipe(recipe)
    loaded = resolve_task(cfg.task, cfg.rewards.weights)
    assert loaded.functions["tests.custom_task:brevity"] is custom_task.brevity
    total, parts = loaded.reward("[ans]a[/ans]", {"answer": ["a"]})   # 12 characters
    assert parts == {"tests.custom_task:brevity": pytest.approx(1 - 12 / 32), "mcq_answer": 1.0}
    assert total == pytest.approx(2.0 * (1 - 12 / 32) + 0.5)
    # Without rewards.weights the task's own rewards are used.
    assert resolve_task("tests.custom_task", {}).weights == {"tests.custom_task:brevity": 1.0}


def test_batch_metrics_come_from_the_task_hooks() -> None:
    mcq = resolve_task("mcq", {})
    got = mcq.batch_metrics(["[ans]a[/ans]", "[ans]b[/ans]", "no tag"], [{"answer": ["a"]}] * 3)
    assert got == {"format_rate": pytest.approx(2 / 3), "accuracy": pytest.approx(1 / 3)}
    # A task without a format check or a scorer logs neither.
    assert resolve_task("tests.custom_task", {}).batch_metrics(["x"], [{}]) == {}
    # IgakuQA's scorer is the official rule: 116A71 counts as correct for any answer.
    igaku = load_task_spec("igakuqa")
    assert igaku.score("[ans]e[/ans]", {"id": "116A71", "answer": ["a"]}) == 1.0
    assert igaku.score("[ans]e[/ans]", {"id": "116A70", "answer": ["a"]}) == 0.0


@pytest.mark.parametrize("task,weights,key,needle", [
    ("tests.no_such_module", {}, "task", "cannot import module 'tests.no_such_module'"),
    ("tests.custom_task:NOT_A_TASK", {}, "task", "is a int, not a megatron_rl.tasks.Task"),
    ("tests.custom_task:missing", {}, "task", "has no attribute 'missing'"),
    ("mcq", {"tests.custom_task:one_argument": 1.0}, "rewards.weights.tests.custom_task:one_argument",
     "cannot be called as (response: str, sample)"),
    ("mcq", {"tests.no_such_module:fn": 1.0}, "rewards.weights.tests.no_such_module:fn", "cannot import module"),
    ("mcq", {"mcq_answr": 1.0}, "rewards.weights.mcq_answr", "allowed: japanese_only, mcq_answer"),
    ("mcq", {"mcq_answer": float("nan")}, "rewards.weights.mcq_answer", "must be a finite number, got nan"),
])
def test_bad_plugins_are_reported_with_their_path(task: str, weights: dict, key: str, needle: str) -> None:
    ((got_key, message),) = plugin_problems(task, weights)
    assert got_key == key and needle in message
    path = task if key == "task" else next(iter(weights))
    assert repr(path) in message
    with pytest.raises(PluginError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        resolve_task(task, weights)


def test_train_refuses_a_bad_plugin_before_any_process_group_or_model(tmp_path: Path) -> None:
    from megatron_rl.megatron import cpu_compat

    cpu_compat.apply()          # what `megatron-rl train` does before importing the trainer
    from megatron_rl.train.loop import train

    cfg = load_recipe(TINY, ["task=tests.no_such_module", f"logging.output_dir={tmp_path}"])
    with pytest.raises(PluginError, match="tests.no_such_module"):
        train(cfg)
    assert not dist.is_initialized() and not any(tmp_path.iterdir())


def test_cli_train_with_a_bad_reward_path_fails_fast_naming_it(tmp_path: Path) -> None:
    recipe = write_recipe(tmp_path, "rewards:\n  weights:\n    tests.custom_task:nope: 1.0\n")
    started = time.monotonic()
    proc = cli("train", str(recipe), f"logging.output_dir={tmp_path / 'runs'}", timeout=300)
    assert proc.returncode == 1
    assert "tests.custom_task:nope" in proc.stderr and "has no attribute 'nope'" in proc.stderr, proc.stderr
    assert not (tmp_path / "runs").exists()                  # no run dir: nothing was started
    assert "rollout server" not in proc.stdout + proc.stderr
    assert time.monotonic() - started < 120


# --- training with a user's task --------------------------------------------------------------------

@pytest.mark.slow
def test_tiny_model_trains_with_a_task_and_reward_from_a_test_file(tmp_path: Path) -> None:
    demo_assets()
    recipe = write_recipe(tmp_path, "task: tests.custom_task\nrewards:\n  weights:\n"
                                    "    tests.custom_task:brevity: 1.0\n    mcq_answer: 0.5\n")
    log = tmp_path / "prompts.log"
    proc = cli("train", str(recipe), *SMALL, "trainer.max_steps=2", f"logging.output_dir={tmp_path}",
               "logging.run_name=r", env={custom_task.PROMPT_LOG_ENV: str(log)})
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    rows = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        brevity, mcq = r["reward/tests.custom_task:brevity/mean"], r["reward/mcq_answer/mean"]
        assert 0.0 <= brevity <= 1.0 and 0.0 <= mcq <= 1.0
        assert r["reward/mean"] == pytest.approx(brevity + 0.5 * mcq, abs=1e-6)
        assert "accuracy" not in r and "format_rate" not in r   # the task defines neither hook
        assert r["sync/verify_max_abs_diff"] <= 1e-4            # probe: the task's "[ans]b[/ans]"
        assert r["update_skipped"] == 0
    assert any(r["grad_norm"] > 0 for r in rows)
    # Every training and eval prompt (the tiny recipes evaluate on eval.jsonl) was rendered by the
    # task's prompt format.
    n_prompts = sum(1 for name in ("train.jsonl", "eval.jsonl")
                    for line in (REPO / ".cache/demo" / name).read_text().splitlines() if line.strip())
    assert len(log.read_text().splitlines()) == n_prompts
    (task_line,) = re.findall(r"^  task +(.*)$", proc.stdout, re.M)
    name, rewards = task_line.split(": ", 1)
    assert name == "terse" and sorted(rewards.split(", ")) == ["mcq_answer ×0.5", "tests.custom_task:brevity ×1"]
