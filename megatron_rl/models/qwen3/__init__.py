"""Qwen3ForCausalLM (dense) and Qwen3MoeForCausalLM: one weight map (`weights.py`), two providers
(`provider.py`). Layer pattern: every layer is attention + MLP; the MLP is MoE where
`model_config.moe_layers` says so (`mlp_only_layers`, `decoder_sparse_step`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..model_spec import ModelSpec, PlannerShape, all_full_attention

if TYPE_CHECKING:
    import torch

    from ...config.schema import ParallelismConfig
    from ...megatron.gpt import ModelRecipe
    from ...weights.map import WeightAdapter


DENSE, MOE = "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"


def _build(architecture: str, hf: dict[str, Any], layout: ParallelismConfig, dtype: torch.dtype) -> ModelRecipe:
    from .provider import qwen3_dense, qwen3_moe  # megatron-core: imported only when a model is built

    return (qwen3_moe if architecture == MOE else qwen3_dense)(hf, layout, dtype)


def _weight_map(hf: dict[str, Any]) -> WeightAdapter:
    from .weights import qwen3_weight_map

    return qwen3_weight_map(hf)


SPEC = ModelSpec(
    name="qwen3",
    shapes={
        DENSE: PlannerShape(moe=False, hybrid=False, gated_attention=False, shared_expert=False),
        MOE: PlannerShape(moe=True, hybrid=False, gated_attention=False, shared_expert=False),
    },
    model_types={"qwen3": DENSE, "qwen3_moe": MOE},
    build=_build,
    weight_map=_weight_map,
    layer_types=all_full_attention,
)
