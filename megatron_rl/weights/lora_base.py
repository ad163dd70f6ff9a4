"""The base a LoRA checkpoint belongs to (adapters mean nothing without it): its identity, what a
LoRA checkpoint records besides the adapters, and loading that base back (training's resume and
the converter's `mcore-to-hf`). The adapter-only weight syncs are `sync/lora.py`.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from ..config.schema import LoraConfig
from ..megatron.actor import Actor
from ..megatron.checkpoint import load_weights
from ..model_config import is_megatron_checkpoint
from .loading import load_hf_into_model
from .map import WeightAdapter


def base_identity(path: str | Path) -> dict[str, Any]:
    """Path and fingerprint of a base checkpoint (HF directory or Megatron dist-checkpoint): a
    SHA-256 over its config/metadata JSON files' bytes and every file's relative name and size.
    Cheap for a 235B base (no weight bytes are read), and it changes when the base is replaced."""
    root = Path(path).resolve()
    h = hashlib.sha256()
    for f in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = f.relative_to(root).as_posix()
        h.update(f"{rel}\0{f.stat().st_size}\0".encode())
        if f.suffix == ".json" and f.stat().st_size < 1 << 20:
            h.update(f.read_bytes())
    return {"path": str(root), "sha256": h.hexdigest()}


def check_base(recorded: dict[str, Any], path: str | Path, where: str) -> None:
    """Refuse adapters trained on another base than `path`."""
    now = base_identity(path)
    if recorded.get("sha256") != now["sha256"]:
        raise ValueError(f"{where}: the LoRA adapters were trained on the base {recorded.get('path')} "
                         f"(sha256 {str(recorded.get('sha256'))[:12]}…), but the base at {now['path']} "
                         f"differs (sha256 {now['sha256'][:12]}…)")


def lora_record(rank: int, alpha: float, targets: list[str], base: str | Path, hf_dir: str | Path) -> dict[str, Any]:
    """What a LoRA checkpoint records besides the adapters (JSON entries of complete.json's
    `extra`): the adapters' shape and base under `lora`, the model's HF config under `hf_config`
    (where `convert mcore-to-hf` reads it)."""
    return {"lora": {"rank": rank, "alpha": alpha, "targets": list(targets), "base": base_identity(base)},
            "hf_config": json.loads((Path(hf_dir) / "config.json").read_text())}


def lora_config(record: dict[str, Any] | None) -> LoraConfig | None:
    """The adapters' shape recorded in a checkpoint (None: a full checkpoint)."""
    if record is None:
        return None
    return LoraConfig(rank=record["rank"], alpha=record["alpha"], targets=list(record["targets"]))


def load_recorded_base(actor: Actor, record: dict[str, Any], where: str, adapter: WeightAdapter) -> None:
    """The frozen base a LoRA checkpoint's adapters belong to (checked by its fingerprint); an HF
    base loads through `adapter`, the model's weight map."""
    path = record["base"]["path"]
    check_base(record["base"], path, where)
    if is_megatron_checkpoint(path):
        load_weights(actor, path)
    else:
        load_hf_into_model(actor.model, path, adapter)
