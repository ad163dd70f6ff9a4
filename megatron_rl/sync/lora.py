"""LoRA weights leaving Megatron: only the base tensors an adapter touches, merged (W + (α/r)·B·A).

vLLM keeps the frozen base it started from; each sync overwrites just the adapted tensors with
base + current delta (never delta on top of the last merge), so the server's weights equal the
trainer's adapted model after every sync, whatever happened before (a restart, a resume).
The base a LoRA checkpoint belongs to is `weights/lora_base.py`.
"""

from __future__ import annotations

import torch

from ..megatron.actor import Actor
from ..megatron.lora import merged_deltas
from ..weights.map import WeightAdapter
from . import SyncReport, Transport, sync_weights


def sync_lora(model: torch.nn.Module, adapter: WeightAdapter, transport: Transport | None, version: int,
              dtype: torch.dtype) -> SyncReport | None:
    """Collective: merge each adapter into its base shard, send only the touched tensors, restore."""
    with merged_deltas(model) as touched:
        return sync_weights(model, adapter, transport, version, dtype, only=touched)


def sync_actor(actor: Actor, adapter: WeightAdapter, transport: Transport | None, version: int,
               dtype: torch.dtype, *, whole: bool = False) -> SyncReport | None:
    """Full sync, or with LoRA only the adapted tensors (merged). `whole`: every tensor, merged
    (QLoRA's first sync, the NF4 base dequantized bucket by bucket: the server starts from the original
    base, the trainer's policy is the base's NF4 image, and the log-prob check must compare the same
    model). Which sync is the first is the caller's to know (`train/publisher.py`)."""
    if actor.lora is None:
        return sync_weights(actor.model, adapter, transport, version, dtype)
    if whole:
        with merged_deltas(actor.model):
            return sync_weights(actor.model, adapter, transport, version, dtype)
    return sync_lora(actor.model, adapter, transport, version, dtype)
