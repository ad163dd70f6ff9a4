"""What a model folder exports: one `ModelSpec` (torchtitan's ModelSpec shape), torch-free.

Its callables import the folder's megatron-core and torch code only when called, so the planner,
the linter and `recipe validate` can read a spec (planner shape, layer pattern) without torch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from ..config.schema import ParallelismConfig
    from ..megatron.gpt import ModelRecipe
    from ..weights.map import WeightAdapter

HFConfig = dict[str, Any]
FULL_ATTENTION = "full_attention"


@dataclass(frozen=True, kw_only=True)
class PlannerShape:
    """What the planner's parameter and memory counts need to know about one architecture."""

    moe: bool
    hybrid: bool
    """Mixes Gated DeltaNet and full attention (the layer pattern says which layer is which)."""
    gated_attention: bool
    """q_proj also produces a per-head output gate (Qwen3-Next)."""
    shared_expert: bool


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """Everything the trainer, the converter and the planner need about one model folder."""

    name: str
    """The folder under `megatron_rl/models/`."""
    shapes: Mapping[str, PlannerShape]
    """HF `architectures[0]` → planner shape: the architectures this folder builds."""
    model_types: Mapping[str, str]
    """HF `model_type` → architecture, for configs that name no (known) architecture."""
    build: Callable[[str, HFConfig, ParallelismConfig, torch.dtype], ModelRecipe]
    """(architecture, hf with transformers' defaults, layout, dtype) → the Megatron model's recipe."""
    weight_map: Callable[[HFConfig], WeightAdapter]
    """hf with transformers' defaults → the HF ↔ Megatron weight map."""
    layer_types: Callable[[HFConfig], list[str]]
    """hf → each layer's token mixer ('full_attention' or 'linear_attention')."""


def all_full_attention(hf: HFConfig) -> list[str]:
    """The layer pattern of a model whose every layer is full attention."""
    return [FULL_ATTENTION] * int(hf["num_hidden_layers"])
