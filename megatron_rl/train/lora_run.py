"""LoRA in a training session: the reference is the actor's own base, syncs send merged touched
tensors, checkpoints record (and resumes check) the base the adapters belong to."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ..config.schema import RecipeConfig
from ..megatron.actor import Actor
from ..megatron.checkpoint import COMPLETE
from ..megatron.lora import adapters_disabled
from ..types import TrainBatch
from ..weights.lora_base import check_base, lora_record


class BaseReference:
    """The reference policy of `model.reference: init` under LoRA: the actor with its adapters
    switched off (the frozen base is the initial model), no second copy of the weights."""

    def __init__(self, actor: Actor) -> None:
        self.actor = actor

    def compute_logprobs(self, batch: TrainBatch, temperature: float) -> torch.Tensor:
        # The reference routes by itself, as a separate reference actor does (`routing_replay_default`).
        with adapters_disabled(self.actor.model):
            return self.actor.compute_logprobs(batch, temperature, replay=False)


def uses_base_reference(cfg: RecipeConfig) -> bool:
    return cfg.lora.rank > 0 and cfg.model.reference == "init"


def checkpoint_extra(cfg: RecipeConfig, init_path: str, hf_dir: str) -> dict[str, Any]:
    """`extra` entries of a LoRA checkpoint ({} without LoRA)."""
    lo = cfg.lora
    return lora_record(lo.rank, lo.alpha, list(lo.targets), init_path, hf_dir) if lo.rank > 0 else {}


def check_resume(cfg: RecipeConfig, checkpoint: Path, init_path: str) -> None:
    """A LoRA checkpoint resumes only onto its own base and adapter shape (checked before loading)."""
    where = str(checkpoint)
    rec = json.loads((checkpoint / COMPLETE).read_text()).get("extra", {}).get("lora")
    if (rec is None) != (cfg.lora.rank == 0):
        raise ValueError(f"{where}: checkpoint {'has no' if rec is None else 'has'} LoRA adapters, the recipe "
                         f"{'trains' if cfg.lora.rank else 'does not train'} LoRA (lora.rank {cfg.lora.rank})")
    if rec is not None:
        got = (rec["rank"], rec["alpha"], rec["targets"])
        if got != (cfg.lora.rank, cfg.lora.alpha, list(cfg.lora.targets)):
            raise ValueError(f"{where}: adapters are (rank, alpha, targets) {got}, the recipe asks for "
                             f"{(cfg.lora.rank, cfg.lora.alpha, list(cfg.lora.targets))}")
        check_base(rec["base"], init_path, where)
