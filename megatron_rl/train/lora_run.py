"""Every weight sync of a run, LoRA or not: with LoRA only the adapted tensors (merged)."""

from __future__ import annotations

import torch

from ..megatron.actor import Actor
from ..megatron.lora import merged_deltas
from ..weights.lora_sync import sync_lora
from ..weights.map import WeightAdapter
from ..weights.sync import SyncReport, Transport, sync_weights


def sync(actor: Actor, adapter: WeightAdapter, transport: Transport | None, version: int,
         dtype: torch.dtype) -> SyncReport | None:
    """Full sync, or with LoRA only the adapted tensors (merged). QLoRA's first sync sends every
    tensor (the NF4 base dequantized, bucket by bucket): the server starts from the original base,
    the trainer's policy is the base's NF4 image, and the log-prob check must compare the same model."""
    if actor.lora is None:
        return sync_weights(actor.model, adapter, transport, version, dtype)
    if actor.quantization is not None and not actor.base_synced:
        with merged_deltas(actor.model):
            report = sync_weights(actor.model, adapter, transport, version, dtype)
        actor.base_synced = True
        return report
    return sync_lora(actor.model, adapter, transport, version, dtype)
