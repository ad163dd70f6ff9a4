"""A readable console: known third-party warnings are filtered at our entry points (ours still
show), one start-up summary, and step lines with a progress bar and an ETA. (Building the demo's
assets from an empty cache, the rest of a fresh clone's console: tests/unit/test_console.py.)"""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from megatron_rl.console import known_noise
from tests.helpers.console import console_lines, third_party_lines, user_env
from tests.helpers.rollout import REPO, demo_assets
from tests.helpers.train import SMALL


def test_demo_console_has_no_third_party_lines(tmp_path: Path) -> None:
    """`megatron-rl demo` for 2 steps: a summary, two step lines, the table; not one third-party line."""
    demo_assets()
    proc = subprocess.run([sys.executable, "-m", "megatron_rl.cli", "demo", *SMALL, "trainer.max_steps=2",
                           f"logging.output_dir={tmp_path}"], cwd=REPO, capture_output=True, text=True, timeout=900,
                          env=user_env())
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    lines = console_lines(out)
    assert [line for line in lines if known_noise(line)] == []
    assert third_party_lines(lines) == {}
    assert sum(line == "megatron-rl train" for line in lines) == 1
    for key in ("model", "layout", "task", "server", "run dir"):
        assert any(line.startswith(f"  {key} ") for line in lines), key
    steps = [line for line in lines if re.match(r"\[[#.]{20}\] [12]/2 \d+:\d\d < \d+:\d\d \| reward ", line)]
    assert len(steps) == 2, out[-3000:]
    assert "| metric | start | end |" in out
