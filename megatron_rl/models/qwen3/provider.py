"""Providers of Qwen3ForCausalLM (dense) and Qwen3MoeForCausalLM: the shared GPT configuration of
`megatron/gpt.py` with Megatron's GPT layer specs."""

from __future__ import annotations

from typing import Any

import torch

from ...config.schema import ParallelismConfig
from ...megatron import cpu_compat
from ...megatron.gpt import ModelRecipe, common_config, gpt_spec, model_recipe, moe_config, use_transformer_engine
from ...megatron.qlora_spec import gpt_qlora_spec
from ...model_config import moe_layers, num_experts

cpu_compat.require_applied()   # megatron-core below is imported only after the CPU patches

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec  # noqa: E402
from megatron.core.transformer import TransformerConfig  # noqa: E402


def qwen3_dense(hf: dict[str, Any], layout: ParallelismConfig, dtype: torch.dtype) -> ModelRecipe:
    config = TransformerConfig(**common_config(hf, layout, dtype))
    recipe = model_recipe(hf, config, gpt_spec(None))
    recipe.qlora_spec = gpt_qlora_spec
    return recipe


def qwen3_moe(hf: dict[str, Any], layout: ParallelismConfig, dtype: torch.dtype) -> ModelRecipe:
    config = TransformerConfig(**common_config(hf, layout, dtype), **moe_config(hf, layout))
    if all(moe_layers(hf)):
        recipe = model_recipe(hf, config, gpt_spec(num_experts(hf)))
    else:
        # Dense layers too (mlp_only_layers, decoder_sparse_step): one spec per layer, from
        # moe_layer_freq; a single layer spec would make megatron build every layer MoE.
        recipe = model_recipe(hf, config, lambda vp_stage: get_gpt_decoder_block_spec(
            config, use_transformer_engine(), normalization="RMSNorm", vp_stage=vp_stage))
    recipe.qlora_spec = gpt_qlora_spec
    return recipe

