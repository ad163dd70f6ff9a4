"""The shipped tiny GSPO recipe learns within its own `trainer.max_steps` (nothing overridden but
where the run goes): the mean reward of its last 10 steps beats that of its first 10."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.helpers.rollout import REPO
from tests.helpers.servers import train_env


def test_tiny_gspo_learns_within_its_shipped_steps(tmp_path: Path, demo_servers_dir: Path) -> None:
    cmd = [sys.executable, "-m", "megatron_rl.cli", "train", str(REPO / "recipes" / "tiny" / "gspo.yaml"),
           f"logging.output_dir={tmp_path}", "logging.run_name=gspo", "checkpoint.export_hf=false"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1800,
                          env=train_env(demo_servers_dir))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "gspo" / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward/mean"] for r in rows]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    print(f"tiny GSPO, {len(rows)} steps: reward first 10 {first:.3f} -> last 10 {last:.3f}")
    assert len(rows) >= 40 and last > first + 0.05, (first, last)
