"""Tiny random Hugging Face checkpoints, built locally (there is no model hub here).

Used by tests, benchmarks and the CPU demo. The HF fields come from a recipe's `model.tiny`;
the architecture's own `transformers` class builds and saves the model, so the checkpoint is
exactly what vLLM and transformers load.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch


def build_tiny_hf_checkpoint(hf_fields: dict[str, Any], out_dir: str | Path, seed: int = 0,
                             dtype: torch.dtype = torch.float32) -> Path:
    """Create (or reuse, when the same fields and seed were built before) a random checkpoint."""
    from transformers import AutoConfig, AutoModelForCausalLM

    out = Path(out_dir)
    stamp = json.dumps({"fields": hf_fields, "seed": seed, "dtype": str(dtype)}, sort_keys=True)
    if (out / ".tiny-stamp").is_file() and (out / ".tiny-stamp").read_text() == stamp:
        return out
    fields = dict(hf_fields)
    model_type = fields.pop("model_type")
    fields.pop("architectures", None)
    config = AutoConfig.for_model(model_type, **fields)
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    finally:
        torch.random.set_rng_state(generator_state)
    model.save_pretrained(out)
    (out / ".tiny-stamp").write_text(stamp)
    return out
