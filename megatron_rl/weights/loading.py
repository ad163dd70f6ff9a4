"""Load an HF checkpoint into a (sharded) Megatron model through the architecture's weight map."""

from __future__ import annotations

from pathlib import Path

import torch

from ..model_config import read_hf_config
from .adapters import adapter_for
from .hf_io import HFCheckpointReader
from .sharding import load_full_tensors


def load_hf_into_model(model: torch.nn.Module, hf_dir: str | Path) -> list[str]:
    """Every local parameter of `model` from `hf_dir`; returns the global Megatron names loaded."""
    adapter = adapter_for(read_hf_config(hf_dir))
    reader = HFCheckpointReader(hf_dir)

    def full(name: str) -> torch.Tensor:
        entry = adapter.entry_for_mcore(name)
        return adapter.to_mcore(entry, {n: reader.get(n) for n in entry.hf})

    try:
        return load_full_tensors(model, full)
    finally:
        reader.close()
