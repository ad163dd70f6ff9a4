"""The building blocks of a Megatron-core GPTModel made from a Hugging Face `config.json`.

Each model folder's provider (`megatron_rl/models/<arch>/provider.py`, chosen by the model
registry `megatron_rl.models`) assembles its `ModelRecipe` from these: the TransformerConfig fields
the Qwen3 family shares (`common_config`, `moe_config`, `recompute_config`), the GPT layer spec
(`gpt_spec`) and `model_recipe`; `build_gpt_model` instantiates one pipeline stage.
Transformer-Engine specs are used when TE is importable and CUDA is present; otherwise the local
(pure-torch) spec, which runs on CPU once the entry point has called `cpu_compat.apply()`.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..config.schema import ParallelismConfig
from ..model_config import head_dim, moe_layers, num_experts, rope_theta
from . import cpu_compat

cpu_compat.require_applied()

from megatron.core import parallel_state  # noqa: E402  (after the CPU patches)
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.transformer import TransformerConfig  # noqa: E402
from megatron.core.transformer.spec_utils import ModuleSpec  # noqa: E402


def use_transformer_engine() -> bool:
    """TE specs need both the package and a GPU."""
    return torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None


@dataclass
class ModelRecipe:
    """Everything needed to instantiate the GPTModel of one pipeline stage."""

    config: TransformerConfig
    layer_spec: Any
    """A layer ModuleSpec, or a callable vp_stage → this stage's TransformerBlockSubmodules (hybrid
    models, whose per-layer specs must be sliced per pipeline stage once parallel_state exists)."""
    vocab_size: int
    max_sequence_length: int
    rotary_base: float
    tie_word_embeddings: bool
    rotary_percent: float = 1.0
    """Fraction of each head's dims rotated by RoPE (partial RoPE)."""
    qlora_spec: Any = None
    """The model's QLoRA spec (`qlora_spec.QloraSpec`: config → per-stage block builder), whose local
    linears can hold an NF4 base; the actor builds it for `lora.base_quantization` (None: none)."""


def common_config(hf: dict[str, Any], layout: ParallelismConfig, dtype: torch.dtype) -> dict[str, Any]:
    """TransformerConfig fields shared by the Qwen3 family; the recipe's own parallelism section is
    the layout the model is built for."""
    return dict(
        num_layers=hf["num_hidden_layers"],
        hidden_size=hf["hidden_size"],
        num_attention_heads=hf["num_attention_heads"],
        num_query_groups=hf["num_key_value_heads"],
        kv_channels=head_dim(hf),
        ffn_hidden_size=hf["intermediate_size"],
        normalization="RMSNorm",
        layernorm_epsilon=hf["rms_norm_eps"],
        qk_layernorm=True,
        add_bias_linear=False,
        add_qkv_bias=bool(hf["attention_bias"]),
        gated_linear_unit=True,
        activation_func=F.silu,
        # Fused SwiGLU and bias-dropout-add on GPU (TE); the rope, softmax, layer-norm and
        # wgrad-accumulation fusions need apex or shape checks this project has not run yet.
        bias_activation_fusion=use_transformer_engine(),
        masked_softmax_fusion=False,
        bias_dropout_fusion=use_transformer_engine(),
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        init_method_std=hf["initializer_range"],
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        pipeline_dtype=dtype,
        # Our losses are already divided by global denominators: Megatron must only sum.
        calculate_per_token_loss=True,
        # As Megatron-LM: free pipeline outputs once sent, and start backward in the C++ engine
        # (which also keeps cpu_compat's CUDA→CPU mode active while recompute re-runs forwards).
        deallocate_pipeline_outputs=True,
        # CHORD micro-batches carry different numbers of expert rows: pipeline stages exchange
        # shapes. megatron-core refuses this with the allgather dispatcher (lint: memory-options).
        variable_seq_lengths=layout.pipeline_model_parallel_size > 1,
        moe_token_dispatcher_type=layout.moe_token_dispatcher_type,
        use_cpu_initialization=not torch.cuda.is_available(),
        tensor_model_parallel_size=layout.tensor_model_parallel_size,
        pipeline_model_parallel_size=layout.pipeline_model_parallel_size,
        expert_model_parallel_size=layout.expert_model_parallel_size,
        expert_tensor_parallel_size=layout.expert_tp,
        sequence_parallel=layout.sequence_parallel,
        **recompute_config(layout),
    )


def recompute_config(layout: ParallelismConfig) -> dict[str, Any]:
    """Megatron's activation-recompute fields: method and layer count exist only for 'full'."""
    granularity = layout.recompute_granularity
    if granularity == "none":
        return dict(recompute_granularity=None)
    if granularity == "selective":
        return dict(recompute_granularity="selective")
    return dict(recompute_granularity="full", recompute_method=layout.recompute_method,
                recompute_num_layers=layout.recompute_num_layers)


def moe_config(hf: dict[str, Any], layout: ParallelismConfig) -> dict[str, Any]:
    freq = [int(moe) for moe in moe_layers(hf)]
    return dict(
        num_moe_experts=num_experts(hf),
        moe_ffn_hidden_size=hf["moe_intermediate_size"],
        moe_router_topk=hf["num_experts_per_tok"],
        moe_layer_freq=freq,
        moe_router_score_function="softmax",
        # HF: softmax over all experts, top-k, renormalise when norm_topk_prob. Megatron's
        # top-k-then-softmax equals that renormalised form; pre_softmax is the unnormalised one.
        moe_router_pre_softmax=not hf["norm_topk_prob"],
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_router_dtype="fp32",
        # TE's grouped GEMM on GPU (one kernel for a layer's local experts instead of a loop); its
        # `experts.linear_fc1.weight{i}` names are mapped in weights/sharding.py.
        moe_grouped_gemm=use_transformer_engine(),
        moe_permute_fusion=False,
    )


def gpt_spec(num_experts: int | None) -> Any:
    """Megatron's GPT layer spec: with Transformer Engine on a GPU, else the local one."""
    if use_transformer_engine():
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec(num_experts=num_experts, qk_layernorm=True,
                                                          moe_grouped_gemm=num_experts is not None)
    return get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False, qk_layernorm=True,
                                    normalization="RMSNorm")


def model_recipe(hf: dict[str, Any], config: TransformerConfig, spec: Any) -> ModelRecipe:
    """The recipe of `hf`'s model from its TransformerConfig and layer spec."""
    return ModelRecipe(
        config=config,
        layer_spec=spec,
        vocab_size=hf["vocab_size"],
        max_sequence_length=hf["max_position_embeddings"],
        rotary_base=rope_theta(hf),
        tie_word_embeddings=bool(hf["tie_word_embeddings"]),
    )


def build_gpt_model(recipe: ModelRecipe, vp_stage: int | None = None) -> GPTModel:
    """The GPTModel of this rank's pipeline stage (parallel_state must be initialised)."""
    pre = parallel_state.is_pipeline_first_stage(ignore_virtual=True)
    post = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
    # A provider may give a per-stage spec builder (hybrid layer patterns); a ModuleSpec is also
    # callable, so test for the builder explicitly.
    spec = recipe.layer_spec
    if callable(spec) and not isinstance(spec, ModuleSpec):
        spec = spec(vp_stage)
    return GPTModel(
        config=recipe.config,
        transformer_layer_spec=spec,
        vocab_size=recipe.vocab_size,
        max_sequence_length=recipe.max_sequence_length,
        pre_process=pre,
        post_process=post,
        parallel_output=True,
        share_embeddings_and_output_weights=recipe.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=recipe.rotary_base,
        rotary_percent=recipe.rotary_percent,
        vp_stage=vp_stage,
    )

