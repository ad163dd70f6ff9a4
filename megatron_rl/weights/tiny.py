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


def build_release_shaped_checkpoint(released: dict[str, Any], width: dict[str, Any], out_dir: str | Path,
                                    seed: int = 0, mtp_layers: int = 0, shards: int = 4) -> Path:
    """A random checkpoint laid out like a released one, at small width.

    `released` is the release's `config.json`; `width` overrides its size keys (hidden size, heads,
    experts, layers, vocabulary). The written config keeps every released key and value otherwise
    (`torch_dtype`, `transformers_version`, `rope_scaling: null`, ...); the tensors carry the
    release's names and dtype, in `shards` safetensors files with an index, and with `mtp_layers`
    the multi-token-prediction tensors Qwen3-Next releases ship (`mtp.fc`, `mtp.pre_fc_norm_*`,
    `mtp.norm`, `mtp.layers.N.*` shaped like a full-attention MoE layer). Weights are scaled so
    the logits are O(1) and every 1-D weight is moved off its initial value (a swapped norm or an
    off-by-one convention then shows); 1-D weights stay in [w0 − 0.4, w0 + 0.4].
    """
    import tempfile

    from transformers import AutoConfig, AutoModelForCausalLM

    from .hf_io import HFCheckpointReader, HFCheckpointWriter

    config = {**released, **width}
    dtype = getattr(torch, str(config.get("torch_dtype") or config.get("dtype") or "float32"))
    g = torch.Generator().manual_seed(seed)
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        generator_state = torch.random.get_rng_state()
        torch.manual_seed(seed)
        try:
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp), dtype=torch.float32)
        finally:
            torch.random.set_rng_state(generator_state)
        model.save_pretrained(Path(tmp) / "hf")          # on-disk (per-expert) names, as released
        reader = HFCheckpointReader(Path(tmp) / "hf")
        tensors = {name: _perturbed(reader.get(name), g).to(dtype) for name in reader.names()}
        reader.close()
    tensors.update(_mtp_tensors(config, tensors, mtp_layers, g, dtype))
    writer = HFCheckpointWriter(out_dir, max_shard_bytes=sum(t.nbytes for t in tensors.values()) // shards + 1)
    writer.add_many(tensors.items())
    return writer.finish(config=config)


def _perturbed(t: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    if t.dim() == 1:
        return t + (torch.rand(t.shape, generator=g) - 0.5) * 0.8
    return t * 4


def _mtp_tensors(config: dict[str, Any], tensors: dict[str, torch.Tensor], layers: int, g: torch.Generator,
                 dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Qwen3-Next's MTP block: fc [h, 2h], three norms, and layers shaped like a full-attention layer."""
    if not layers:
        return {}
    h = config["hidden_size"]
    # The first full-attention layer, read off the tensors (weights/ must not import a model folder).
    first = min(int(n.split(".")[2]) for n in tensors if n.startswith("model.layers.") and ".self_attn.q_proj." in n)
    template = f"model.layers.{first}."
    out = {"mtp.fc.weight": torch.randn(h, 2 * h, generator=g) * 0.05}
    out.update({f"mtp.{n}.weight": 1 + 0.1 * torch.randn(h, generator=g)
                for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")})
    for i in range(layers):
        out.update({f"mtp.layers.{i}." + n[len(template):]: torch.randn(t.shape, generator=g) * t.float().std()
                    for n, t in tensors.items() if n.startswith(template)})
    return {n: t.to(dtype) for n, t in out.items()}
