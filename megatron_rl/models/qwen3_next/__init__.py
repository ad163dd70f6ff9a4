"""Qwen3NextForCausalLM: Gated DeltaNet / gated attention hybrid (`layers.py` says which layer is
which), MoE with a sigmoid-gated shared expert. `provider.py` builds it, `weights.py` maps it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..model_spec import ModelSpec, PlannerShape
from .layers import ARCH, layer_types

if TYPE_CHECKING:
    import torch

    from ...config.schema import ParallelismConfig
    from ...megatron.gpt import ModelRecipe
    from ...weights.map import WeightAdapter


def _build(architecture: str, hf: dict[str, Any], layout: ParallelismConfig, dtype: torch.dtype) -> ModelRecipe:
    from .provider import qwen3_next  # megatron-core: imported only when a model is built

    return qwen3_next(hf, layout, dtype)


def _weight_map(hf: dict[str, Any]) -> WeightAdapter:
    from .weights import qwen3_next_weight_map

    return qwen3_next_weight_map(hf)


SPEC = ModelSpec(
    name="qwen3_next",
    shapes={ARCH: PlannerShape(moe=True, hybrid=True, gated_attention=True, shared_expert=True)},
    model_types={"qwen3_next": ARCH},
    build=_build,
    weight_map=_weight_map,
    layer_types=layer_types,
)
