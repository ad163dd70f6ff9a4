"""Qwen3-Next (Qwen3NextForCausalLM) on megatron-core 0.19: hybrid Gated DeltaNet / gated attention.

The model is a GPTModel whose decoder block gets one layer spec per layer (a
`TransformerBlockSubmodules` list): Gated DeltaNet (GDN) layers where HF's `layer_types` says
"linear_attention", gated full attention (`attention_output_gate`) elsewhere, and MoE with a
sigmoid-gated shared expert. Megatron's own hybrid builder
(`get_transformer_block_with_experimental_attention_variant_spec`) asserts Transformer Engine, so the
local (CPU) block is assembled here from the same pieces: the local GPT layer spec for attention and
MLP, and GatedDeltaNet with plain ColumnParallel/RowParallel linears and a separate input norm in
place of TE's fused norm+linear. With TE and CUDA the official builder is used (not testable here).
QLoRA (`lora.base_quantization`) builds the local layers everywhere, with TE's norms and attention
where TE exists (`megatron/qlora_spec.py`): GDN's in_proj / out_proj are then plain linears too.

Not supported: multi-token prediction (the `mtp.*` tensors of the released checkpoints are not
loaded, as transformers does), THD packed sequences on CPU, context parallelism on CPU.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

import torch

from ...config.schema import ParallelismConfig
from ...megatron import cpu_compat
from ...megatron.gpt import ModelRecipe, common_config, model_recipe, moe_config, use_transformer_engine
from ...megatron.qlora_spec import qlora_block
from ...megatron.sections import GDN_SHARDED_KEYS, TP_SECTIONS_ATTR
from ...model_config import num_experts, rope_parameters
from .layers import ARCH, LINEAR, layer_types

cpu_compat.require_applied()   # megatron-core below is imported only after the CPU patches

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules  # noqa: E402
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear  # noqa: E402
from megatron.core.transformer import TransformerConfig  # noqa: E402
from megatron.core.transformer.spec_utils import ModuleSpec  # noqa: E402
from megatron.core.transformer.torch_norm import WrappedTorchNorm  # noqa: E402
from megatron.core.transformer.transformer_block import (  # noqa: E402
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset  # noqa: E402


def partial_rotary_factor(hf: dict[str, Any]) -> float:
    """Fraction of each head's dims that RoPE rotates (0.25 for every released Qwen3-Next)."""
    rope = rope_parameters(hf)
    if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
        raise NotImplementedError(f"{ARCH}: rope type {rope.get('rope_type')!r} is not supported")
    return float(rope.get("partial_rotary_factor", hf["partial_rotary_factor"]))


class Qwen3NextGatedDeltaNet(GatedDeltaNet):
    """GatedDeltaNet whose fused tensors name their sections, so weight sync can split them over TP.

    in_proj's rows are [q; k; v; z; beta; alpha] and conv1d's channels [q; k; v]; Megatron splits
    each section over TP separately, so a contiguous TP slice of the full tensor would be wrong.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        qk, v = self.qk_dim_local_tp, self.v_dim_local_tp
        setattr(self.in_proj.weight, TP_SECTIONS_ATTR, tuple(self.in_proj_split_sections))
        setattr(self.conv1d.weight, TP_SECTIONS_ATTR, (qk, qk, v))


class GatedOutputNorm(cpu_compat.LocalRMSNorm):
    """The RMSNorm inside GDN, before the SiLU(z) gate, zero-centred (x̂ · (1 + p)) like the model's
    other norms and like Megatron's TE spec (TENorm with `layernorm_zero_centered_gamma`), so the
    stored p is Megatron-Bridge's. HF's Qwen3NextRMSNormGated is plain-scale (x̂ · w, w init 1):
    the weight map converts w = 1 + p at the HF boundary (weights.py). Pure torch, so
    the TE spec uses it too (same parameter, same key).

    Its weight is shared by all value heads while each TP rank sees only its own heads, so the
    gradient is a sum over TP ranks: with sequence parallelism (which MoE + TP requires) the
    `sequence_parallel` tag makes Megatron all-reduce it.
    """

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__(hidden_size, eps, bool(config.sequence_parallel),
                         zero_centered=bool(config.layernorm_zero_centered_gamma), dtype=config.params_dtype)


def _local_gdn_spec() -> ModuleSpec:
    return ModuleSpec(
        module=Qwen3NextGatedDeltaNet,
        submodules=GatedDeltaNetSubmodules(in_proj=ColumnParallelLinear, out_norm=GatedOutputNorm,
                                           out_proj=RowParallelLinear),
        # TE fuses the input norm into in_proj (TELayerNormColumnParallelLinear); a plain linear
        # needs the layer's own input_layernorm.
        metainfo={"fuse_input_layernorm": False},
    )


def _local_layer_specs(config: TransformerConfig, types: list[str]) -> list[ModuleSpec]:
    """Every layer's spec from the local GPT layer spec, GDN swapped in for linear-attention layers."""
    experts = config.num_moe_experts
    moe = get_gpt_layer_local_spec(num_experts=experts, moe_grouped_gemm=False, qk_layernorm=True,
                                   normalization="RMSNorm")
    dense = get_gpt_layer_local_spec(num_experts=None, qk_layernorm=True, normalization="RMSNorm")
    # moe_layer_freq is model_config.moe_layers (megatron's own builder refuses GDN configs).
    freq = config.moe_layer_freq if isinstance(config.moe_layer_freq, list) else [1] * config.num_layers
    gdn = _local_gdn_spec()
    specs = []
    for i, kind in enumerate(types):
        base = moe if experts and freq[i] else dense
        sub = base.submodules
        if kind == LINEAR:
            # Checkpoint keys as under TE, where the input norm lives in GDN's fused in_proj.
            keys = dict(sub.sharded_state_dict_keys_map, **GDN_SHARDED_KEYS)
            sub = dataclasses.replace(sub, self_attention=gdn, sharded_state_dict_keys_map=keys)
        specs.append(ModuleSpec(module=base.module, submodules=sub))
    return specs


def _te_block_spec(config: TransformerConfig, vp_stage: int | None) -> TransformerBlockSubmodules:
    """Megatron's hybrid builder (TE only), with our GDN class and its HF-style output norm.

    Untested here (no GPU). Its parameter names differ from the local spec's where TE fuses the
    input norms into the next linear (`linear_qkv.layer_norm_weight`, `in_proj.layer_norm_weight`,
    `linear_fc1.layer_norm_weight`); `weights/sharding.py` maps them back to the local names.
    """
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        get_transformer_block_with_experimental_attention_variant_spec,
    )

    block = get_transformer_block_with_experimental_attention_variant_spec(config, vp_stage=vp_stage)
    for spec in block.layer_specs:
        attn = spec.submodules.self_attention
        if isinstance(attn, ModuleSpec) and attn.module is GatedDeltaNet:
            attn.module = Qwen3NextGatedDeltaNet
            attn.submodules.out_norm = GatedOutputNorm
    return block


def block_spec(config: TransformerConfig, types: list[str], vp_stage: int | None = None
               ) -> TransformerBlockSubmodules:
    """The layer specs of this rank's pipeline stage (parallel_state must be initialised)."""
    if use_transformer_engine():
        return _te_block_spec(config, vp_stage)
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    count = get_num_layers_to_build(config, vp_stage=vp_stage)
    layers = _local_layer_specs(config, types)[offset:offset + count]
    # Final norm: the same (zero-centred, via config) RMSNorm as the local GPT spec uses.
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=WrappedTorchNorm)


def qwen3_next_config(hf: dict[str, Any], layout: ParallelismConfig, dtype: torch.dtype) -> TransformerConfig:
    if hf["hidden_act"] != "silu" or hf["attention_bias"]:
        raise NotImplementedError(f"{ARCH}: only silu and bias-free attention are supported")
    types = layer_types(hf)
    fields = dict(
        **common_config(hf, layout, dtype),
        # Qwen3NextRMSNorm computes x̂ · (1 + w): the input, post-attention, q/k and final norms.
        layernorm_zero_centered_gamma=True,
        attention_output_gate=True,
        experimental_attention_variant="gated_delta_net",
        linear_attention_freq=[int(t == LINEAR) for t in types],
        linear_conv_kernel_dim=hf["linear_conv_kernel_dim"],
        linear_key_head_dim=hf["linear_key_head_dim"],
        linear_value_head_dim=hf["linear_value_head_dim"],
        linear_num_key_heads=hf["linear_num_key_heads"],
        linear_num_value_heads=hf["linear_num_value_heads"],
        # Without CUDA the FLA Triton kernels cannot run; deterministic mode selects megatron's torch
        # delta rule and F.conv1d (cpu_compat only lets GatedDeltaNet construct without FLA).
        deterministic_mode=cpu_compat.cuda_absent(),
    )
    if num_experts(hf):
        fields.update(moe_config(hf, layout))
        if hf["shared_expert_intermediate_size"]:
            fields.update(moe_shared_expert_intermediate_size=hf["shared_expert_intermediate_size"],
                          moe_shared_expert_gate=True)   # sigmoid(x · w_gate) scales the shared expert
    return TransformerConfig(**fields)


def qwen3_next(hf: dict[str, Any], layout: ParallelismConfig, dtype: torch.dtype) -> ModelRecipe:
    config = qwen3_next_config(hf, layout, dtype)
    types = layer_types(hf)
    recipe = model_recipe(hf, config, lambda vp_stage: block_spec(config, types, vp_stage))
    recipe.rotary_percent = partial_rotary_factor(hf)
    # QLoRA: the local layers (GDN's in_proj / out_proj plain linears, its own input norm) with TE's
    # norms and attention where TE exists; never megatron's hybrid builder, which is TE linears only.
    recipe.qlora_spec = lambda cfg: partial(qlora_block, cfg, _local_layer_specs(cfg, types))
    return recipe
