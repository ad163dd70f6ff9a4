"""Tasks and rewards as plugins: built-in tasks load like a user's; a bad path fails before any
model or server starts, naming the path; the tiny model trains with a task and reward defined in
tests/helpers/custom_task.py (a real vLLM server and megatron-core, as in test_train_e2e.py)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch.distributed as dist

from megatron_rl.config import load_recipe
from megatron_rl.tasks import BUILTIN_TASKS, PluginError, Task, load_task_spec, plugin_problems, resolve_task
from tests.helpers import custom_task
from tests.helpers.rollout import REPO
from tests.helpers.train import cli, write_recipe

TINY = REPO / "recipes" / "tiny" / "grpo.yaml"


def test_builtin_tasks_are_found_by_the_same_path_lookup_as_a_users() -> None:
    for name, path in BUILTIN_TASKS.items():
        task = load_task_spec(name)
        assert isinstance(task, Task) and task.name == name
        assert load_task_spec(path) is task is load_task_spec(f"{path}:TASK")
    assert load_task_spec("tests.helpers.custom_task") is custom_task.TASK

def test_recipe_names_rewards_by_path_with_weights(tmp_path: Path) -> None:
    recipe = write_recipe(tmp_path, "task: tests.helpers.custom_task\nrewards:\n  weights:\n"
                                    "    tests.helpers.custom_task:brevity: 2.0\n    mcq_answer: 0.5\n")
    cfg = load_recipe(recipe)
    loaded = resolve_task(cfg.task, cfg.rewards.weights)
    assert loaded.functions["tests.helpers.custom_task:brevity"] is custom_task.brevity
    total, parts = loaded.reward("[ans]a[/ans]", {"answer": ["a"]})   # 12 characters
    assert parts == {"tests.helpers.custom_task:brevity": pytest.approx(1 - 12 / 32), "mcq_answer": 1.0}
    assert total == pytest.approx(2.0 * (1 - 12 / 32) + 0.5)
    # Without rewards.weights the task's own rewards are used.
    assert resolve_task("tests.helpers.custom_task", {}).weights == {"tests.helpers.custom_task:brevity": 1.0}

def test_batch_metrics_come_from_the_task_hooks() -> None:
    mcq = resolve_task("mcq", {})
    got = mcq.batch_metrics(["[ans]a[/ans]", "[ans]b[/ans]", "no tag"], [{"answer": ["a"]}] * 3)
    assert got == {"format_rate": pytest.approx(2 / 3), "accuracy": pytest.approx(1 / 3)}
    # A task without a format check or a scorer logs neither.
    assert resolve_task("tests.helpers.custom_task", {}).batch_metrics(["x"], [{}]) == {}
    # IgakuQA's scorer is the official rule: 116A71 counts as correct for any answer.
    igaku = load_task_spec("igakuqa")
    assert igaku.score("[ans]e[/ans]", {"id": "116A71", "answer": ["a"]}) == 1.0
    assert igaku.score("[ans]e[/ans]", {"id": "116A70", "answer": ["a"]}) == 0.0

@pytest.mark.parametrize("task,weights,key,needle", [
    ("tests.no_such_module", {}, "task", "cannot import module 'tests.no_such_module'"),
    ("tests.helpers.custom_task:NOT_A_TASK", {}, "task", "is a int, not a megatron_rl.tasks.Task"),
    ("tests.helpers.custom_task:missing", {}, "task", "has no attribute 'missing'"),
    ("mcq", {"tests.helpers.custom_task:one_argument": 1.0}, "rewards.weights.tests.helpers.custom_task:one_argument",
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
    recipe = write_recipe(tmp_path, "rewards:\n  weights:\n    tests.helpers.custom_task:nope: 1.0\n")
    started = time.monotonic()
    proc = cli("train", str(recipe), f"logging.output_dir={tmp_path / 'runs'}", timeout=300)
    assert proc.returncode == 1
    assert "tests.helpers.custom_task:nope" in proc.stderr and "has no attribute 'nope'" in proc.stderr, proc.stderr
    assert not (tmp_path / "runs").exists()                  # no run dir: nothing was started
    assert "rollout server" not in proc.stdout + proc.stderr
    assert time.monotonic() - started < 120
