"""NF4 storage layout (QLoRA's 4-bit NormalFloat with double-quantized scales), shared by the
quantizer (`megatron/quantize.py`, torchao's NF4Tensor) and the planner (`planner/lora.py`).

Pure Python: the planner runs without torch. Per tensor of n weights: n/2 bytes of 4-bit codes,
one int8 scale per NF4_BLOCK weights, and one factor in the original dtype per second-level block
of scales (torchao's per-tensor constants, a 16-entry code table and the scales' mean, add < 70 bytes).
"""

from __future__ import annotations

NF4_BLOCK = 64
"""Weights per 4-bit block with one scale (QLoRA's and torchao's default)."""
NF4_SCALER_BLOCK = 256
"""Block scales per double-quantization block, at most (small tensors use the largest divisor)."""


def nf4_scaler_block(num_blocks: int) -> int:
    """The largest divisor of the block count up to NF4_SCALER_BLOCK (torchao needs whole
    second-level blocks)."""
    return next(s for s in range(min(NF4_SCALER_BLOCK, num_blocks), 0, -1) if num_blocks % s == 0)


def nf4_bytes(numel: int, orig_bytes: int) -> int:
    """Bytes of one NF4 tensor of `numel` weights (a multiple of NF4_BLOCK) quantized from a dtype of
    `orig_bytes` bytes, but for torchao's per-tensor constants."""
    blocks = numel // NF4_BLOCK
    return numel // 2 + blocks + (blocks // nf4_scaler_block(blocks)) * orig_bytes


def nf4_bytes_per_param(orig_bytes: int) -> float:
    """The same per weight for a large tensor (whole second-level blocks)."""
    return 0.5 + 1 / NF4_BLOCK + orig_bytes / (NF4_BLOCK * NF4_SCALER_BLOCK)
