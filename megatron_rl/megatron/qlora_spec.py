"""QLoRA's model spec: megatron-core's local linears, which can hold an NF4 base, with Transformer
Engine's norms and flash attention where TE exists.

`lora.base_quantization: nf4` makes the actor build its model from this spec (`for_quantized_base`)
instead of the provider's usual one. The TE spec cannot hold an NF4 base: its linears keep their
weights inside TE's kernels (`TELayerNormColumnParallelLinear` fuses the input norm into linear_qkv
and fc1, `TEGroupedMLP` runs a layer's experts as one grouped GEMM), and `quantize.py` refuses them.
This spec is the local spec's layout with two kinds of pieces swapped:

- kept: linear_qkv, linear_proj, the dense and shared-expert MLPs, Gated DeltaNet's in/out
  projections as megatron-core's `ColumnParallelLinear` / `RowParallelLinear` (whose `_forward_impl`
  `quantize.py` replaces by its NF4 matmul); routed experts as `SequentialMLP` over such linears
  (per-expert modules for LoRA's `experts` target; one expert's weight dequantized at a time);
  the separate input / pre-MLP norms, so parameter and checkpoint names are the local spec's;
- swapped, with TE importable and CUDA present (`qlora_pieces(te=True)`): every norm is `TENorm`
  (TE's RMSNorm, which tags its weight `sequence_parallel`: SP works) and core attention is
  `TEDotProductAttention` (no parameters; TE's flash / fused attention, so no s² scores are stored);
- without TE (the CPU, a bare GPU machine): the project's `LocalRMSNorm` — never megatron's
  `WrappedTorchNorm`, which asserts against sequence parallelism and zero-centred gamma
  (`megatron/core/transformer/torch_norm.py:44-50`) — and megatron's `DotProductAttention`.

So the CPU tests build this spec minus the TE pieces: the GPU code path but for the kernels.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from . import cpu_compat
from .gpt import ModelRecipe, use_transformer_engine
from .quantize import QuantizationError

cpu_compat.require_applied()

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.transformer import TransformerConfig  # noqa: E402
from megatron.core.transformer.attention import SelfAttentionSubmodules  # noqa: E402
from megatron.core.transformer.dot_product_attention import DotProductAttention  # noqa: E402
from megatron.core.transformer.spec_utils import ModuleSpec  # noqa: E402
from megatron.core.transformer.torch_norm import WrappedTorchNorm  # noqa: E402
from megatron.core.transformer.transformer_block import (  # noqa: E402
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset  # noqa: E402

QloraSpec = Callable[[TransformerConfig], Callable[[int | None], TransformerBlockSubmodules]]
"""What a provider stores as `ModelRecipe.qlora_spec`: the model's config → its per-stage block
builder (vp_stage → this stage's layer specs and final norm)."""


@dataclass(frozen=True)
class QloraPieces:
    """The modules the QLoRA spec takes from TE (or their local stand-ins)."""

    te: bool
    norm: Any
    """A LayerNormBuilder: called with config=, hidden_size=, eps= (`torch_norm.py:19-24`)."""
    core_attention: type


def qlora_pieces(te: bool) -> QloraPieces:
    """The norm and core attention of the QLoRA spec, given whether TE can be used (CUDA and the
    package: `gpt.use_transformer_engine`)."""
    if te:
        # Importable without TE too (megatron-core replaces `te` by a MagicMock,
        # extensions/transformer_engine.py:69-85); constructing them then raises ImportError.
        from megatron.core.extensions.transformer_engine import TEDotProductAttention, TENorm

        return QloraPieces(True, TENorm, TEDotProductAttention)
    return QloraPieces(False, local_rms_norm, DotProductAttention)


def init_device(config: TransformerConfig) -> torch.device:
    """Where megatron-core's own linears allocate their weights: the CPU with
    `use_cpu_initialization`, else the current CUDA device (`tensor_parallel/layers.py:972-1000`,
    `1334-1363`), as TE's modules do (`extensions/transformer_engine.py:403-414`)."""
    if config.use_cpu_initialization:
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def local_rms_norm(config: TransformerConfig, hidden_size: int, eps: float = 1e-5) -> torch.nn.Module:
    """The project's RMSNorm (`cpu_compat.LocalRMSNorm`: zero-centred gamma; under sequence
    parallelism its weight is tagged so megatron all-reduces its gradient over TP) on the device the
    linears use. On the CPU this is the module the patched `WrappedTorchNorm` returns."""
    if config.normalization != "RMSNorm":
        raise QuantizationError(f"the QLoRA spec's local norm is an RMSNorm, not {config.normalization}")
    with init_device(config):
        return cpu_compat.LocalRMSNorm(hidden_size, eps, bool(config.sequence_parallel),
                                       bool(config.layernorm_zero_centered_gamma), config.params_dtype)


def _norm(builder: Any, pieces: QloraPieces) -> Any:
    """The QLoRA norm in place of the local spec's (`WrappedTorchNorm`: `LocalSpecProvider.layer_norm`
    returns it for RMSNorm, `backends.py:118-127`); IdentityOp and the like stay."""
    return pieces.norm if builder is WrappedTorchNorm else builder


def qlora_layer(spec: ModuleSpec, pieces: QloraPieces) -> ModuleSpec:
    """A local TransformerLayer spec with its norms and (self-attention's) core attention replaced
    by `pieces`; its linears, MLP / MoE, Gated DeltaNet and checkpoint key map kept."""
    sub = spec.submodules
    changes: dict[str, Any] = {f: _norm(getattr(sub, f), pieces)
                               for f in ("input_layernorm", "pre_mlp_layernorm")}
    attn = sub.self_attention
    if isinstance(attn, ModuleSpec) and isinstance(attn.submodules, SelfAttentionSubmodules):
        a = attn.submodules
        inner = dataclasses.replace(a, core_attention=pieces.core_attention,
                                    q_layernorm=_norm(a.q_layernorm, pieces),
                                    k_layernorm=_norm(a.k_layernorm, pieces))
        changes["self_attention"] = dataclasses.replace(attn, submodules=inner)
    return dataclasses.replace(spec, submodules=dataclasses.replace(sub, **changes))


def qlora_block(config: TransformerConfig, layers: Sequence[ModuleSpec], vp_stage: int | None = None,
                te: bool | None = None) -> TransformerBlockSubmodules:
    """This pipeline stage's layers of the full model's local `layers`, with the QLoRA pieces, and
    the final norm (a block spec, not a layer spec: megatron would otherwise pick the final norm
    itself, WrappedTorchNorm without TE, `transformer_block.py:53-64,250-254`). `te` None: TE
    when it can be used."""
    pieces = qlora_pieces(use_transformer_engine() if te is None else te)
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    count = get_num_layers_to_build(config, vp_stage=vp_stage)
    return TransformerBlockSubmodules(layer_specs=[qlora_layer(s, pieces) for s in layers[offset:offset + count]],
                                      layer_norm=pieces.norm)


def gpt_local_layers(config: TransformerConfig) -> list[ModuleSpec]:
    """Every layer's local spec of a GPT model (Qwen3 dense / MoE): MoE where `moe_layer_freq`
    says so, parsed as `get_gpt_decoder_layer_specs` does (`gpt_layer_specs.py:643-661`); the
    experts are SequentialMLP whatever the config's `moe_grouped_gemm` (`backends.py:133-142`)."""
    dense = get_gpt_layer_local_spec(num_experts=None, qk_layernorm=config.qk_layernorm,
                                     normalization=config.normalization)
    experts = config.num_moe_experts
    if not experts:
        return [dense] * config.num_layers
    moe = get_gpt_layer_local_spec(num_experts=experts, moe_grouped_gemm=False, qk_layernorm=config.qk_layernorm,
                                   normalization=config.normalization)
    freq = config.moe_layer_freq
    pattern = freq if isinstance(freq, list) else [int(i % freq == 0) for i in range(config.num_layers)]
    return [moe if pattern[i] else dense for i in range(config.num_layers)]


def gpt_qlora_spec(config: TransformerConfig) -> Callable[[int | None], TransformerBlockSubmodules]:
    """The QLoRA spec of a GPT model (a `QloraSpec`)."""
    return partial(qlora_block, config, gpt_local_layers(config))


def for_quantized_base(recipe: ModelRecipe) -> ModelRecipe:
    """The same model built from its QLoRA spec: the actor's model when `lora.base_quantization`
    is set. The config loses only `moe_grouped_gemm` (the experts are per-expert local MLPs)."""
    if recipe.qlora_spec is None:
        raise QuantizationError("this architecture has no QLoRA spec (megatron/qlora_spec.py): its model "
                                "holds Transformer-Engine linears, which cannot hold an NF4 base")
    config = dataclasses.replace(recipe.config, moe_grouped_gemm=False)
    return dataclasses.replace(recipe, config=config, layer_spec=recipe.qlora_spec(config), qlora_spec=None)
