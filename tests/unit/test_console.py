"""A readable console: known third-party warnings are filtered at our entry points (ours still
show), one start-up summary, and step lines with a progress bar and an ETA."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from megatron_rl.console import KNOWN_LOG_LINES, Progress, known_noise, quiet_third_party
from tests.helpers.console import console_lines, third_party_lines, user_env
from tests.helpers.rollout import REPO


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


BUILD = """
import sys, yaml
from pathlib import Path
from megatron_rl.demo.prepare import prepare_demo_assets

from megatron_rl.console import quiet_third_party
quiet_third_party()                               # what cli.main() does first
fields = yaml.safe_load(Path("recipes/tiny/base.yaml").read_text())["model"]["tiny"]
prepare_demo_assets(Path(sys.argv[1]), fields, warmup_steps=int(sys.argv[2]))
"""


def test_building_the_demo_assets_prints_only_our_lines(tmp_path: Path) -> None:
    """A fresh clone's `make demo` starts by building its assets: torchao (imported by transformers'
    quantizer table) fails to load its CUDA kernels and torch logs a deprecation for it, and
    transformers draws bars while writing and loading the tiny model. None of it reaches a person;
    our own `[demo]` lines do. (The warm-up is cut to one step here; it loads and saves the same.)"""
    proc = subprocess.run([sys.executable, "-c", BUILD, str(tmp_path / "demo"), "1"], cwd=REPO,
                          capture_output=True, text=True, timeout=600, env=user_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = console_lines(proc.stdout + proc.stderr)
    assert third_party_lines(lines) == {}
    ours = [line for line in lines if line.startswith("[demo] ")]
    assert len(ours) == 2 and ours == [line for line in lines if line.strip()], lines
    assert (tmp_path / "demo" / "model" / "model.safetensors").is_file()


def test_a_person_can_keep_the_progress_bars(monkeypatch: pytest.MonkeyPatch) -> None:
    """HF_HUB_DISABLE_PROGRESS_BARS=0, set by the person, wins over our default; unset, the bars go."""
    from transformers.utils import logging as hf_logging

    hf_logging.enable_progress_bar()
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "0")
    quiet_third_party()
    assert hf_logging.is_progress_bar_enabled()
    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS")
    quiet_third_party()
    assert not hf_logging.is_progress_bar_enabled()
    assert os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1"       # inherited by the processes we start
