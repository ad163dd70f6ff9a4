"""The HF `config.json` of a recipe's model, as plain data (no transformers import).

Used by the lint rules (heads/experts/layers divisibility), the planner (parameter counts) and,
later, the Megatron model providers. A recipe names the architecture either by `model.hf_config`
(a directory or a config.json) or, for tiny CPU recipes, by `model.tiny` (the fields themselves).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .config.schema import ModelConfig


class ModelConfigError(ValueError):
    """The model's config.json is missing or unreadable."""


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """Read `path` (a model directory or its config.json)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise ModelConfigError(f"model config not found: {p}")
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ModelConfigError(f"{p}:{exc.lineno}: invalid JSON: {exc.msg}") from None
    if not isinstance(data, dict):
        raise ModelConfigError(f"{p}: a config.json must be a JSON object")
    return data


def resolve_hf_config(model: ModelConfig) -> dict[str, Any] | None:
    """The model's HF config: `model.tiny` if given, else `model.hf_config` read from disk.

    Returns None when the recipe names neither.
    """
    if model.tiny:
        return dict(model.tiny)
    if model.hf_config is None:
        return None
    return read_hf_config(model.hf_config)


def num_experts(hf: dict[str, Any]) -> int:
    """Routed experts per MoE layer (0 for dense models).

    Public Qwen3 configs say `num_experts`; transformers 5 writes `num_local_experts`.
    """
    return int(hf.get("num_experts") or hf.get("num_local_experts") or hf.get("n_routed_experts") or 0)


def rope_theta(hf: dict[str, Any], default: float = 1_000_000.0) -> float:
    """RoPE base: `rope_theta` (public configs) or `rope_parameters.rope_theta` (transformers 5)."""
    if "rope_theta" in hf:
        return float(hf["rope_theta"])
    return float((hf.get("rope_parameters") or {}).get("rope_theta", default))


def head_dim(hf: dict[str, Any]) -> int:
    return int(hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"])


MEGATRON_COMPLETE = "complete.json"      # = megatron.checkpoint.COMPLETE (not imported: that pulls megatron)
CONVERTED_HF_SUBDIR = "hf"               # = weights.convert_worker.HF_SUBDIR: config + tokenizer of a conversion


@dataclass(frozen=True)
class InitCheckpoint:
    """Where the policy's starting weights come from: an HF directory or a Megatron dist-checkpoint
    (e.g. the output of `megatron-rl convert hf-to-mcore`, saved at any parallel layout)."""

    path: str
    megatron: bool
    hf_dir: str
    """The HF config and tokenizer files: the HF checkpoint itself, a converted dist-checkpoint's
    `hf/` directory, or (for other dist-checkpoints) the directory of `model.hf_config`."""

    @property
    def server_args(self) -> list[str]:
        """vLLM cannot read a dist-checkpoint: it starts from random weights of the right shapes,
        and the trainer syncs its own before the first rollout (and after every restart)."""
        return ["--load-format", "dummy"] if self.megatron else []


def is_megatron_checkpoint(path: str | Path) -> bool:
    return (Path(path) / MEGATRON_COMPLETE).is_file()


def init_checkpoint(model: ModelConfig, path: str | None = None) -> InitCheckpoint:
    """`path` (default: `model.init_checkpoint`) as an HF directory or a Megatron dist-checkpoint."""
    path = path or model.init_checkpoint
    if not path:
        raise ModelConfigError("model.init_checkpoint is not set (an HF directory or a Megatron dist-checkpoint)")
    if not is_megatron_checkpoint(path):
        return InitCheckpoint(path, False, path)
    side = Path(path) / CONVERTED_HF_SUBDIR
    if (side / "config.json").is_file():
        return InitCheckpoint(path, True, str(side))
    if model.hf_config:
        hf = Path(model.hf_config)
        return InitCheckpoint(path, True, str(hf if hf.is_dir() else hf.parent))
    raise ModelConfigError(f"{path}: a Megatron dist-checkpoint without {CONVERTED_HF_SUBDIR}/config.json "
                           "(not written by `convert hf-to-mcore`); set model.hf_config and model.tokenizer")
