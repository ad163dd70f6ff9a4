"""A run that stops learning says so and stops (`train/health.py`): the tiny GRPO at 20× its
learning rate collapses within a few steps (reward 0, format 0, every group flat, no gradient,
every answer at the length cap); the run checkpoints, prints one line naming the signals and the
step the collapse began, and exits 1, so a Slurm job is not requeued into more dead steps."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from megatron_rl.config import load_recipe
from tests.helpers.rollout import REPO
from tests.helpers.servers import train_env

RECIPE = REPO / "recipes" / "tiny" / "grpo.yaml"
STREAK = 2
"""`trainer.stop_when_collapsed` here: the fewest steps that are still a streak."""
MAX_STEPS = 10


def test_a_collapsing_run_is_stopped_with_one_line_a_checkpoint_and_exit_1(tmp_path: Path,
                                                                           demo_servers_dir: Path) -> None:
    lr = 20 * load_recipe(RECIPE).trainer.lr
    cmd = [sys.executable, "-m", "megatron_rl.cli", "train", str(RECIPE), f"trainer.lr={lr}",
           f"trainer.max_steps={MAX_STEPS}", f"trainer.stop_when_collapsed={STREAK}", "evaluation.interval=0",
           f"logging.output_dir={tmp_path}", "logging.run_name=dead"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1200,
                          env=train_env(demo_servers_dir))
    tail = (proc.stdout + proc.stderr)[-3000:]
    assert proc.returncode == 1, tail
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, tail
    run = tmp_path / "dead"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    last = rows[-1]["step"]
    assert last < MAX_STEPS, "the run went on to its last step"
    began = last - STREAK + 1
    assert [r["health/collapsed"] for r in rows[-STREAK:]] == [1.0] * STREAK
    assert rows[-1]["health/collapsed_steps"] == STREAK
    tripped = [s for s in ("reward", "format_rate", "flat_groups", "grad_norm", "entropy", "mismatch", "length_at_cap")
               if rows[-1][f"health/{s}"]]
    assert errors[0].startswith(f"error: the run collapsed at step {began}: {', '.join(tripped)} tripped on "
                                f"{STREAK} steps in a row (trainer.stop_when_collapsed {STREAK})"), errors[0]
    assert errors[0].endswith(f"; checkpointed step {last}"), errors[0]
    print(f"lr {lr:g}: {errors[0]}")
    # Warned on the console before it stopped; the dead model is checkpointed, not exported.
    assert "[health] warning at step" in proc.stdout and "health COLLAPSED" in proc.stdout, tail
    assert (run / "checkpoints" / f"step_{last:08d}" / "complete.json").is_file()
    assert not (run / "hf_export").exists()
