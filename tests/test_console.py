"""A readable console: known third-party warnings are filtered at our entry points (ours still
show), one start-up summary, and step lines with a progress bar and an ETA."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from megatron_rl.console import KNOWN_LOG_LINES, Progress, known_noise, quiet_third_party
from tests.rollout_fixtures import REPO, demo_assets

SMALL = ["trainer.global_batch_size=16", "rollout.n=4", "trainer.micro_batch_size=4", "rollout.max_concurrency=1"]
WARNING_LINE = re.compile(r"\b\w*Warning\b|DEPRECATED|deprecated")


def _emitted(message: str, category: type[Warning], module: str) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_third_party()
        warnings.warn_explicit(message, category, f"{module.replace('.', '/')}.py", 1, module=module)
    return [str(w.message) for w in caught]


def test_known_third_party_warnings_are_hidden_and_ours_are_not() -> None:
    te = "Transformer Engine and Apex are not installed. Falling back to Torch optimizers."
    assert _emitted(te, UserWarning, "megatron.core.optimizer") == []
    collective = "`torch.distributed.reduce_scatter_tensor` is deprecated. Please use ..."
    assert _emitted(collective, FutureWarning, "torch.distributed.c10d_logger") == []
    # The same text from our own code, or another category, still shows.
    assert _emitted(te, UserWarning, "megatron_rl.megatron.actor") == [te]
    assert _emitted(collective, UserWarning, "torch.distributed.c10d_logger") == [collective]
    assert _emitted("something else", UserWarning, "megatron.core.optimizer") == ["something else"]


def test_known_megatron_log_lines_are_dropped_and_others_pass(caplog: pytest.LogCaptureFixture) -> None:
    quiet_third_party()
    name, prefix = KNOWN_LOG_LINES[0]
    with caplog.at_level(logging.WARNING, logger=name):
        logging.getLogger(name).warning(prefix + " and the rest of it")
        logging.getLogger(name).warning("a real problem")
    assert [r.getMessage() for r in caplog.records] == ["a real problem"]


def test_progress_bar_and_eta() -> None:
    p = Progress(first=1, total=10, width=10, started=100.0)
    assert p.line(1, now=106.0) == "[#.........] 1/10 0:06 < 0:54"
    assert p.line(10, now=160.0) == "[##########] 10/10 1:00 < 0:00"
    # A resumed run estimates from the steps it ran itself.
    resumed = Progress(first=6, total=10, width=10, started=0.0001)
    assert resumed.line(7, now=20.0001).endswith("7/10 0:20 < 0:30")


def test_known_noise_matches_the_lines_megatron_prints() -> None:
    assert known_noise("/x/megatron/core/models/backends.py:34: UserWarning: Apex is not installed. Falling back")
    assert known_noise("GPTModel IS DEPRECATED. GPTModel is only accepting critical bug fixes")
    assert not known_noise("step 1/2 | reward 0.5")


@pytest.mark.slow
def test_demo_console_has_no_warning_lines(tmp_path: Path) -> None:
    """`megatron-rl demo` for 2 steps: a summary, two step lines, the table; no warning at all."""
    demo_assets()
    proc = subprocess.run([sys.executable, "-m", "megatron_rl.cli", "demo", *SMALL, "trainer.max_steps=2",
                           f"logging.output_dir={tmp_path}"], cwd=REPO, capture_output=True, text=True,
                          timeout=900, env=dict(os.environ, OMP_NUM_THREADS="1"))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    lines = out.splitlines()
    assert [line for line in lines if known_noise(line)] == []
    assert [line for line in lines if WARNING_LINE.search(line)] == []
    assert sum(line == "megatron-rl train" for line in lines) == 1
    for key in ("model", "layout", "task", "server", "run dir"):
        assert any(line.startswith(f"  {key} ") for line in lines), key
    steps = [line for line in lines if re.match(r"\[[#.]{20}\] [12]/2 \d+:\d\d < \d+:\d\d \| reward ", line)]
    assert len(steps) == 2, out[-3000:]
    assert "| metric | start | end |" in out
