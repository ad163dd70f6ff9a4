"""Load an HF checkpoint into a (sharded) Megatron model through its architecture's weight map
(`megatron_rl.models.weight_map`, which the caller holds)."""

from __future__ import annotations

from pathlib import Path

import torch

from .hf_io import HFCheckpointReader
from .map import WeightAdapter
from .sharding import load_full_tensors


def load_hf_into_model(model: torch.nn.Module, hf_dir: str | Path, adapter: WeightAdapter) -> list[str]:
    """Every local parameter of `model` from `hf_dir` through `adapter` (the model's weight map);
    returns the global Megatron names loaded."""
    reader = HFCheckpointReader(hf_dir)

    def full(name: str) -> torch.Tensor:
        entry = adapter.entry_for_mcore(name)
        return adapter.to_mcore(entry, {n: reader.get(n) for n in entry.hf})

    try:
        return load_full_tensors(model, full)
    finally:
        reader.close()
