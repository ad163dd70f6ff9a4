"""Qwen3-Next's layer pattern: which token mixer each layer has (torch-free, for the planner too).

Whether a layer's MLP is MoE is `model_config.moe_layers`, shared with Qwen3-MoE.
"""

from __future__ import annotations

from typing import Any

ARCH = "Qwen3NextForCausalLM"
LINEAR, FULL = "linear_attention", "full_attention"


def layer_types(hf: dict[str, Any]) -> list[str]:
    """Per-layer token mixer. Released configs give `full_attention_interval` (every N-th layer is
    full attention); transformers 5 writes the expanded `layer_types`. Shared with the provider."""
    n = hf["num_hidden_layers"]
    types = hf.get("layer_types")
    if types is None:
        interval = int(hf["full_attention_interval"])
        types = [FULL if (i + 1) % interval == 0 else LINEAR for i in range(n)]
    if len(types) != n or set(types) - {LINEAR, FULL}:
        raise ValueError(f"{ARCH}: layer_types must be {n} of {LINEAR!r}/{FULL!r}, got {types}")
    return list(types)
