"""`train --resume` continues only the run dir's own experiment: another algorithm, init checkpoint,
task or data set is refused in one line naming the keys; how long, where and how it runs may change."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

from megatron_rl.config import load_recipe
from megatron_rl.config.loader import write_resolved
from megatron_rl.config.resume import MAY_CHANGE, experiment_differences, refusal
from tests.helpers.rollout import REPO, unit_paths
from tests.helpers.train import ENV

TINY = REPO / "recipes" / "tiny"


def _saved(recipe: str, *overrides: str) -> dict:
    """The recipe as a run dir holds it (its resolved YAML, read back)."""
    return yaml.safe_load(_text(load_recipe(TINY / recipe, list(overrides))))


def _text(cfg: object) -> str:
    from megatron_rl.config.loader import dump_yaml

    return dump_yaml(cfg)


def _keys(saved: dict, recipe: str, *overrides: str) -> list[str]:
    return [k for k, _, _ in experiment_differences(saved, load_recipe(TINY / recipe, list(overrides)))]


def test_the_same_recipe_and_the_keys_that_may_change_resume() -> None:
    saved = _saved("grpo.yaml")
    assert _keys(saved, "grpo.yaml") == []
    assert _keys(saved, "grpo.yaml", "trainer.max_steps=99", "logging.log_interval=5", "checkpoint.save_interval=3",
                 "slurm.partition=gpu", "parallelism.tensor_model_parallel_size=2", "rollout.port=8123",
                 "rollout.request_timeout_s=30", "evaluation.interval=7") == []


def test_another_algorithm_init_checkpoint_task_or_data_is_named() -> None:
    saved = _saved("grpo.yaml")
    keys = _keys(saved, "gspo.yaml")
    assert "algorithm.name" in keys and "algorithm.clip_eps_low" in keys
    assert not any(k.startswith(("trainer.max_steps", "logging.", "name")) for k in keys)   # may change
    assert _keys(saved, "grpo.yaml", "model.init_checkpoint=/elsewhere/ckpt") == ["model.init_checkpoint"]
    assert _keys(saved, "grpo.yaml", "task=igakuqa") == ["task"]
    assert _keys(saved, "grpo.yaml", "data.train_path=/elsewhere/train.jsonl") == ["data.train_path"]
    assert _keys(saved, "grpo.yaml", "rewards.weights={format: 0.5}") == ["rewards.weights"]
    assert _keys(saved, "grpo.yaml", "rollout.temperature=0.5", "trainer.lr=7.0e-4") == \
        ["rollout.temperature", "trainer.lr"]


def test_a_key_the_saved_recipe_lacks_counts_as_its_default() -> None:
    saved = _saved("grpo.yaml")
    del saved["algorithm"]["kl_clamp"]                       # a schema key added after the run started
    assert _keys(saved, "grpo.yaml") == []
    assert _keys(saved, "grpo.yaml", "algorithm.kl_clamp=3.0") == ["algorithm.kl_clamp"]
    saved["algorithm"]["gone_key"] = 1                       # removed since: ignored
    assert _keys(saved, "grpo.yaml") == []


def test_the_refusal_is_one_line_with_values_and_the_allowed_keys() -> None:
    line = refusal("runs/x", experiment_differences(_saved("grpo.yaml"), load_recipe(TINY / "gspo.yaml")))
    assert "\n" not in line and "algorithm.name (grpo -> gspo)" in line
    assert all(k in line for k in MAY_CHANGE) and "logging.run_name" in line


def test_train_resume_with_another_algorithm_exits_non_zero_naming_the_keys(tmp_path: Path) -> None:
    """Through the CLI, on a run dir GRPO started (its resolved recipe and a logged step)."""
    run = tmp_path / "article"
    common = [*unit_paths("grpo.yaml"), f"logging.output_dir={tmp_path}", "logging.run_name=article"]
    write_resolved(load_recipe(TINY / "grpo.yaml", common), run)
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\n")
    before = (run / "recipe.resolved.yaml").read_text()
    proc = subprocess.run([sys.executable, "-m", "megatron_rl.cli", "train", str(TINY / "gspo.yaml"), *common,
                           "--resume"],
                          cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "algorithm.name (grpo -> gspo)" in errors[0], proc.stderr[-3000:]
    assert (run / "recipe.resolved.yaml").read_text() == before      # the run dir is left as it was
    assert (run / "metrics.jsonl").is_file()


def test_every_key_that_may_change_is_a_recipe_key_or_section() -> None:
    from megatron_rl.config.loader import to_dict
    from megatron_rl.config.resume import flatten
    from megatron_rl.config.schema import RecipeConfig

    keys = set(flatten(to_dict(RecipeConfig())))
    assert [k for k in MAY_CHANGE if not any(x == k or x.startswith(k + ".") for x in keys)] == []


def test_the_trainer_itself_refuses_too_and_a_resume_changing_only_max_steps_goes_on(tmp_path: Path) -> None:
    """`train()` called without the CLI (its check runs on every rank, before anything is built)."""
    common = [*unit_paths("grpo.yaml"), f"logging.output_dir={tmp_path}", "logging.run_name=r"]
    write_resolved(load_recipe(TINY / "grpo.yaml", common), tmp_path / "r")
    (tmp_path / "r" / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\n")
    code = f"""
from megatron_rl.config import load_recipe
from megatron_rl.train.run import RunDir, Stop, init_process_group
init_process_group()
try:
    RunDir.make(load_recipe({str(TINY / "gspo.yaml")!r}, {common!r}), resume=True)
except Stop as e:
    print("REFUSED", e)
run = RunDir.make(load_recipe({str(TINY / "grpo.yaml")!r}, {common!r} + ["trainer.max_steps=99"]), resume=True)
print("RESUMED", run.path)
"""
    proc = subprocess.run([sys.executable, "-c", code], env=ENV, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "REFUSED" in proc.stdout and "algorithm.name (grpo -> gspo)" in proc.stdout
    assert f"RESUMED {tmp_path / 'r'}" in proc.stdout
    assert "max_steps: 99" in (tmp_path / "r" / "recipe.resolved.yaml").read_text()   # the new one, for the next resume
