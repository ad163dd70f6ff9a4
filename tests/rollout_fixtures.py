"""Shared set-up for tests that need real rollout servers: demo assets and tiny models on disk."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path

import yaml

from megatron_rl.config.schema import RolloutConfig
from megatron_rl.demo.prepare import TOKENIZER_FILES, prepare_demo_assets
from megatron_rl.rollout.server import RolloutServer
from megatron_rl.weights.tiny import build_tiny_hf_checkpoint

REPO = Path(__file__).resolve().parents[1]
TINY_MOE = yaml.safe_load((REPO / "recipes/tiny/base.yaml").read_text())["model"]["tiny"]
TINY_DENSE = {k: v for k, v in TINY_MOE.items()
              if k not in ("num_experts", "num_experts_per_tok", "norm_topk_prob", "moe_intermediate_size")}
TINY_DENSE.update(architectures=["Qwen3ForCausalLM"], model_type="qwen3")


CACHE_ENV = "MEGATRON_RL_TEST_CACHE"
"""A writable directory for the demo assets (containers/selftest.py sets it inside the image)."""


def cache_dir(repo: Path = REPO, env: Mapping[str, str] = os.environ) -> Path:
    """$MEGATRON_RL_TEST_CACHE, else the repo's .cache when it can be written, else one under
    $TMPDIR: inside the image the repo is the read-only /opt/megatron-rl."""
    if env.get(CACHE_ENV):
        return Path(env[CACHE_ENV])
    try:
        (repo / ".cache").mkdir(exist_ok=True)
        with tempfile.TemporaryFile(dir=repo / ".cache"):
            return repo / ".cache"
    except OSError:
        return Path(env.get("TMPDIR") or tempfile.gettempdir()) / "megatron-rl-cache"


def demo_assets() -> dict[str, Path]:
    """The demo's cached assets (task data, tokenizer, warmed-up tiny MoE) under `cache_dir()`."""
    return prepare_demo_assets(cache_dir() / "demo", TINY_MOE)


def tiny_model_with_tokenizer(fields: dict, out: Path, seed: int = 0) -> Path:
    model = build_tiny_hf_checkpoint(fields, out, seed=seed)
    tok = demo_assets()["model"]
    for name in TOKENIZER_FILES:
        if (tok / name).is_file():
            shutil.copy2(tok / name, model / name)
    return model


def start_server(model: Path, run_dir: Path, **overrides: object) -> RolloutServer:
    cfg = RolloutConfig(enforce_eager=True, dtype="float32", max_concurrency=16, startup_timeout_s=300,
                        max_retries=6, **overrides)
    server = RolloutServer(str(model), run_dir, cfg, max_model_len=128)
    server.start()
    return server
