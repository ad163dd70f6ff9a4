"""Bytes of LoRA and QLoRA trainers: a frozen (optionally 4-bit) base plus small trainable adapters.

Pure Python, like the rest of the planner. With `lora.rank` r > 0 (see `megatron/lora.py`):

* the base has no gradient and no optimizer state: only its weights count, in the training dtype,
  or — with `base_quantization: nf4` (`megatron/quantize.py`) — the linear layers' weights in NF4
  (`nf4.py`: 4-bit codes, int8 block scales, one factor per block of scales: ~0.516 bytes). Norms, the router, the
  embedding, the output layer and the small Gated DeltaNet tensors stay in the training dtype;
* adapters (PEFT's layout: q, k and v each their own A [r × h] and B [out × r]; o's A [r × a·d],
  B [h × r]) follow their base layer's split: on q/k/v (column-parallel) A is replicated and B
  split over TP, on o (row-parallel) A is split and B replicated. They have weights, fp32 grads
  and Adam states like any trained parameter, sharded by the distributed optimizer over DP;
* the reference policy is the base with the adapters switched off: no second copy;
* a quantized layer is dequantized for its matmul, forward and backward: the largest linear
  weight of a GPU exists once more, briefly — with torchao's decoder's working set
  (`dequantize_bytes_per_param`).

QLoRA builds the model from its own spec (`megatron/qlora_spec.py`): local linears and per-expert
SequentialMLPs, so one expert's weight is dequantized at a time (the largest linear is one expert's
fc1, not a layer's grouped experts); TE's norms and TE's flash attention, so the activation model of
`memory.py` (flash attention: no s² scores) holds as for the TE spec.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..nf4 import nf4_bytes_per_param
from .params import Block, Dims, Layer, ModelParams, Shard

DEQUANTIZE_INDEX_BYTES = 8
"""torchao's `NF4Tensor.get_original_weight` (0.18, nf4_tensor.py:855-881) widens both 4-bit codes
of every byte to int64 (2 × n/2 × 8 bytes) and holds them while it builds the looked-up values, the
scaled values and the stacked result (3 × n in the weight's dtype): peak (8 + 3·dtype bytes) per
weight, measured with torch's memory profiler on CPU (14.0 bf16, 20.1 fp32)."""


def dequantize_bytes_per_param(param_bytes: int) -> int:
    """Transient bytes per weight of dequantizing one NF4 linear (its dense result included)."""
    return DEQUANTIZE_INDEX_BYTES + 3 * param_bytes


QUANTIZED_COMPONENTS: tuple[str, ...] = ("attention", "linear_attention", "dense_mlp", "moe_experts",
                                         "shared_experts")
"""Components whose TP/EXPERT-sharded weights are linear layers (`quantize.py` quantizes every
frozen ColumnParallelLinear / RowParallelLinear but the output layer)."""


def adapter_params(d: Dims, gated: bool, rank: int, targets: Sequence[str], tp: int) -> tuple[int, float]:
    """(total, this GPU's share) adapter parameters of one full-attention layer."""
    q_out = d.heads * d.head_dim * (2 if gated else 1)
    kv_out = d.kv_heads * d.head_dim
    total, per_gpu = 0, 0.0
    for target, out in (("q", q_out), ("k", kv_out), ("v", kv_out)):
        if target in targets:
            total += rank * (d.hidden + out)
            per_gpu += rank * d.hidden + rank * out / tp
    if "o" in targets:
        total += rank * (d.heads * d.head_dim + d.hidden)
        per_gpu += rank * d.heads * d.head_dim / tp + rank * d.hidden
    return total, per_gpu


def total_adapter_params(params: ModelParams, rank: int, targets: Sequence[str]) -> int:
    full = sum(1 for layer in params.layers if layer.mixer == "full_attention")
    return full * adapter_params(params.dims, params.spec.gated_attention, rank, targets, 1)[0]


def largest_linear(d: Dims, gated: bool, layers: Sequence[Layer], tp: int, etp: int) -> float:
    """Parameters of the largest single linear weight on one GPU (the one dequantized at a time)."""
    q_out = d.heads * d.head_dim * (2 if gated else 1)
    sizes = [0.0]
    mixers, ffns = {layer.mixer for layer in layers}, {layer.ffn for layer in layers}
    if "full_attention" in mixers:
        sizes += [d.hidden * (q_out + 2 * d.kv_heads * d.head_dim) / tp, d.heads * d.head_dim * d.hidden / tp]
    if "linear_attention" in mixers:
        sizes.append(d.hidden * (2 * d.lin_key_heads * d.lin_key_dim + 2 * d.lin_value_heads * d.lin_value_dim) / tp)
    if "dense" in ffns:
        sizes.append(2 * d.hidden * d.intermediate / tp)            # fc1: gate and up
    if "moe" in ffns:
        sizes += [2 * d.hidden * d.moe_intermediate / etp, 2 * d.hidden * d.shared_intermediate / tp]
    return max(sizes)


def merged_copy_params(d: Dims, gated: bool, layers: Sequence[Layer], targets: Sequence[str], tp: int, ep: int,
                       etp: int) -> float:
    """Parameters on one GPU of the base weights LoRA adapts (`megatron/lora.py::merged_deltas`, at
    every sync): linear_qkv when q, k or v is a target (the fused weight), linear_proj for o, and
    with `experts` each local expert's fc1 and fc2."""
    q_out = d.heads * d.head_dim * (2 if gated else 1)
    per_layer = d.hidden * (q_out + 2 * d.kv_heads * d.head_dim) / tp if set(targets) & {"q", "k", "v"} else 0.0
    if "o" in targets:
        per_layer += d.heads * d.head_dim * d.hidden / tp
    out = per_layer * sum(1 for layer in layers if layer.mixer == "full_attention")
    if "experts" in targets and d.experts:
        moe = sum(1 for layer in layers if layer.ffn == "moe")
        out += moe * d.experts / ep * 3 * d.hidden * d.moe_intermediate / etp
    return out


@dataclass(frozen=True)
class StageParams:
    """What one GPU of a pipeline stage holds as parameters, and what of it trains."""

    weight_bytes: float
    trainable_dense: float
    """Trained parameters sharded like dense ones (DP) — the adapters, or the whole dense model."""
    trainable_expert: float
    """Trained expert parameters (expert DP); 0 with LoRA on attention."""
    frozen: float
    """Base parameters without gradient or optimizer state."""
    quantized: float
    """Of those, parameters stored quantized."""
    transient_bytes: float
    """Dequantizing the largest quantized linear: its dense copy and the decoder's working set."""


def _quantizable(b: Block) -> bool:
    return b.component in QUANTIZED_COMPONENTS and b.shard is not Shard.REPLICATED


def stage_params(params: ModelParams, layers: Sequence[Layer], blocks: Sequence[Block], tp: int, ep: int,
                 etp: int, param_bytes: int, rank: int, targets: Sequence[str],
                 quantization: str) -> StageParams:
    """Per-GPU parameter bytes of one stage: the full model when `rank` is 0, else base + adapters."""
    dense = sum(b.per_gpu(tp, ep, etp) for b in blocks if b.shard is not Shard.EXPERT)
    expert = sum(b.per_gpu(tp, ep, etp) for b in blocks if b.shard is Shard.EXPERT)
    if rank == 0:
        return StageParams((dense + expert) * param_bytes, dense, expert, 0.0, 0.0, 0.0)
    d, gated = params.dims, params.spec.gated_attention
    full = sum(1 for layer in layers if layer.mixer == "full_attention")
    adapters = full * adapter_params(d, gated, rank, targets, tp)[1]
    quantized = transient = 0.0
    if quantization == "nf4":
        quantized = sum(b.per_gpu(tp, ep, etp) for b in blocks if _quantizable(b))
        transient = largest_linear(d, gated, layers, tp, etp) * dequantize_bytes_per_param(param_bytes) \
            if quantized else 0.0
    base = (dense + expert - quantized) * param_bytes + quantized * nf4_bytes_per_param(param_bytes)
    return StageParams(base + adapters * param_bytes, adapters, 0.0, dense + expert, quantized, transient)
