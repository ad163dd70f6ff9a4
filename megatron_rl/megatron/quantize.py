"""QLoRA's frozen base: megatron-core linear weights stored in NF4 and dequantized on the fly.

`quantize_frozen_base(model, "nf4")` replaces the weight of every *frozen* ColumnParallelLinear /
RowParallelLinear of the model (attention q/k/v/o — `linear_qkv`, `linear_proj` —, dense MLPs and
the routed / shared experts of the local spec's SequentialMLP) by a torchao `NF4Tensor` (4-bit
NormalFloat codes in blocks of 64 with int8 block scales that are themselves quantized in blocks of
up to 256: QLoRA's "double quantization", ~0.52 bytes per weight). Trainable weights (the LoRA
adapters, anything a recipe leaves unfrozen) and the output layer (vocab-wide, left in the
training dtype as QLoRA does) are kept as they are.

The layer's `_forward_impl` becomes `quantized_linear`: the same communication as megatron-core's
`linear_with_frozen_weight` (all-gather of a sequence-parallel input; all-reduce of the input
gradient when the layer asks for it), around an autograd function that dequantizes the weight for
the matmul and again in backward instead of saving it, so no full-precision copy of the base lives
longer than one layer's matmul. Gradients flow to the layer's input (and so to the adapters
before it), never to the base.

Transformer Engine linears (the GPU spec) and grouped-GEMM experts keep their weights inside TE's
own kernels; quantizing those is refused with a clear error rather than silently skipped. A QLoRA
actor is built from the QLoRA spec (`qlora_spec.py`), whose linears are the local ones on every
device, with TE's norms and attention where TE exists (parameter-free or named `RMSNorm`: not refused).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..nf4 import NF4_BLOCK, nf4_scaler_block
from . import cpu_compat
from .sections import TP_SECTIONS_ATTR

cpu_compat.require_applied()

from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear  # noqa: E402
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region  # noqa: E402

SCHEMES: tuple[str, ...] = ("nf4",)
SKIPPED_MODULES: tuple[str, ...] = ("output_layer",)
"""Kept in the training dtype: the vocab-wide output layer (QLoRA leaves the LM head unquantized)."""
# Megatron's per-parameter attributes that the sharding, checkpoint and sync code read, and the
# providers' per-section TP tag (Gated DeltaNet's fused in_proj): without it a load after
# quantization cuts [q; k; v; z; β; α] in contiguous TP chunks.
PARAM_ATTRS: tuple[str, ...] = ("tensor_model_parallel", "partition_dim", "partition_stride",
                                "sequence_parallel", "allreduce", "shared", TP_SECTIONS_ATTR)


class QuantizationError(ValueError):
    """The model cannot be quantized as asked (unknown scheme, a layer kind with no code path)."""


@dataclass
class QuantizationReport:
    """What `quantize_frozen_base` changed, in bytes of this rank."""

    scheme: str
    quantized: list[str] = dataclasses.field(default_factory=list)
    """Module names whose weight is now quantized."""
    kept: list[str] = dataclasses.field(default_factory=list)
    """Linear modules left as they were (trainable, the output layer, or a shape NF4 cannot block)."""
    params: int = 0
    bytes_before: int = 0
    bytes_after: int = 0

    @property
    def bytes_saved(self) -> int:
        return self.bytes_before - self.bytes_after


def _torchao_nf4() -> Any:
    """torchao's NF4 module (imported lazily: only QLoRA runs need the package)."""
    try:
        from torchao.quantization.quantize_.workflows.nf4 import nf4_tensor
    except ImportError as exc:
        raise QuantizationError("lora.base_quantization: nf4 needs the `torchao` package "
                                f"(requirements/pins.txt): {exc}") from None
    return nf4_tensor


def is_quantized(t: torch.Tensor) -> bool:
    return type(t).__name__ == "NF4Tensor"


def tensor_nbytes(t: torch.Tensor) -> int:
    """Bytes a (possibly quantized) tensor holds: the sum of a wrapper subclass's inner tensors."""
    if hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(tensor_nbytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()


def dequantize(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A dense copy of a quantized weight (for merges and exports); other tensors pass through."""
    if is_quantized(t):
        dense = t.get_original_weight()       # type: ignore[attr-defined]
        return dense if dtype is None else dense.to(dtype)
    return t if dtype is None else t.to(dtype)


def to_nf4(weight: torch.Tensor) -> torch.Tensor | None:
    """The NF4 form of `weight`, or None when its size is not a whole number of blocks."""
    if weight.numel() % NF4_BLOCK:
        return None
    scaler = nf4_scaler_block(weight.numel() // NF4_BLOCK)
    return _torchao_nf4().to_nf4(weight.detach(), block_size=NF4_BLOCK, scaler_block_size=scaler)


class _FrozenQuantizedLinear(torch.autograd.Function):
    """y = x Wᵀ (+ b) with W quantized and frozen: dequantized in forward and again in backward."""

    @staticmethod
    def forward(ctx: Any, input: torch.Tensor, qweight: torch.Tensor, bias: torch.Tensor | None,
                allreduce_dgrad: bool, tp_group: Any) -> torch.Tensor:
        ctx.qweight, ctx.allreduce_dgrad, ctx.tp_group = qweight, allreduce_dgrad, tp_group
        output = torch.matmul(input, dequantize(qweight, input.dtype).t())
        return output if bias is None else output + bias

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:
        weight = dequantize(ctx.qweight, grad_output.dtype)
        grad_input = grad_output.reshape(-1, grad_output.size(-1)).matmul(weight)
        grad_input = grad_input.reshape(*grad_output.shape[:-1], weight.size(1))
        if ctx.allreduce_dgrad:
            dist.all_reduce(grad_input, group=ctx.tp_group)
        return grad_input, None, None, None, None


def quantized_linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     gradient_accumulation_fusion: bool, allreduce_dgrad: bool, sequence_parallel: bool,
                     tp_group: Any, grad_output_buffer: Any = None, wgrad_deferral_limit: Any = None,
                     gtp_remat_size: int = 1) -> torch.Tensor:
    """megatron-core's `_forward_impl` signature (see `linear_with_frozen_weight`) for a quantized
    frozen weight. The weight-gradient options cannot apply: the weight has no gradient."""
    if gtp_remat_size > 1:
        raise QuantizationError("a quantized base cannot be GTP-sharded (gtp_remat_size > 1)")
    if sequence_parallel:
        input = gather_from_sequence_parallel_region(input, tensor_parallel_output_grad=True, group=tp_group)
    out: torch.Tensor = _FrozenQuantizedLinear.apply(input, weight, bias, allreduce_dgrad, tp_group)
    return out


def _refuse_unsupported(name: str, module: torch.nn.Module) -> None:
    kind = type(module).__name__
    frozen = [n for n, p in module.named_parameters(recurse=False) if not p.requires_grad]
    if frozen and (kind.startswith("TE") or kind == "GroupedMLP"):
        raise QuantizationError(
            f"{name} ({kind}): a quantized base has a code path only for megatron-core's local "
            "linears (ColumnParallelLinear / RowParallelLinear, SequentialMLP experts); build the "
            "model from the QLoRA spec (megatron/qlora_spec.py `for_quantized_base`, as the actor does "
            "for lora.base_quantization)")


def _frozen_like(data: torch.Tensor, like: torch.Tensor) -> torch.nn.Parameter:
    """A frozen parameter holding `data`, with `like`'s megatron attributes."""
    param = torch.nn.Parameter(data, requires_grad=False)
    for attr in PARAM_ATTRS:
        if hasattr(like, attr):
            setattr(param, attr, getattr(like, attr))
    return param


@contextmanager
def dequantized_weights(modules: Iterable[torch.nn.Module]) -> Iterator[None]:
    """Within: each module's quantized weight is a dense copy in its original dtype (merge a LoRA
    delta into it, sync or export it); on exit the quantized parameter itself is put back, so
    nothing is re-quantized. Other modules are left alone."""
    swapped: list[tuple[torch.nn.Module, torch.Tensor]] = []
    for module in modules:
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor) and is_quantized(weight):
            swapped.append((module, weight))
    try:
        for module, q in swapped:
            module.weight = _frozen_like(dequantize(q), q)
        yield
    finally:
        for module, q in swapped:
            module.weight = q


def _quantize_module(module: torch.nn.Module) -> tuple[int, int] | None:
    weight: torch.Tensor = module.weight   # type: ignore[assignment]
    q = to_nf4(weight)
    if q is None:
        return None
    before = tensor_nbytes(weight)
    param = _frozen_like(q, weight)
    module.weight = param
    # An instance attribute shadows the class's `_forward_impl` (which picks by requires_grad).
    module._forward_impl = quantized_linear   # type: ignore[assignment]
    return before, tensor_nbytes(param)


def _modules(chunks: torch.nn.Module | Sequence[torch.nn.Module]) -> Iterable[tuple[str, torch.nn.Module]]:
    for chunk in [chunks] if isinstance(chunks, torch.nn.Module) else chunks:
        yield from chunk.named_modules()


def quantize_frozen_base(chunks: torch.nn.Module | Sequence[torch.nn.Module],
                         scheme: str = "nf4") -> QuantizationReport:
    """Quantize the frozen linear weights of the model chunks in place (call after the base is
    frozen, e.g. after LoRA is applied, and after the model is on its device)."""
    if scheme not in SCHEMES:
        raise QuantizationError(f"lora.base_quantization: {scheme!r} has no code path; "
                                f"allowed: {', '.join(SCHEMES)} (or 'none')")
    report = QuantizationReport(scheme)
    for name, module in _modules(chunks):
        _refuse_unsupported(name, module)
        if not isinstance(module, (ColumnParallelLinear, RowParallelLinear)) or module.weight is None:
            continue
        weight = module.weight
        if (weight.requires_grad or name.split(".")[-1] in SKIPPED_MODULES or is_quantized(weight)):
            report.kept.append(name)
            continue
        done = _quantize_module(module)
        if done is None:
            report.kept.append(name)
            continue
        report.quantized.append(name)
        report.params += weight.numel()
        report.bytes_before += done[0]
        report.bytes_after += done[1]
    return report
