"""One folder per model architecture, each holding everything that architecture needs:

- `provider.py`: the Megatron-core model built from the HF config (registers with
  `megatron/providers.py`; imports megatron-core);
- `weights.py`: the HF ↔ Megatron weight map (registers with `weights/adapters.py`);
- `__init__.py`: torch-free facts: its layer pattern (Qwen3-Next: `layers.py`; which MLPs are MoE
  is `model_config.moe_layers` for every architecture) and `PLANNER_SHAPES`, what the planner's
  parameter and memory counts need to know about each architecture.

Adding a model is one folder plus one line in `MODELS` (see the README, "Adding a model").
Imports flow one way: a folder imports `megatron/`, `weights/adapters.py` and `model_config`, never
the reverse; those two registries reach a folder only through `load_model`
(tests/unit/test_import_direction.py).
"""

from __future__ import annotations

import importlib
from typing import Any

MODELS: dict[str, str] = {
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3",
    "Qwen3NextForCausalLM": "qwen3_next",
}
"""HF `architectures[0]` → its folder."""


def load_model(architecture: str, part: str) -> None:
    """Import `part` ("provider" or "weights") of the architecture's folder, which registers it.
    Unknown architectures are left to the registries, whose errors list what is supported."""
    folder = MODELS.get(architecture)
    if folder is not None:
        importlib.import_module(f"{__name__}.{folder}.{part}")


def planner_shapes() -> dict[str, dict[str, Any]]:
    """Every architecture's `PLANNER_SHAPES` entry (torch-free: the folders' `__init__` only)."""
    out: dict[str, dict[str, Any]] = {}
    for folder in dict.fromkeys(MODELS.values()):
        out.update(importlib.import_module(f"{__name__}.{folder}").PLANNER_SHAPES)
    return {arch: out[arch] for arch in MODELS}
