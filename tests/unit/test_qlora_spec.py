"""QLoRA's model spec (megatron/qlora_spec.py) on real megatron-core, one rank on gloo: the CPU
builds it minus the TE pieces, so this runs the GPU code path for everything but the kernels.

- the choice: TE's norm and flash attention where TE can be used, the local ones elsewhere; never a
  TE linear, a grouped GEMM or megatron's WrappedTorchNorm, for every registered architecture;
- the actor builds it for `lora.base_quantization: nf4`, and the NF4 base lives in its local linears;
- forward and adapter gradients against a float64 model holding the dequantized weights;
- the first QLoRA sync sends the dequantized base with the adapters merged in.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Iterator
from functools import partial
from typing import Any

import pytest
import torch
import torch.distributed as dist

from megatron_rl.megatron import cpu_compat

cpu_compat.apply()

from megatron.core.extensions.transformer_engine import TEDotProductAttention, TENorm  # noqa: E402
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear  # noqa: E402
from megatron.core.transformer.dot_product_attention import DotProductAttention  # noqa: E402
from megatron.core.transformer.moe.experts import SequentialMLP  # noqa: E402
from megatron.core.transformer.spec_utils import ModuleSpec  # noqa: E402
from megatron.core.transformer.torch_norm import WrappedTorchNorm  # noqa: E402

from megatron_rl.config.schema import ParallelismConfig  # noqa: E402
from megatron_rl.megatron.actor import Actor, init_parallel  # noqa: E402
from megatron_rl.megatron.devices import init_distributed  # noqa: E402
from megatron_rl.megatron.qlora_spec import for_quantized_base, local_rms_norm, qlora_pieces  # noqa: E402
from megatron_rl.megatron.quantize import QuantizationError  # noqa: E402
from megatron_rl.megatron.sections import TP_SECTIONS_ATTR  # noqa: E402
from megatron_rl.models import MODELS, build_model  # noqa: E402
from tests.helpers import qlora  # noqa: E402
from tests.helpers.models import TINY_DENSE, TINY_MOE, TINY_QWEN3_NEXT  # noqa: E402

CPU = torch.device("cpu")
MODELS_BY_ARCH = {m["architectures"][0]: m for m in (TINY_DENSE, TINY_MOE, TINY_QWEN3_NEXT)}
# fp32 against float64 on the same (dequantized) weights: fp32 round-off through two layers, ~1e-7
# of the logits' spread measured; a wrong block scale, transposed or lost weight moves them by O(1).
FP32_LOGIT_REL_ATOL = 1e-5
FP32_GRAD_REL = 1e-4
SYNC_REL = 1e-6          # fp32 W + ΔW against float64: one rounding of each term


@pytest.fixture(scope="module", autouse=True)
def one_rank() -> Iterator[None]:
    torch.set_num_threads(1)
    init_distributed(store=dist.HashStore())
    init_parallel(ParallelismConfig(), seed=3)
    yield
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    dist.destroy_process_group()


def _classes(obj: Any, seen: set[int] | None = None) -> Iterator[Any]:
    """Every class or function a spec names (ModuleSpecs, submodule dataclasses, partial builders)."""
    seen = set() if seen is None else seen
    if id(obj) in seen or obj is None:
        return
    seen.add(id(obj))
    if isinstance(obj, ModuleSpec):
        yield obj.module
        yield from _classes(obj.submodules, seen)
    elif isinstance(obj, partial):
        yield getattr(obj.func, "__self__", obj.func)       # MLP.as_mlp_submodule → MLP
        for value in [*obj.args, *obj.keywords.values()]:
            yield from _classes(value, seen)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from _classes(getattr(obj, f.name), seen)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _classes(value, seen)
    elif inspect.isclass(obj) or callable(obj):
        yield obj


def test_the_pieces_are_te_exactly_where_te_can_be_used() -> None:
    te, local = qlora_pieces(True), qlora_pieces(False)
    assert (te.te, te.norm, te.core_attention) == (True, TENorm, TEDotProductAttention)
    assert (local.te, local.norm, local.core_attention) == (False, local_rms_norm, DotProductAttention)


@pytest.mark.parametrize("te", [True, False], ids=["te", "local"])
@pytest.mark.parametrize("arch", sorted(MODELS_BY_ARCH))
def test_every_architecture_has_a_qlora_spec_of_local_linears(arch: str, te: bool) -> None:
    assert set(MODELS_BY_ARCH) == set(MODELS.names())           # a new architecture needs its QLoRA spec here
    hf = MODELS_BY_ARCH[arch]
    block = qlora.qlora_recipe(hf, torch.float32, te=te).layer_spec(None)
    assert len(block.layer_specs) == hf["num_hidden_layers"] and block.layer_norm is qlora_pieces(te).norm
    named = set(_classes(block.layer_specs)) | {block.layer_norm}
    assert {ColumnParallelLinear, RowParallelLinear} <= named
    assert WrappedTorchNorm not in named                  # it asserts against SP on a GPU
    # Without TE, megatron's TE classes are MagicMock-derived stand-ins: compare by identity.
    pieces = {TENorm, TEDotProductAttention}
    assert named & pieces == (pieces if te else set())
    other_te = {c for c in named - pieces if getattr(c, "__name__", "").startswith("TE")}
    assert other_te == set(), other_te
    assert (SequentialMLP in named) == bool(hf.get("num_experts"))
    assert not any("Grouped" in getattr(c, "__name__", "") for c in named)


def test_a_recipe_without_a_qlora_spec_is_refused() -> None:
    built = build_model(dict(TINY_MOE), ParallelismConfig(), torch.float32)
    recipe = dataclasses.replace(built, qlora_spec=None)
    with pytest.raises(QuantizationError, match="no QLoRA spec"):
        for_quantized_base(recipe)


@pytest.mark.parametrize("arch", sorted(MODELS_BY_ARCH))
def test_the_actor_builds_the_qlora_spec_with_the_nf4_base_in_its_local_linears(arch: str) -> None:
    hf = MODELS_BY_ARCH[arch]
    recipe = build_model(dict(hf), ParallelismConfig(), torch.float32)
    actor = Actor(recipe, 1, None, lora=qlora.LORA)
    assert actor.config.moe_grouped_gemm is False and actor.recipe.qlora_spec is None
    holders = qlora.nf4_holders(actor.model)
    assert holders and set(holders.values()) <= set(qlora.LOCAL_LINEARS), holders
    assert sorted(holders) == sorted(actor.quantization.quantized)
    assert qlora.te_classes(actor.model) == []            # the CPU: no TE pieces
    layers = actor.model.decoder.layers
    for i, layer in enumerate(layers):
        kinds = {n.rsplit(".", 1)[-1] for n in holders if n.startswith(f"decoder.layers.{i}.")}
        attention = hasattr(layer.self_attention, "linear_qkv")
        mixer = {"linear_qkv", "linear_proj"} if attention else {"in_proj", "out_proj"}   # GDN: in/out_proj
        assert mixer | {"linear_fc1", "linear_fc2"} == kinds, (i, kinds)
        if not attention:    # the NF4 in_proj keeps its per-section TP tag (the HF load shards by it)
            gdn = layer.self_attention
            sections = getattr(gdn.in_proj.weight, TP_SECTIONS_ATTR)
            assert sections == tuple(gdn.in_proj_split_sections), sections
        assert type(layer.input_layernorm) is cpu_compat.LocalRMSNorm
    experts = hf.get("num_experts", 0)
    expert_holders = [n for n in holders if ".local_experts." in n]
    moe_layers = sum(1 for layer in layers if hasattr(layer.mlp, "experts"))
    assert len(expert_holders) == 2 * experts * moe_layers


@pytest.mark.parametrize("arch", ["Qwen3MoeForCausalLM", "Qwen3NextForCausalLM"])
def test_forward_and_adapter_grads_match_a_float64_dequantized_model(arch: str) -> None:
    hf = MODELS_BY_ARCH[arch]
    quant, _ = qlora.qlora_model(hf, torch.float32, CPU)
    twin = qlora.float64_twin(hf, quant, CPU)
    r = qlora.forward_and_grads(quant, twin, qlora.tokens(hf["vocab_size"], CPU))
    assert r["logit_max_abs_err"] <= FP32_LOGIT_REL_ATOL * r["logit_spread"], r
    # Only the adapters get gradients (every one of them: B ≠ 0, so A's are nonzero too), never the base.
    assert r["with_grad"] and all(".lora_" in n for n in r["with_grad"]), r["with_grad"]
    assert len(r["with_grad"]) == sum(p.requires_grad for p in quant.parameters())
    assert r["zero_adapter_grads"] == [] and r["nf4_with_grad"] == []
    assert r["adapter_grad_max_rel_err"] <= FP32_GRAD_REL, r


def test_the_first_sync_sends_the_dequantized_base_plus_the_adapter_product() -> None:
    quant, _ = qlora.qlora_model(TINY_MOE, torch.float32, CPU)
    twin = qlora.float64_twin(TINY_MOE, quant, CPU)
    r = qlora.merged_sync(TINY_MOE, quant, twin, torch.float32)
    assert r["names_equal"] and r["tensors"] > 0 and r["nf4_restored"], r
    assert r["max_rel_err"] <= SYNC_REL, r
