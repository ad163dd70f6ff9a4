"""Running the trainer CLI from tests: commands, the small-batch overrides, metrics."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.helpers.rollout import REPO
from tests.helpers.servers import train_env

SMALL = ["trainer.global_batch_size=16", "rollout.n=4", "trainer.micro_batch_size=4", "rollout.max_concurrency=1"]


def train_cmd(recipe: str, out: Path, name: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "megatron_rl.cli", "train", str(REPO / "recipes" / "tiny" / recipe), *SMALL,
            f"logging.output_dir={out}", f"logging.run_name={name}", *extra]


def run_train(recipe: str, out: Path, name: str, *extra: str, servers: Path | None = None) -> Path:
    """One trainer run to completion; with `servers`, attached to the servers there (the shared
    one, `tests/helpers/servers.py`) instead of starting its own."""
    env = train_env(servers) if servers is not None else dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(train_cmd(recipe, out, name, *extra), cwd=REPO, capture_output=True, text=True,
                          timeout=900, env=env)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return out / name


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))


TINY = REPO / "recipes" / "tiny" / "grpo.yaml"


def write_recipe(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(f"defaults: {TINY}\n{body}")
    return path


def cli(*args: str, env: dict[str, str] | None = None, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megatron_rl.cli", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})))
