"""The HF `config.json` of a recipe's model, as plain data (no transformers import).

Used by the lint rules (heads/experts/layers divisibility), the planner (parameter counts) and,
later, the Megatron model providers. A recipe names the architecture either by `model.hf_config`
(a directory or a config.json) or, for tiny CPU recipes, by `model.tiny` (the fields themselves).
"""

from __future__ import annotations

import json
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
